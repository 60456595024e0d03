/* p2p_batch.c - send and recv: the engine's point-to-point batch (engine_internal.h).
 *
 * send/recv are one message each, matched by (peer, tag) in order; a message that arrives
 * before its recv is posted waits in the transport's stash. Sends and recvs are not
 * algorithms: consecutive ones at the head of the queue form a batch whose transfers progress
 * together (rpl_tr_run_p2p); each completes as soon as its own transfer has, and p2p ops
 * submitted while a batch runs join it. A collective starts only once every earlier p2p op has
 * completed (engine.c). */
#include <stdio.h>
#include <stdlib.h>

#include "common.h"
#include "ctx.h"
#include "engine_internal.h"
#include "transport.h"

/* The one transfer of a SEND or RECV (progress zeroed). */
static rpl_xfer p2p_xfer(const rpl_run *run, const rpl_op_desc *d) {
  int send = d->kind == RPL_OP_SEND;
  const rpl_buf *b = send ? &d->in[0] : &d->out[0];
  size_t len = b->count * rpl_dtype_size(b->dtype);
  rpl_xfer x = send ? rpl_send(run, d->root, b->ptr, len, b->dtype, b->count, 0)
                    : rpl_recv(run, d->root, b->ptr, len, b->dtype, b->count, 0);
  x.meta.op = RPL_OP_SEND; /* the wire kind of a point-to-point message */
  x.meta.tag = (uint32_t)d->tag;
  return x;
}

static int batch_grow(p2p_batch *b) {
  if (b->n < b->cap) return 1;
  int cap = b->cap ? b->cap * 2 : 16;
  rpl_op **ops = realloc(b->ops, sizeof *ops * (size_t)cap);
  if (ops) b->ops = ops;
  rpl_xfer *xs = ops ? realloc(b->xs, sizeof *xs * (size_t)cap) : NULL;
  if (xs) b->xs = xs;
  double *dl = xs ? realloc(b->deadline, sizeof *dl * (size_t)cap) : NULL;
  if (dl) b->deadline = dl;
  int *map = dl ? realloc(b->map, sizeof *map * (size_t)cap) : NULL;
  if (map) b->map = map;
  if (!map) return 0;
  b->cap = cap;
  return 1;
}

/* Drops completed entries once they are the majority of a large batch (a stream of p2p ops
 * that never drains must not grow it without bound). */
static void batch_compact(rpl_comm *c, p2p_batch *b) {
  if (b->n < 64 || (b->n - b->live) * 2 < b->n) return;
  int j = 0;
  for (int i = 0; i < b->n; i++) {
    b->map[i] = -1;
    if (!b->ops[i]) continue;
    b->map[i] = j;
    b->ops[j] = b->ops[i];
    b->xs[j] = b->xs[i];
    b->deadline[j] = b->deadline[i];
    j++;
  }
  rpl_tr_p2p_remap(c->tr, b->map, b->n);
  b->n = j;
}

static void p2p_desc(const rpl_op *op, char *buf, size_t cap) {
  if (op->d.root == RPL_ANY_SOURCE)
    snprintf(buf, cap, "recv from any rank (tag %d)", op->d.tag);
  else
    snprintf(buf, cap, "%s %s rank %d (tag %d)", op->d.kind == RPL_OP_SEND ? "send" : "recv",
             op->d.kind == RPL_OP_SEND ? "to" : "from", op->d.root, op->d.tag);
}

/* Fails every live op of the batch after the run failed with `st`/`err` and empties it. */
static void batch_fail(rpl_comm *c, p2p_batch *b, rpl_status st, const rpl_error *err) {
  double now = rpl_now();
  rpl_error first = *err;
  int broke = 0;
  if (st == RPL_ERR_TIMEOUT) {
    /* The ops past their own deadline time out, naming their peer; the first of them is the
     * communicator's error. */
    for (int i = 0; i < b->n; i++) {
      rpl_op *op = b->ops[i];
      if (!op || b->deadline[i] > now) continue;
      char what[96];
      p2p_desc(op, what, sizeof what);
      rpl_error e;
      char who[32] = "any rank";
      if (op->d.root != RPL_ANY_SOURCE) snprintf(who, sizeof who, "rank(s) %d", op->d.root);
      char held[256] = "";
      if (op->d.kind == RPL_OP_RECV)
        rpl_tr_held_desc(c->tr, op->d.root, held, sizeof held);
      rpl_fail(&e, RPL_ERR_TIMEOUT,
               "%s timed out after %g s waiting for %s (%s)", what,
               rpl_op_timeout(c, &op->d), who,
               held[0] ? held
               : op->d.kind == RPL_OP_RECV
                   ? "it never sent a matching message: it is slow, stuck in another "
                     "operation, or gone"
                   : "it never took the message: it has not posted the matching recv, is "
                     "stuck in another operation, or is gone");
      if (!broke) {
        first = e;
        rpl_engine_break(c, &first);
        broke = 1;
      }
      b->ops[i] = NULL;
      b->live--;
      rpl_engine_finish_op(c, op, RPL_ERR_TIMEOUT, &e);
    }
  }
  if (!broke && st != RPL_ERR_CLOSED && st != RPL_ERR_ABORTED) {
    rpl_engine_break(c, &first);
    broke = 1;
  }
  for (int i = 0; i < b->n; i++) {
    rpl_op *op = b->ops[i];
    if (!op) continue;
    rpl_error e;
    rpl_status s = st;
    if (st == RPL_ERR_TIMEOUT) {
      /* Not past its own deadline, but the communicator is broken now. */
      s = RPL_ERR_ABORTED;
      char what[96];
      p2p_desc(op, what, sizeof what);
      rpl_fail(&e, s, "%s was abandoned: the process group is unusable after an error of an "
               "operation running with it: %.380s", what, first.msg);
    } else {
      e = *err;
    }
    b->ops[i] = NULL;
    b->live--;
    rpl_engine_finish_op(c, op, s, &e);
  }
  b->n = 0;
  b->live = 0;
}

/* Moves the sends and recvs at the head of the queue into the batch (unless the communicator
 * is closing or broken: *closing says which) and decides under the lock whether the batch
 * goes on. Returns the op that found no room (out of memory), if any. */
static rpl_op *take_queued(rpl_comm *c, p2p_batch *b, int *closing) {
  rpl_op *nomem = NULL;
  pthread_mutex_lock(&c->mu);
  *closing = c->closing;
  if (!*closing && !c->broken) {
    while (c->head && rpl_op_is_p2p(c->head)) {
      rpl_op *op = c->head;
      c->head = op->next;
      if (!c->head) c->tail = NULL;
      op->next = NULL;
      if (!batch_grow(b)) {
        nomem = op;
        break;
      }
      b->ops[b->n++] = op;
      b->live++;
    }
  }
  /* Leaving the batch is decided under the lock, so a p2p op submitted from here on is
   * seen by the main loop rather than relying on a poke. */
  c->p2p_active = b->live > 0 && !*closing;
  pthread_mutex_unlock(&c->mu);
  return nomem;
}

/* Builds the transfers of entries first_new.. (their clocks start now); returns the earliest
 * deadline of the live entries. */
static double start_new(rpl_comm *c, p2p_batch *b, int first_new) {
  double now = rpl_now();
  for (int i = first_new; i < b->n; i++) {
    rpl_op *op = b->ops[i];
    rpl_run run = rpl_engine_comm_run(c, op->d.kind, NULL);
    run.nbufs = (uint32_t)op->d.tag;
    b->xs[i] = p2p_xfer(&run, &op->d);
    b->deadline[i] = now + rpl_op_timeout(c, &op->d);
  }
  double deadline = 0;
  int have = 0;
  for (int i = 0; i < b->n; i++)
    if (b->ops[i] && (!have || b->deadline[i] < deadline)) {
      deadline = b->deadline[i];
      have = 1;
    }
  return deadline;
}

/* Completes the entries whose transfer is done (also when the run then failed on something
 * else). */
static void complete_done(rpl_comm *c, p2p_batch *b) {
  for (int i = 0; i < b->n; i++) {
    rpl_op *op = b->ops[i];
    if (!op || !b->xs[i].done) continue;
    b->ops[i] = NULL;
    b->live--;
    if (op->d.source) *op->d.source = b->xs[i].peer; /* the transport set it for any-source */
    rpl_engine_finish_op(c, op, RPL_OK, NULL);
  }
}

/* Each op completes (on_done) as soon as its transfer has. */
void rpl_p2p_run(rpl_comm *c) {
  p2p_batch *b = &c->batch;
  b->n = b->live = 0;
  for (;;) {
    int first_new = b->n, closing;
    rpl_op *nomem = take_queued(c, b, &closing);
    if (nomem) {
      rpl_error e;
      rpl_fail(&e, RPL_ERR_NOMEM, "out of memory running %s", rpl_op_name(nomem->d.kind));
      rpl_engine_finish_op(c, nomem, RPL_ERR_NOMEM, &e);
    }
    if (b->live == 0) break;
    if (closing) {
      rpl_error e;
      rpl_fail(&e, RPL_ERR_CLOSED, "interrupted: the process group is shutting down");
      batch_fail(c, b, RPL_ERR_CLOSED, &e);
      break;
    }
    double deadline = start_new(c, b, first_new);
    rpl_error err = {RPL_OK, ""};
    rpl_status st = rpl_tr_run_p2p(c->tr, b->xs, b->n, deadline, &err);
    complete_done(c, b);
    if (st != RPL_OK) {
      err.code = st;
      batch_fail(c, b, st, &err);
      pthread_mutex_lock(&c->mu);
      c->p2p_active = 0;
      pthread_mutex_unlock(&c->mu);
      break;
    }
    if (b->live == 0) b->n = 0; /* drained: nothing refers to the entries any more */
    else batch_compact(c, b);
  }
}

void rpl_p2p_batch_free(p2p_batch *b) {
  free(b->ops);
  free(b->xs);
  free(b->deadline);
  free(b->map);
}
