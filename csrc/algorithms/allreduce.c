/* allreduce.c - exact all-reduce.
 *
 * Small buffers: every rank sends its buffer to every other and reduces all of them in rank
 * order (one round of latency; float16/bfloat16 summed in float32 and rounded once).
 * Large buffers: ring reduce-scatter then ring all-gather (bandwidth-optimal); arriving
 * segments are reduced while the rest of the segment is still in flight.
 * Large buffers between ranks of one host that may read each other's memory: single_copy.c.
 * Either way every rank ends with the same bits. Several buffers (coalesced) run one after
 * another inside the same operation. AVG divides where a value is final: each segment by its
 * owner before it is spread (1/size of the buffer per rank, in one pass with the reduction
 * where it can), the whole buffer after a direct exchange. */
#include "algorithms.h"

#include <string.h>

#include "../common.h"
#include "../ctx.h"
#include "../kernels.h"

static rpl_status direct(rpl_run *run, const rpl_buf *b, rpl_redop op, unsigned step) {
  int n = run->size, r = run->rank;
  size_t bytes = b->count * rpl_dtype_size(b->dtype);
  unsigned char *all = rpl_scratch(run, 0, bytes * (size_t)n);
  if (!all) return RPL_ERR_NOMEM;
  rpl_xfer xs[2 * 64];
  const void *srcs[64];
  /* Bounded by the caller: direct() is only used for n <= 64. */
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (p == r) continue;
    xs[k++] = rpl_send(run, p, b->ptr, bytes, b->dtype, b->count, step);
    xs[k++] = rpl_recv(run, p, all + (size_t)p * bytes, bytes, b->dtype, b->count, step);
  }
  rpl_status st = rpl_exchange(run, xs, k);
  if (st != RPL_OK) return st;
  for (int p = 0; p < n; p++) srcs[p] = p == r ? b->ptr : all + (size_t)p * bytes;
  rpl_reduce_many(b->ptr, srcs, n, b->count, b->dtype, op);
  if (op == RPL_AVG) rpl_divide(b->ptr, b->count, b->dtype, (double)n);
  return RPL_OK;
}

static rpl_status ring(rpl_run *run, const rpl_buf *b, rpl_redop op, unsigned step) {
  int n = run->size, r = run->rank;
  size_t esz = rpl_dtype_size(b->dtype);
  unsigned char *base = b->ptr;
  rpl_status st = rpl_ring_reduce_scatter(run, base, b->count, b->dtype, op, 1, step);
  if (st != RPL_OK) return st;
  if (op == RPL_AVG) { /* the segment this rank reduced last, and sends first */
    size_t oo, oc;
    rpl_segment(b->count, n, (r + 1) % n, &oo, &oc);
    rpl_divide(base + oo * esz, oc, b->dtype, (double)n);
  }
  int right = (r + 1) % n, left = (r - 1 + n) % n;
  for (int s = 0; s < n - 1; s++) {
    int sseg = ((r + 1 - s) % n + n) % n;
    int rseg = ((r - s) % n + n) % n;
    size_t so, sc, ro, rc;
    rpl_segment(b->count, n, sseg, &so, &sc);
    rpl_segment(b->count, n, rseg, &ro, &rc);
    rpl_xfer xs[2] = {
        rpl_send(run, right, base + so * esz, sc * esz, b->dtype, b->count, step),
        rpl_recv(run, left, base + ro * esz, rc * esz, b->dtype, b->count, step),
    };
    if ((st = rpl_exchange(run, xs, 2)) != RPL_OK) return st;
  }
  return RPL_OK;
}

rpl_status rpl_allreduce_buf(rpl_run *run, const rpl_buf *b, rpl_redop op, unsigned step) {
  if (run->size == 1) return RPL_OK;
  size_t bytes = b->count * rpl_dtype_size(b->dtype);
  int small = bytes <= run->small_bytes && run->size <= 64;
  if (small) return direct(run, b, op, step);
  if (rpl_single_copy_applies(run, bytes)) {
    int used;
    rpl_status st = rpl_single_copy_allreduce(run, b, op, step, &used);
    if (st != RPL_OK || used) return st;
  }
  return ring(run, b, op, step);
}

rpl_status rpl_algo_allreduce(rpl_run *run, const rpl_op_desc *d) {
  for (int i = 0; i < d->nin; i++) {
    const rpl_buf *b = &d->in[i];
    rpl_status st = rpl_allreduce_buf(run, b, d->redop, (unsigned)i);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}
