/*
 * engine.h - what an algorithm sees while it runs (internal to csrc/).
 *
 * The engine pops an operation from the communicator's queue and calls the algorithm for its
 * kind with an rpl_run: the communicator's transport, the operation's deadline and sequence
 * number, and reusable scratch memory. An algorithm is a sequence of steps; each step is a
 * small array of transfers handed to rpl_exchange. Algorithms never write a caller's output
 * before the data it depends on has fully arrived.
 *
 * Sends and recvs are not algorithms: consecutive ones at the head of the queue form a batch
 * whose transfers progress together (rpl_tr_run_p2p); each completes as soon as its own
 * transfer has, and p2p ops submitted while a batch runs join it. A collective starts only
 * once every earlier p2p op has completed.
 */
#ifndef RPL_ENGINE_H
#define RPL_ENGINE_H

#include "ripples.h"
#include "transport.h"

typedef struct rpl_run {
  rpl_comm *comm;
  rpl_tr *tr;
  /* rank and size within the set of ranks the op runs over: the whole communicator, or a
   * partial round's group, whose communicator ranks are members[0..size). Algorithms only
   * ever see these; the transfer builders translate peers through `members`. */
  int rank, size;
  const int *members; /* NULL = every rank of the communicator */
  rpl_op_kind kind;
  uint64_t seq;       /* collective sequence number, the same on every rank */
  uint32_t nbufs;     /* how many buffers the op has (goes into every header) */
  double deadline;
  size_t small_bytes; /* latency-optimised algorithm at or below this many bytes */
  size_t chunk_bytes; /* pipeline chunk */
  size_t single_copy_bytes;     /* single-copy algorithms at or above this; 0 = never */
  const unsigned char *same_host; /* by communicator rank: 1 if on this host (NULL = none) */
  rpl_error *err;
} rpl_run;

/* Slots 0 and 1 belong to the algorithms; slot 2 holds a partial round's working copy. */
#define RPL_SCRATCH_SLOTS 3

/* Reusable memory owned by the communicator, grown on demand, valid until the op ends. */
void *rpl_scratch(rpl_run *run, int slot, size_t bytes);

/* Transfer builders: `step` distinguishes buffers/steps of one op; `count` is the element
 * count of the buffer the message belongs to (RPL_ANY_COUNT where it may differ by rank). */
rpl_xfer rpl_send(const rpl_run *run, int peer, const void *buf, size_t len, rpl_dtype dtype,
                  uint64_t count, unsigned step);
rpl_xfer rpl_recv(const rpl_run *run, int peer, void *buf, size_t len, rpl_dtype dtype,
                  uint64_t count, unsigned step);
/* A receive whose payload passes through `tmp` (RPL_REDUCE_WINDOW bytes, reused in turn) and
 * is reduced into `dst` as it arrives. */
#define RPL_REDUCE_WINDOW (256u * 1024u)
rpl_xfer rpl_recv_reduce(const rpl_run *run, int peer, void *tmp, void *dst, size_t len,
                         rpl_dtype dtype, rpl_redop op, uint64_t count, unsigned step);

rpl_status rpl_exchange(rpl_run *run, rpl_xfer *xs, int n);

/* Splits `count` elements into `parts` nearly equal segments; segment i starts at *off. */
void rpl_segment(size_t count, int parts, int i, size_t *off, size_t *cnt);

/* Ring reduce-scatter over `base` (count elements, split with rpl_segment): afterwards
 * segment (rank + shift) mod size of `base` holds the reduction over all ranks. */
rpl_status rpl_ring_reduce_scatter(rpl_run *run, void *base, size_t count, rpl_dtype dtype,
                                   rpl_redop op, int shift, unsigned step);

/* All-reduce of one buffer in place over the run's ranks, without AVG's division. */
rpl_status rpl_allreduce_buf(rpl_run *run, const rpl_buf *b, rpl_redop op, unsigned step);

/* Single copy between ranks of one host (algorithms/single_copy.c). _applies says whether
 * the run may try it (every member on this host, a large enough buffer): the same answer on
 * every member. The all-reduce then agrees with the members whether all may read each other's
 * memory; *used = 0 (with RPL_OK) means they may not and nothing was reduced yet. */
int rpl_single_copy_applies(const rpl_run *run, size_t bytes);
rpl_status rpl_single_copy_allreduce(rpl_run *run, const rpl_buf *b, rpl_redop op,
                                     unsigned step, int *used);

/* The algorithms, one per operation kind (csrc/algorithms/). */
rpl_status rpl_algo_allreduce(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_broadcast(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_allgather(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_reduce_scatter(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_alltoall(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_gather(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_scatter(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_reduce(rpl_run *run, const rpl_op_desc *d);
rpl_status rpl_algo_barrier(rpl_run *run, const rpl_op_desc *d);
/* The one transfer of a SEND or RECV (progress zeroed), for the engine's p2p batches. */
rpl_xfer rpl_p2p_xfer(const rpl_run *run, const rpl_op_desc *d);

#endif /* RPL_ENGINE_H */
