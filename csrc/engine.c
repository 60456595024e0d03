/*
 * engine.c - communicators: the operation queue, the progress thread, dispatch, the public API
 * (ripples.h). Creation's peer set-up is in bootstrap.c, argument checks in validate.c, the
 * communicator's state in engine_internal.h.
 *
 * The engine pops an operation from the communicator's queue and calls the algorithm for its
 * kind (algorithms/algorithms.h) with an rpl_run (ctx.h), or a partial round (partial.h).
 *
 * Sends and recvs are not algorithms: consecutive ones at the head of the queue run as one
 * batch (p2p_batch.c). A collective starts only once every earlier p2p op has completed.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "algorithms/algorithms.h"
#include "bootstrap.h"
#include "common.h"
#include "ctx.h"
#include "engine_internal.h"
#include "partial.h"
#include "ripples.h"
#include "transport.h"
#include "validate.h"

#define DEFAULT_SMALL_BYTES (64u * 1024u)
#define DEFAULT_CHUNK_BYTES (512u * 1024u)

/* ---- execution ----------------------------------------------------------------------- */

/* A run over the whole communicator; the caller sets seq, nbufs and the deadline. */
rpl_run rpl_engine_comm_run(rpl_comm *c, rpl_op_kind kind, rpl_error *err) {
  rpl_run run = {.tr = c->tr,
                 .scratch = &c->scratch,
                 .rank = c->rank,
                 .size = c->size,
                 .kind = kind,
                 .small_bytes = c->small_bytes,
                 .chunk_bytes = c->chunk_bytes,
                 .single_copy_bytes = c->single_copy_bytes,
                 .same_host = c->same_host,
                 .err = err};
  return run;
}

/* A failed exchange leaves streams mid-message: close everything so peers fail fast instead
 * of waiting for data that will never come. */
void rpl_engine_break(rpl_comm *c, const rpl_error *err) {
  pthread_mutex_lock(&c->mu);
  if (!c->broken) {
    c->broken = 1;
    c->first_error = *err;
  }
  pthread_mutex_unlock(&c->mu);
  rpl_tr_abort(c->tr);
}

/* Counts, calls on_done, frees. */
void rpl_engine_finish_op(rpl_comm *c, rpl_op *op, rpl_status st, rpl_error *err) {
  if (st != RPL_OK) {
    err->code = st;
    __atomic_fetch_add(&c->ops_failed, 1, __ATOMIC_RELAXED);
    if (op->d.on_done) op->d.on_done(op->d.done_arg, st, err);
  } else {
    __atomic_fetch_add(&c->ops_completed, 1, __ATOMIC_RELAXED);
    if (op->d.on_done) op->d.on_done(op->d.done_arg, RPL_OK, NULL);
  }
  free(op->bufs);
  free(op);
}

static int next_is_exact(rpl_comm *c);
static rpl_status execute_exact(rpl_comm *c, const rpl_op_desc *d, int collective,
                                rpl_error *err);

/* Runs one operation. *contained is set when a failure was already dealt with and must not
 * break the communicator (a partial round cleans up after its own group). */
static rpl_status execute(rpl_comm *c, rpl_partial *partial, const rpl_op_desc *d,
                          int *contained, rpl_error *err) {
  *contained = 0;
  rpl_op_desc exact;
  if (d->kind == RPL_OP_PARTIAL_ALLREDUCE) {
    if (rpl_partial_eligible(d)) {
      rpl_run run = rpl_engine_comm_run(c, d->kind, err);
      run.nbufs = (uint32_t)d->nin;
      *contained = 1;
      return rpl_partial_run(partial, &run, d, err);
    }
    rpl_partial_count_fallback(partial);
    exact = *d;
    exact.kind = RPL_OP_ALLREDUCE;
    d = &exact;
  }
  int collective = d->kind != RPL_OP_SEND && d->kind != RPL_OP_RECV;
  /* Peers placed in a group with us by the coordinator would wait while we sit in an exact
   * collective: fence first (a no-op for the static schedule or when already fenced). */
  if (partial) rpl_partial_before_exact(partial);
  rpl_status st = execute_exact(c, d, collective, err);
  if (partial) rpl_partial_after_exact(partial, next_is_exact(c));
  return st;
}

/* Whether the op queued next is an exact collective (a fence can span both). */
static int next_is_exact(rpl_comm *c) {
  pthread_mutex_lock(&c->mu);
  const rpl_op *n = c->head;
  int more = n && !rpl_op_is_p2p(n) && n->d.kind != RPL_OP_PARTIAL_ALLREDUCE && !c->closing;
  pthread_mutex_unlock(&c->mu);
  return more;
}

static rpl_status execute_exact(rpl_comm *c, const rpl_op_desc *d, int collective,
                                rpl_error *err) {
  rpl_run run = rpl_engine_comm_run(c, d->kind, err);
  run.seq = collective ? ++c->coll_seq : 0;
  /* Only these take a list of tensors whose length every rank must share; elsewhere list
   * lengths legitimately differ (a root has more). */
  run.nbufs = d->kind == RPL_OP_ALLREDUCE || d->kind == RPL_OP_BROADCAST ? (uint32_t)d->nin : 1u;
  run.deadline = rpl_now() + rpl_op_timeout(c, d);
  if (!collective) run.nbufs = (uint32_t)d->tag;
  switch (d->kind) {
    case RPL_OP_ALLREDUCE: return rpl_algo_allreduce(&run, d);
    case RPL_OP_BROADCAST: return rpl_algo_broadcast(&run, d);
    case RPL_OP_ALLGATHER: return rpl_algo_allgather(&run, d);
    case RPL_OP_REDUCE_SCATTER: return rpl_algo_reduce_scatter(&run, d);
    case RPL_OP_ALLTOALL: return rpl_algo_alltoall(&run, d);
    case RPL_OP_GATHER: return rpl_algo_gather(&run, d);
    case RPL_OP_SCATTER: return rpl_algo_scatter(&run, d);
    case RPL_OP_REDUCE: return rpl_algo_reduce(&run, d);
    case RPL_OP_BARRIER: return rpl_algo_barrier(&run, d);
    case RPL_OP_SEND:
    case RPL_OP_RECV: /* run in batches by rpl_p2p_run (p2p_batch.c) */
    case RPL_OP_PARTIAL_ALLREDUCE: break; /* handled above */
  }
  return rpl_fail(err, RPL_ERR_INVALID, "unknown operation kind %d", (int)d->kind);
}

/* Hands the transport back: the progress thread may take queued ops, shutdown may proceed. */
static void release_transport(rpl_comm *c) {
  pthread_mutex_lock(&c->mu);
  c->executing = 0;
  c->running_partial = 0;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

static void *progress_main(void *arg) {
  rpl_comm *c = arg;
  char tname[48];
  snprintf(tname, sizeof tname, "rpl-prog-%s", c->name);
  rpl_set_thread_name(tname); /* truncated to 15 characters */
  for (;;) {
    pthread_mutex_lock(&c->mu);
    while ((!c->head || c->executing) && !c->closing) {
      if (c->executing || !rpl_tr_wants_idle(c->tr)) {
        pthread_cond_wait(&c->cv, &c->mu);
        continue;
      }
      c->executing = 1;
      pthread_mutex_unlock(&c->mu);
      rpl_tr_idle(c->tr);
      pthread_mutex_lock(&c->mu);
      c->executing = 0;
      if (c->head || c->closing) break;
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until); /* the condition variable's clock */
      long ns = until.tv_nsec + (long)(RPL_TR_IDLE_S * 1e9);
      until.tv_sec += ns / 1000000000L;
      until.tv_nsec = ns % 1000000000L;
      pthread_cond_timedwait(&c->cv, &c->mu, &until);
    }
    rpl_op *op = c->head;
    if (!op) {
      pthread_mutex_unlock(&c->mu);
      break;
    }
    int closing = c->closing, broken = c->broken;
    if (rpl_op_is_p2p(op) && !closing && !broken) {
      c->executing = 1;
      pthread_mutex_unlock(&c->mu);
      rpl_p2p_run(c);
      release_transport(c);
      continue;
    }
    c->head = op->next;
    if (!c->head) c->tail = NULL;
    rpl_error first = c->first_error;
    rpl_partial *partial = c->partial;
    /* Closing: an inline op may still hold the transport; this one fails without it. */
    int runs = !closing && !broken;
    if (runs) c->executing = 1;
    if (runs) c->running_partial = op->d.kind == RPL_OP_PARTIAL_ALLREDUCE;
    pthread_mutex_unlock(&c->mu);

    rpl_error err = {RPL_OK, ""};
    rpl_status st;
    int contained = 0;
    if (closing)
      st = rpl_fail(&err, RPL_ERR_CLOSED, "the process group was shut down before %s ran",
                    rpl_op_name(op->d.kind));
    else if (broken)
      st = rpl_fail(&err, RPL_ERR_ABORTED,
                    "the process group is unusable after an earlier error: %.400s", first.msg);
    else
      st = execute(c, partial, &op->d, &contained, &err);

    if (st != RPL_OK) {
      err.code = st;
      /* Argument errors found before any data moved (none reach here: rpl_submit validates)
       * would not need breaking the communicator. */
      if (st != RPL_ERR_CLOSED && st != RPL_ERR_ABORTED && !contained) rpl_engine_break(c, &err);
    }
    if (runs) release_transport(c);
    rpl_engine_finish_op(c, op, st, &err);
  }
  return NULL;
}

/* ---- public API ---------------------------------------------------------------------- */

rpl_status rpl_comm_create(const rpl_comm_config *cfg, const rpl_store *store, rpl_comm **out,
                           rpl_error *err) {
  *out = NULL;
  if (cfg->size < 1 || cfg->rank < 0 || cfg->rank >= cfg->size)
    return rpl_fail(err, RPL_ERR_INVALID, "rank %d is out of range for a group of size %d",
                    cfg->rank, cfg->size);
  if (!(cfg->timeout_s > 0))
    return rpl_fail(err, RPL_ERR_INVALID, "timeout must be positive, got %g s", cfg->timeout_s);
  if (!store || !store->set || !store->get)
    return rpl_fail(err, RPL_ERR_INVALID, "a key-value store is required");
  if (cfg->frame_macs && cfg->use_ucx)
    return rpl_fail(err, RPL_ERR_INVALID, "authenticated frames cover TCP links only: use "
                    "transport \"tcp\" (or \"auto\") with them, not UCX");
  rpl_comm *c = calloc(1, sizeof *c);
  if (!c) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating a communicator");
  c->rank = cfg->rank;
  c->size = cfg->size;
  c->timeout_s = cfg->timeout_s;
  c->small_bytes = cfg->small_bytes ? cfg->small_bytes : DEFAULT_SMALL_BYTES;
  c->chunk_bytes = cfg->chunk_bytes ? cfg->chunk_bytes : DEFAULT_CHUNK_BYTES;
  c->single_copy_bytes = cfg->single_copy_bytes;
  snprintf(c->name, sizeof c->name, "%s", cfg->name && *cfg->name ? cfg->name : "pg");
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);

  rpl_status st = rpl_tr_create(c->rank, c->size, cfg->bind_addr, cfg->use_ucx, &c->tr, err);
  if (st != RPL_OK) goto fail;
  c->same_host = calloc((size_t)c->size, 1);
  if (!c->same_host) {
    st = rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating a communicator");
    goto fail;
  }
  if ((st = rpl_bootstrap(c->tr, cfg, store, c->same_host, err)) != RPL_OK) goto fail;

  if (pthread_create(&c->thread, NULL, progress_main, c) != 0) {
    st = rpl_fail_errno(err, RPL_ERR_SYSTEM, errno, "cannot start the progress thread");
    goto fail;
  }
  c->thread_started = 1;
  *out = c;
  return RPL_OK;

fail:
  rpl_comm_destroy(c);
  return st;
}

void rpl_comm_shutdown(rpl_comm *c) {
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  int was_closing = c->closing;
  c->closing = 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (was_closing) return;
  if (c->partial) rpl_partial_interrupt(c->partial);
  if (c->tr) rpl_tr_interrupt(c->tr);
  if (c->thread_started) pthread_join(c->thread, NULL);
  c->thread_started = 0;
  /* An op running inline on a caller's thread was interrupted above; wait until it let go. */
  pthread_mutex_lock(&c->mu);
  while (c->executing) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  /* The progress thread is gone, so this thread may use the coordinator client. */
  if (c->partial) rpl_partial_leave(c->partial);
}

/* Under mu: a partial round runs on the progress thread or waits in the queue. */
static int partial_pending(const rpl_comm *c) {
  if (c->running_partial) return 1;
  for (const rpl_op *op = c->head; op; op = op->next)
    if (op->d.kind == RPL_OP_PARTIAL_ALLREDUCE) return 1;
  return 0;
}

int rpl_comm_settle_partial(rpl_comm *c, double max_s) {
  if (!c) return 1;
  double until = rpl_now() + (max_s > 0 ? max_s : 0);
  pthread_mutex_lock(&c->mu);
  while (partial_pending(c) && !c->closing && !c->broken) {
    double left = until - rpl_now();
    if (left <= 0) break;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* the condition variable's clock */
    long ns = ts.tv_nsec + (long)((left < 0.1 ? left : 0.1) * 1e9);
    ts.tv_sec += ns / 1000000000L;
    ts.tv_nsec = ns % 1000000000L;
    pthread_cond_timedwait(&c->cv, &c->mu, &ts);
  }
  int settled = !partial_pending(c);
  pthread_mutex_unlock(&c->mu);
  return settled;
}

void rpl_comm_destroy(rpl_comm *c) {
  if (!c) return;
  rpl_comm_shutdown(c);
  rpl_partial_destroy(c->partial);
  rpl_tr_destroy(c->tr);
  rpl_scratch_free(&c->scratch);
  rpl_p2p_batch_free(&c->batch);
  free(c->same_host);
  pthread_mutex_destroy(&c->mu);
  pthread_cond_destroy(&c->cv);
  free(c);
}

int rpl_comm_rank(const rpl_comm *c) { return c->rank; }
int rpl_comm_size(const rpl_comm *c) { return c->size; }

/* Queues a validated operation behind the others. */
static rpl_status enqueue(rpl_comm *c, const rpl_op_desc *d, rpl_error *err) {
  rpl_op *op = calloc(1, sizeof *op);
  size_t nb = (size_t)d->nin + (size_t)d->nout;
  if (op) op->bufs = calloc(nb ? nb : 1, sizeof(rpl_buf));
  if (!op || !op->bufs) {
    if (op) free(op);
    return rpl_fail(err, RPL_ERR_NOMEM, "out of memory queueing %s", rpl_op_name(d->kind));
  }
  op->d = *d;
  if (d->nin) memcpy(op->bufs, d->in, (size_t)d->nin * sizeof(rpl_buf));
  if (d->nout) memcpy(op->bufs + d->nin, d->out, (size_t)d->nout * sizeof(rpl_buf));
  op->d.in = op->bufs;
  op->d.out = op->bufs + d->nin;

  pthread_mutex_lock(&c->mu);
  if (c->closing) {
    pthread_mutex_unlock(&c->mu);
    free(op->bufs);
    free(op);
    return rpl_fail(err, RPL_ERR_CLOSED,
                    "%s on a ripples process group that has been shut down (destroyed)",
                    rpl_op_name(d->kind));
  }
  if (c->tail) c->tail->next = op;
  else c->head = op;
  c->tail = op;
  /* A running p2p batch takes new sends and recvs at once: wake its transport wait. */
  if (c->p2p_active && (d->kind == RPL_OP_SEND || d->kind == RPL_OP_RECV)) rpl_tr_poke(c->tr);
  pthread_cond_signal(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return RPL_OK;
}

rpl_status rpl_submit(rpl_comm *c, const rpl_op_desc *d, rpl_error *err) {
  rpl_status st = rpl_validate(d, c->rank, c->size, c->partial != NULL, err);
  if (st != RPL_OK) return st;
  return enqueue(c, d, err);
}

/* Small exact collectives only: a partial round may wait long for its group or the
 * coordinator, and sends/recvs progress in batches on the progress thread. */
static int inline_eligible(const rpl_comm *c, const rpl_op_desc *d) {
  if (d->kind == RPL_OP_SEND || d->kind == RPL_OP_RECV || d->kind == RPL_OP_PARTIAL_ALLREDUCE)
    return 0;
  size_t bytes = 0;
  for (int i = 0; i < d->nin; i++) bytes += d->in[i].count * rpl_dtype_size(d->in[i].dtype);
  for (int i = 0; i < d->nout; i++) bytes += d->out[i].count * rpl_dtype_size(d->out[i].dtype);
  return bytes <= c->small_bytes;
}

/* Validated once: an operation the latency path cannot take is queued from here. */
rpl_status rpl_submit_inline(rpl_comm *c, const rpl_op_desc *d, int *ran, rpl_error *err) {
  *ran = 0;
  rpl_status st = rpl_validate(d, c->rank, c->size, c->partial != NULL, err);
  if (st != RPL_OK) return st;
  if (!inline_eligible(c, d)) return enqueue(c, d, err);
  pthread_mutex_lock(&c->mu);
  if (c->closing) {
    pthread_mutex_unlock(&c->mu);
    return rpl_fail(err, RPL_ERR_CLOSED,
                    "%s on a ripples process group that has been shut down (destroyed)",
                    rpl_op_name(d->kind));
  }
  int idle = !c->head && !c->executing && !c->broken;
  if (idle) c->executing = 1;
  rpl_partial *partial = c->partial;
  pthread_mutex_unlock(&c->mu);
  if (!idle) return enqueue(c, d, err); /* behind the others */

  rpl_error e = {RPL_OK, ""};
  int contained = 0;
  st = execute(c, partial, d, &contained, &e);
  if (st != RPL_OK) {
    e.code = st;
    if (st != RPL_ERR_CLOSED && st != RPL_ERR_ABORTED && !contained) rpl_engine_break(c, &e);
  }
  release_transport(c);
  *ran = 1;
  __atomic_fetch_add(st == RPL_OK ? &c->ops_completed : &c->ops_failed, 1, __ATOMIC_RELAXED);
  if (d->on_done) d->on_done(d->done_arg, st, st == RPL_OK ? NULL : &e);
  return RPL_OK;
}

void rpl_comm_get_counters(const rpl_comm *c, rpl_comm_counters *out) {
  rpl_tr_counters t;
  rpl_tr_get_counters(c->tr, &t);
  out->ops_completed = __atomic_load_n(&c->ops_completed, __ATOMIC_RELAXED);
  out->ops_failed = __atomic_load_n(&c->ops_failed, __ATOMIC_RELAXED);
#define COPY_(name, doc) out->name = t.name;
  RPL_TR_COUNTERS(COPY_)
#undef COPY_
}

const char *rpl_comm_peer_path(const rpl_comm *c, int peer) {
  if (!c || peer < 0 || peer >= c->size) return NULL;
  return rpl_tr_peer_path(c->tr, peer);
}

void rpl_comm_listen_address(const rpl_comm *c, char *buf, size_t cap) {
  char a[160];
  rpl_tr_address(c->tr, a, sizeof a);
  char *second = strchr(a, ':'); /* keep "ADDR:PORT", drop the identity and UCX port */
  if (second && (second = strchr(second + 1, ':'))) *second = '\0';
  snprintf(buf, cap, "%s", a);
}

rpl_status rpl_comm_enable_partial(rpl_comm *c, const rpl_partial_config *cfg, rpl_error *err) {
  pthread_mutex_lock(&c->mu);
  int already = c->partial != NULL, closing = c->closing;
  pthread_mutex_unlock(&c->mu);
  if (already)
    return rpl_fail(err, RPL_ERR_INVALID, "partial rounds are already enabled on this group");
  if (closing) return rpl_fail(err, RPL_ERR_CLOSED, "the process group was shut down");
  double timeout = cfg->timeout_s > 0 ? cfg->timeout_s : c->timeout_s;
  rpl_partial *p;
  rpl_status st = rpl_partial_create(cfg, c->rank, c->size, timeout, &p, err);
  if (st != RPL_OK) return st;
  pthread_mutex_lock(&c->mu);
  c->partial = p;
  pthread_mutex_unlock(&c->mu);
  return RPL_OK;
}

void rpl_comm_partial_stats(const rpl_comm *c, rpl_partial_stats *out) {
  memset(out, 0, sizeof *out);
  if (c->partial) rpl_partial_get_stats(c->partial, out);
}

size_t rpl_comm_trace(const rpl_comm *c, uint64_t from, rpl_trace_entry *out, size_t cap) {
  return c->partial ? rpl_partial_get_trace(c->partial, from, out, cap) : 0;
}

int rpl_comm_partial_last(const rpl_comm *c, rpl_round_outcome *out, int *members, int cap) {
  return c->partial ? rpl_partial_last(c->partial, out, members, cap) : 0;
}

/* Under mu: partial rounds are enabled and the communicator is open. */
static rpl_status partial_open(const rpl_comm *c, rpl_error *err) {
  if (!c->partial)
    return rpl_fail(err, RPL_ERR_INVALID, "partial rounds are not enabled on this group");
  if (c->closing) return rpl_fail(err, RPL_ERR_CLOSED, "the process group was shut down");
  return RPL_OK;
}

rpl_status rpl_comm_partial_expect(rpl_comm *c, rpl_error *err) {
  /* Under mu, as a give: the round submitted next is the one that waits. */
  pthread_mutex_lock(&c->mu);
  rpl_status st = partial_open(c, err);
  if (st != RPL_OK) {
    /* refused: not enabled, or shut down */
  } else if (partial_pending(c))
    st = rpl_fail(err, RPL_ERR_INVALID,
                  "a partial round is still queued or running on this group: expect a group "
                  "for the next round before submitting it");
  else
    st = rpl_partial_expect(c->partial, err);
  pthread_mutex_unlock(&c->mu);
  return st;
}

int rpl_comm_partial_group(const rpl_comm *c, uint64_t round, double timeout_s,
                           rpl_round_outcome *out, int *members, int cap) {
  return c->partial ? rpl_partial_group(c->partial, round, timeout_s, out, members, cap) : 0;
}

rpl_status rpl_comm_fence_alone(rpl_comm *c, rpl_error *err) {
  /* Under mu, and only while nothing is queued or running: the fence of a collective in
   * flight would otherwise be taken in the domain and lifted outside it. */
  pthread_mutex_lock(&c->mu);
  rpl_status st = RPL_OK;
  if (c->closing)
    st = rpl_fail(err, RPL_ERR_CLOSED, "the process group was shut down");
  else if (c->head || c->executing || c->running_partial)
    st = rpl_fail(err, RPL_ERR_INVALID,
                  "an operation is still queued or running on this group: take it out of the "
                  "fence domain once its operations have completed");
  else if (c->partial)
    rpl_partial_fence_alone(c->partial);
  pthread_mutex_unlock(&c->mu);
  return st;
}

rpl_status rpl_comm_partial_give(rpl_comm *c, const int *members, int n, uint64_t group_id,
                                 rpl_error *err) {
  /* Under mu, so that no round is submitted between the check and the give: the next round
   * submitted takes the group. (The partial's lock nests inside mu here; nothing takes them
   * the other way round.) */
  pthread_mutex_lock(&c->mu);
  rpl_status st = partial_open(c, err);
  if (st != RPL_OK) {
    /* refused: not enabled, or shut down */
  } else if (partial_pending(c) && !rpl_partial_expecting(c->partial))
    st = rpl_fail(err, RPL_ERR_INVALID,
                  "a partial round is still queued or running on this group, and it would "
                  "take the given group: give it once that round has completed");
  else
    st = rpl_partial_give(c->partial, members, n, group_id, err);
  pthread_mutex_unlock(&c->mu);
  return st;
}
