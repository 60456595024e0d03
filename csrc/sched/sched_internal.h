/* Helpers shared by the Group Generator's sources; not part of the public API. */
#ifndef RPL_SCHED_INTERNAL_H
#define RPL_SCHED_INTERNAL_H

#include <stdarg.h>
#include <stdio.h>

#include "rpl_sched.h"

#if defined(__GNUC__)
#define RPL_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define RPL_PRINTF(a, b)
#endif

/* Fills err (if any) and returns code, so callers can `return rpl_sched_fail(...)`. */
static inline RPL_PRINTF(3, 4) rpl_status rpl_sched_fail(rpl_error *err, rpl_status code,
                                                          const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    err->code = code;
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
  }
  return code;
}

/* splitmix64: tiny, seedable, good enough to draw groups; state lives in the caller's object. */
static inline uint64_t rpl_rng_next(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [0, n), n > 0; rejection removes modulo bias. */
static inline uint32_t rpl_rng_below(uint64_t *state, uint32_t n) {
  uint64_t limit = UINT64_MAX - (UINT64_MAX % n);
  uint64_t x;
  do {
    x = rpl_rng_next(state);
  } while (x >= limit);
  return (uint32_t)(x % n);
}

void rpl_sort_ints(int *a, int n);

/* ---- the client's handling of coordinator replies, without sockets (client.c) ------------
 * Pure functions, so the fuzzer (coordinator/fuzz/fuzz_client.c) drives exactly what the
 * client runs. */

/* 1 if buf[0..n) is the reply awaited under `seq`: it parses (ranks < nworkers), carries
 * the client's token (errors too) and echoes seq; *m is then filled. */
int rpl_client_accept(const void *buf, size_t n, const uint8_t token[RPL_TOKEN_LEN],
                      int nworkers, uint32_t seq, rpl_msg *m);

typedef enum {
  RPL_REPLY_GROUP, /* members[0..*n), *group_id filled */
  RPL_REPLY_PASS,  /* the round is passed: members = {rank}, *group_id = 0 */
  RPL_REPLY_RETRY, /* cancelled: ask again */
  RPL_REPLY_LOST,  /* the coordinator does not know us (restarted): fail over */
  RPL_REPLY_FAIL   /* err says why */
} rpl_reply_kind;

/* What an accepted reply to REQUEST(round) of `rank` means; members holds cap ints. */
rpl_reply_kind rpl_client_request_reply(const rpl_msg *m, uint64_t round, int rank,
                                        int *members, int cap, int *n, uint64_t *group_id,
                                        const char *endpoint, rpl_error *err);

enum { RPL_BEAT_IGNORE, RPL_BEAT_ACK, RPL_BEAT_LOST };
/* What a message on the heartbeat socket means (RPL_BEAT_*). */
int rpl_client_beat_reply(const void *buf, size_t n, const uint8_t token[RPL_TOKEN_LEN],
                          int nworkers);

#endif
