/*
 * fence.h - fence domains: exact collectives fence the dynamic schedules (internal to csrc/).
 *
 * A worker inside an exact collective cannot serve a group the coordinator forms for it, so
 * before one it tells the coordinator (a fence) and after it (an unfence), for every dynamic
 * schedule of its fence domain (ripples.h, rpl_domain: the communicators of one process).
 * Each schedule (partial.c) embeds an rpl_fence; this file owns the domain and its lock.
 *
 * Threads: the fence of any schedule may be set by whichever thread runs an exact collective
 * on a communicator of the domain; `fenced` is atomic and the member list is under the
 * domain's lock. A schedule leaves its domain before it is destroyed.
 */
#ifndef RPL_FENCE_H
#define RPL_FENCE_H

#include <stdint.h>

#include "ripples.h"
#include "sched/rpl_sched.h"

/* One schedule's side of the fence (plain struct, zeroed, embedded in its owner). */
typedef struct rpl_fence {
  rpl_domain *domain;      /* NULL = this schedule alone */
  rpl_gg_client *client;   /* NULL = a static schedule: never fenced (not owned) */
  int fenced;              /* atomic: set by any domain member's exact op, cleared when the
                              last one ends (an unfence) or by a request */
  int left;                /* the worker left the coordinator: no more fences */
  int armed;               /* atomic: set by the first request; no fences before it */
  uint64_t fences, unfences; /* atomic: messages sent (rpl_partial_stats) */
} rpl_fence;

/* Joins `d` (NULL: none). Fails only out of memory. */
rpl_status rpl_fence_join(rpl_fence *f, rpl_domain *d, rpl_error *err);
/* Leaves the domain, if any (before the owner is freed). */
void rpl_fence_leave(rpl_fence *f);
/* Leaves the domain for good while the owner lives on: its exact collectives fence only its
 * own schedule from then on, and the others' no longer fence it (unfenced now if they had).
 * The caller makes sure nothing of the owner runs (no exact collective, no request). */
void rpl_fence_go_alone(rpl_fence *f);

/* Before an exact collective: fences every schedule of the domain (or this one alone). */
void rpl_fence_before_exact(rpl_fence *f);
/* After it: unfences once no exact collective of the domain runs any more, unless `more`. */
void rpl_fence_after_exact(rpl_fence *f, int more);

/* Around a group request, which the coordinator counts as an unfence: clears the flag before
 * it, and fences again after it while an exact collective of the domain runs. The first
 * request arms the fence: before it nobody can wait for this worker (the coordinator forms
 * its groups from requests, and a worker that has never asked is not yet in one it must
 * serve), so warm-up's exact steps send the coordinator nothing. */
void rpl_fence_before_request(rpl_fence *f);
void rpl_fence_after_request(rpl_fence *f);

#endif /* RPL_FENCE_H */
