/* A growing text buffer for the coordinator's documents: the status JSON (coord_core.c) and
 * the status table (status_table.c). Coordinator-internal. */
#ifndef RPL_COORD_TEXT_H
#define RPL_COORD_TEXT_H

#include <stddef.h>

#include "common.h" /* RPL_PRINTF */

/* p holds len bytes of text, NUL-terminated, in cap allocated. A failed allocation (or format)
 * sets oom and later appends do nothing, so a writer checks oom once, at the end. The caller
 * owns p (free it). */
typedef struct coord_text {
  char *p;
  size_t len, cap;
  int oom;
} coord_text;

/* An empty text with cap bytes allocated: 0, or -1 when out of memory. */
int coord_text_init(coord_text *t, size_t cap);
/* Appends printf-style, growing p as needed. */
RPL_PRINTF(2, 3) void coord_printf(coord_text *t, const char *fmt, ...);

#endif
