/*
 * engine_internal.h - a communicator's state, shared by engine.c (queue, progress thread,
 * dispatch, public API) and p2p_batch.c (the point-to-point batch). Internal to csrc/.
 *
 * Threads: fields under `mu` are shared with submitting threads; the batch, the scratch pool
 * and coll_seq belong to whichever thread holds `executing` (the transport).
 */
#ifndef RPL_ENGINE_INTERNAL_H
#define RPL_ENGINE_INTERNAL_H

#include <pthread.h>

#include "ctx.h"
#include "partial.h"
#include "ripples.h"
#include "transport.h"

typedef struct rpl_op {
  struct rpl_op *next;
  rpl_op_desc d; /* in/out point into bufs */
  rpl_buf *bufs;
} rpl_op;

/* The sends and recvs that run together (progress thread only). Entry i of every array is one
 * op and its transfer; ops[i] is NULL once that op has completed. Entries are appended, and
 * dropped only by compaction (which tells the transport) or when the batch empties. */
typedef struct p2p_batch {
  rpl_op **ops;
  rpl_xfer *xs;
  double *deadline; /* start of execution + the op's timeout */
  int *map;         /* compaction scratch */
  int n, cap;
  int live;         /* entries whose op has not completed */
} p2p_batch;

struct rpl_comm {
  int rank, size;
  double timeout_s;
  size_t small_bytes, chunk_bytes;
  size_t single_copy_bytes;   /* 0 = never */
  unsigned char *same_host;   /* by rank */
  char name[32];
  rpl_tr *tr;

  pthread_t thread;
  int thread_started;
  pthread_mutex_t mu; /* guards the queue and the flags below */
  pthread_cond_t cv;
  rpl_op *head, *tail;
  int p2p_active; /* the progress thread runs a p2p batch: p2p submits poke the transport */
  /* A thread drives the transport (the progress thread running ops or idling UCX, or a caller
   * running a small op inline): exactly one at a time, handed over under mu. */
  int executing;
  int running_partial; /* the progress thread runs a partial round (under mu) */
  int closing;
  int broken;
  rpl_error first_error;

  rpl_partial *partial; /* set once by rpl_comm_enable_partial; NULL until then */

  /* Used only by the thread that holds `executing`. */
  uint64_t coll_seq;
  p2p_batch batch;
  rpl_scratch_pool scratch;

  uint64_t ops_completed, ops_failed; /* relaxed atomics */
};

static inline double rpl_op_timeout(const rpl_comm *c, const rpl_op_desc *d) {
  return d->timeout_s > 0 ? d->timeout_s : c->timeout_s;
}

static inline int rpl_op_is_p2p(const rpl_op *op) {
  return op->d.kind == RPL_OP_SEND || op->d.kind == RPL_OP_RECV;
}

/* engine.c: a run over the whole communicator (the caller sets seq, nbufs and the deadline);
 * breaking the communicator after a failed exchange; completing an op (counts, calls
 * on_done, frees it). */
rpl_run rpl_engine_comm_run(rpl_comm *c, rpl_op_kind kind, rpl_error *err);
void rpl_engine_break(rpl_comm *c, const rpl_error *err);
void rpl_engine_finish_op(rpl_comm *c, rpl_op *op, rpl_status st, rpl_error *err);

/* p2p_batch.c: runs the sends and recvs at the head of the queue, and those that join while
 * they run, until none is pending (the caller holds `executing`); frees the batch's arrays. */
void rpl_p2p_run(rpl_comm *c);
void rpl_p2p_batch_free(p2p_batch *b);

#endif /* RPL_ENGINE_INTERNAL_H */
