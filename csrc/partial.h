/*
 * partial.h - partial all-reduce rounds of one communicator (internal to csrc/).
 *
 * Owns where groups come from (the static schedule, the coordinator client, or the caller:
 * rpl_partial_give), the round counter, the per-round statistics and trace. The engine calls in from its progress thread;
 * statistics may be read from any thread. A round reduces its group's buffers with the exact
 * all-reduce (algorithms/algorithms.h) over a run (ctx.h) narrowed to the group. Each
 * schedule's fence at the coordinator, and its fence domain, are in fence.h.
 */
#ifndef RPL_PARTIAL_H
#define RPL_PARTIAL_H

#include "ctx.h"
#include "ripples.h"

typedef struct rpl_partial rpl_partial;

rpl_status rpl_partial_create(const rpl_partial_config *cfg, int rank, int size,
                              double timeout_s, rpl_partial **out, rpl_error *err);
/* Tells the coordinator this worker left (once; no-op for the static schedule). */
void rpl_partial_leave(rpl_partial *p);
void rpl_partial_destroy(rpl_partial *p);

/* 1 if the call is a true partial round: SUM or AVG over floating buffers only. */
int rpl_partial_eligible(const rpl_op_desc *d);
void rpl_partial_count_fallback(rpl_partial *p);

/* Fences at the coordinator before an exact collective, unless already fenced. */
void rpl_partial_before_exact(rpl_partial *p);
/* After it: unfences once no exact collective of the process runs any more, unless `more`
 * (another is queued right behind, so the fence spans both: two messages, not four). */
void rpl_partial_after_exact(rpl_partial *p, int more);

/* rpl_comm_fence_alone (ripples.h): this schedule leaves its fence domain. */
void rpl_partial_fence_alone(rpl_partial *p);

/* One round. `run` comes with the communicator's transport and sizes; this fills in the group.
 * Failures never break the communicator: connections to the group are reset instead. */
rpl_status rpl_partial_run(rpl_partial *p, rpl_run *run, const rpl_op_desc *d, rpl_error *err);

void rpl_partial_get_stats(const rpl_partial *p, rpl_partial_stats *out);
size_t rpl_partial_get_trace(const rpl_partial *p, uint64_t from, rpl_trace_entry *out,
                             size_t cap);
/* rpl_comm_partial_last and rpl_comm_partial_give (ripples.h), once partial rounds are on.
 * The engine refuses a give while a round is queued or running; this refuses a second one. */
int rpl_partial_last(const rpl_partial *p, rpl_round_outcome *out, int *members, int cap);
rpl_status rpl_partial_expect(rpl_partial *p, rpl_error *err);
int rpl_partial_expecting(const rpl_partial *p);
/* Shutdown: a round waiting for its given group stops waiting (RPL_ERR_CLOSED). */
void rpl_partial_interrupt(rpl_partial *p);
int rpl_partial_group(const rpl_partial *p, uint64_t round, double timeout_s,
                      rpl_round_outcome *out, int *members, int cap);
rpl_status rpl_partial_give(rpl_partial *p, const int *members, int n, uint64_t group_id,
                            rpl_error *err);

#endif /* RPL_PARTIAL_H */
