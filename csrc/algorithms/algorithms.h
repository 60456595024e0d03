/*
 * algorithms.h - the collective algorithms, one per operation kind (internal to csrc/).
 *
 * Each runs one operation over an rpl_run (ctx.h) and touches peers only through it. The
 * engine dispatches to them; partial rounds use rpl_allreduce_buf on their group. Sends and
 * recvs are not algorithms: the engine runs them in batches (p2p_batch.c).
 */
#ifndef RPL_ALGORITHMS_H
#define RPL_ALGORITHMS_H

#include "../ctx.h"
#include "../ripples.h"

rpl_status rpl_algo_allreduce(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_broadcast(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_allgather(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_reduce_scatter(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_alltoall(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_gather(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_scatter(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_reduce(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_barrier(rpl_run *run, const rpl_op_desc *d); /* barrier.c */

/* All-reduce of one buffer in place over the run's ranks; AVG divides by their number. */
rpl_status rpl_allreduce_buf(rpl_run *run, const rpl_buf *b, rpl_redop op, unsigned step);

/* The compressed average of a partial round (compressed.c, docs/compression.md): y holds
 * `count` float32 values (this member's buffer plus its residual); on RPL_OK out holds the
 * group's average as this member sees it, and y the new residual y - deQ(Q(y)). On failure
 * out and y are unspecified (the caller keeps its own copies). */
rpl_status rpl_compressed_average(rpl_run *run, float *y, size_t count, rpl_compress mode,
                                  float *out);

/* Single copy between ranks of one host (single_copy.c), used by rpl_allreduce_buf. _applies
 * says whether the run may try it (every member on this host, a large enough buffer): the same
 * answer on every member. The all-reduce then agrees with the members whether all may read
 * each other's memory; *used = 0 (with RPL_OK) means they may not and nothing was reduced. */
int rpl_single_copy_applies(const rpl_run *run, size_t bytes);
rpl_status rpl_single_copy_allreduce(rpl_run *run, const rpl_buf *b, rpl_redop op,
                                     unsigned step, int *used);

#endif /* RPL_ALGORITHMS_H */
