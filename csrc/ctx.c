/* ctx.c - the run context: scratch, transfer builders, exchange, segments, read-peer, and the
 * transport's counters for partial rounds. */
#include "ctx.h"

#include <stdlib.h>

#include "common.h"

/* The communicator rank of run rank `p`. */
static int comm_rank(const rpl_run *run, int p) { return run->members ? run->members[p] : p; }

void *rpl_scratch(rpl_run *run, int slot, size_t bytes) {
  rpl_scratch_pool *s = run->scratch;
  if (bytes == 0) bytes = 1;
  if (s->cap[slot] < bytes) {
    free(s->buf[slot]);
    s->buf[slot] = malloc(bytes);
    s->cap[slot] = s->buf[slot] ? bytes : 0;
    if (!s->buf[slot]) {
      rpl_fail(run->err, RPL_ERR_NOMEM, "out of memory: %s needs %zu bytes of scratch space",
               rpl_op_name(run->kind), bytes);
      return NULL;
    }
  }
  return s->buf[slot];
}

void rpl_scratch_free(rpl_scratch_pool *pool) {
  for (int i = 0; i < RPL_SCRATCH_SLOTS; i++) {
    free(pool->buf[i]);
    pool->buf[i] = NULL;
    pool->cap[i] = 0;
  }
}

static rpl_xfer make_xfer(const rpl_run *run, int peer, int is_send, void *buf, size_t len,
                          rpl_dtype dtype, uint64_t count, unsigned step) {
  rpl_xfer x = {.peer = comm_rank(run, peer), .is_send = is_send, .buf = buf, .len = len};
  x.meta = (rpl_meta){.op = (uint8_t)run->kind,
                      .dtype = (uint8_t)dtype,
                      .step = (uint16_t)step,
                      .tag = run->nbufs,
                      .seq = run->seq,
                      .count = count};
  return x;
}

rpl_xfer rpl_send(const rpl_run *run, int peer, const void *buf, size_t len, rpl_dtype dtype,
                  uint64_t count, unsigned step) {
  return make_xfer(run, peer, 1, (void *)buf, len, dtype, count, step);
}

rpl_xfer rpl_recv(const rpl_run *run, int peer, void *buf, size_t len, rpl_dtype dtype,
                  uint64_t count, unsigned step) {
  return make_xfer(run, peer, 0, buf, len, dtype, count, step);
}

rpl_xfer rpl_recv_reduce(const rpl_run *run, int peer, void *tmp, void *dst, size_t len,
                         rpl_dtype dtype, rpl_redop op, uint64_t count, unsigned step) {
  rpl_xfer x = rpl_recv(run, peer, tmp, len, dtype, count, step);
  x.reduce_dst = dst;
  x.rdtype = dtype;
  x.rop = op;
  x.window = RPL_REDUCE_WINDOW;
  return x;
}

rpl_status rpl_exchange(rpl_run *run, rpl_xfer *xs, int n) {
  if (run->before_exchange) run->before_exchange(run->hook_arg, run->exchanges);
  run->exchanges++;
  return rpl_exchange_more(run, xs, n);
}

rpl_status rpl_exchange_more(rpl_run *run, rpl_xfer *xs, int n) {
  if (run->give_up)
    return rpl_tr_run_until(run->tr, xs, n, run->deadline, run->give_up, run->give_up_arg,
                            run->err);
  return rpl_tr_run(run->tr, xs, n, run->deadline, run->err);
}

void rpl_segment(size_t count, int parts, int i, size_t *off, size_t *cnt) {
  size_t base = count / (size_t)parts, extra = count % (size_t)parts;
  size_t ui = (size_t)i;
  *cnt = base + (ui < extra ? 1 : 0);
  *off = ui * base + (ui < extra ? ui : extra);
}

rpl_status rpl_ring_reduce_scatter(rpl_run *run, void *base, size_t count, rpl_dtype dtype,
                                   rpl_redop op, int shift, unsigned step) {
  int n = run->size, r = run->rank;
  size_t esz = rpl_dtype_size(dtype);
  size_t maxseg = count / (size_t)n + 1;
  unsigned char *tmp = rpl_scratch(run, 1, RPL_MIN(maxseg * esz, RPL_REDUCE_WINDOW));
  if (!tmp) return RPL_ERR_NOMEM;
  int right = (r + 1) % n, left = (r - 1 + n) % n;
  for (int s = 0; s < n - 1; s++) {
    int sseg = ((r + shift - 1 - s) % n + 2 * n) % n;
    int rseg = ((r + shift - 2 - s) % n + 2 * n) % n;
    size_t so, sc, ro, rc;
    rpl_segment(count, n, sseg, &so, &sc);
    rpl_segment(count, n, rseg, &ro, &rc);
    rpl_xfer xs[2] = {
        rpl_send(run, right, (unsigned char *)base + so * esz, sc * esz, dtype, count, step),
        rpl_recv_reduce(run, left, tmp, (unsigned char *)base + ro * esz, rc * esz, dtype, op,
                        count, step),
    };
    rpl_status st = rpl_exchange(run, xs, 2);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}

int rpl_peer_local(const rpl_run *run, int peer) {
  return run->same_host && run->same_host[comm_rank(run, peer)];
}

int rpl_peer_readable(const rpl_run *run, int peer) {
  return rpl_tr_can_read(run->tr, comm_rank(run, peer));
}

rpl_status rpl_read_peer(rpl_run *run, int peer, uint64_t addr, void *dst, size_t len) {
  return rpl_tr_read(run->tr, comm_rank(run, peer), addr, dst, len, run->err);
}

void rpl_reset_peers(rpl_run *run) {
  for (int p = 0; p < run->size; p++)
    if (p != run->rank) rpl_tr_reset_peer(run->tr, comm_rank(run, p));
}

uint64_t rpl_run_bytes_sent(const rpl_run *run) {
  rpl_tr_counters c;
  rpl_tr_get_counters(run->tr, &c);
  return c.bytes_sent;
}

void rpl_run_cut_links(rpl_run *run) { rpl_tr_cut_links(run->tr); }
