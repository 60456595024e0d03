/* A growing text buffer: see coord_text.h. */
#include "coord_text.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

int coord_text_init(coord_text *t, size_t cap) {
  t->p = malloc(cap);
  t->len = 0;
  t->cap = cap;
  t->oom = t->p == NULL;
  if (t->oom) return -1;
  t->p[0] = '\0';
  return 0;
}

void coord_printf(coord_text *t, const char *fmt, ...) {
  if (t->oom) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->p + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->oom = 1;
      return;
    }
    if ((size_t)n < t->cap - t->len) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = 2 * t->cap + (size_t)n;
    char *np = realloc(t->p, cap);
    if (!np) {
      t->oom = 1;
      return;
    }
    t->p = np;
    t->cap = cap;
  }
}
