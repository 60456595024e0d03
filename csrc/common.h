/*
 * common.h - small helpers shared by the core's files (internal to csrc/).
 */
#ifndef RPL_COMMON_H
#define RPL_COMMON_H

#include <stdarg.h>

#include "ripples.h"

/* Fills `err` (which may be NULL) and returns `code`, so callers can `return rpl_fail(...)`. */
rpl_status rpl_fail(rpl_error *err, rpl_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Like rpl_fail, appending ": <strerror(errnum)>". */
rpl_status rpl_fail_errno(rpl_error *err, rpl_status code, int errnum, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Seconds on a monotonic clock. */
double rpl_now(void);

/* Names the calling thread (truncated to the 15 characters Linux allows). */
void rpl_set_thread_name(const char *name);

#define RPL_MIN(a, b) ((a) < (b) ? (a) : (b))
#define RPL_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif /* RPL_COMMON_H */
