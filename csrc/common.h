/*
 * common.h - the lowest layer (library ripples_base): the one error formatter and small helpers
 * shared by the core, the Group Generator (csrc/sched) and the coordinator. Not public API.
 */
#ifndef RPL_COMMON_H
#define RPL_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "ripples.h"

/* printf-style checking of a function's format (argument a) and its values (from b). */
#define RPL_PRINTF(a, b) __attribute__((format(printf, a, b)))

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

/* A failure's cause as one rank passes it to its peers when it gives up on its links (see
 * transport.h): "<status>|<rank that failed first>|<message>", so that a peer can raise the
 * same kind of error (a mismatch stays a mismatch) naming where it was found. _split returns
 * the status (RPL_ERR_PEER for text without the prefix) and points *msg at the message. */
void rpl_cause_make(char *out, size_t cap, rpl_status code, int rank, const char *msg);
rpl_status rpl_cause_split(const char *cause, int *rank, const char **msg);

/* The lower median of v[0..n) (its ((n-1)/2)-th smallest value), 0 if n <= 0. Reorders v;
 * O(n) expected (Hoare's selection). v must hold no NaN. */
double rpl_lower_median(double *v, int n);

/* FNV-1a, 64 bit: a cheap, stable hash of bytes (not a secret's protection). Chain calls by
 * passing the previous result as h; start from RPL_FNV1A_INIT. */
#define RPL_FNV1A_INIT 1469598103934665603ull
static inline uint64_t rpl_fnv1a(uint64_t h, const void *data, size_t n) {
  const unsigned char *b = (const unsigned char *)data;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

#define RPL_MIN(a, b) ((a) < (b) ? (a) : (b))
#define RPL_MAX(a, b) ((a) > (b) ? (a) : (b))

#endif /* RPL_COMMON_H */
