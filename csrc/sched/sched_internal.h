/* Helpers shared by the Group Generator's sources; not part of the public API. */
#ifndef RPL_SCHED_INTERNAL_H
#define RPL_SCHED_INTERNAL_H

#include "common.h" /* rpl_fail: the one error formatter, shared with the core */
#include "rpl_sched.h"

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

#endif
