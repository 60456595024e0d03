/* rooted.c - gather, scatter and reduce: operations with a root.
 *
 * Gather and scatter move blocks directly between the root and each rank. Reduce sends every
 * buffer to the root, which reduces in rank order, for small buffers; for large ones it runs a
 * ring reduce-scatter on a scratch copy and gathers the reduced segments at the root, so the
 * root's link is not the bottleneck. Non-root buffers are never modified. */
#include "algorithms.h"

#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../ctx.h"
#include "../kernels.h"

#define MAX_DIRECT 64

/* Gather and scatter are one exchange in opposite directions: every rank's block (`one`)
 * travels to or from the root's block for it, many[rank]. */
static rpl_status root_blocks(rpl_run *run, const rpl_op_desc *d, int gather) {
  int n = run->size, r = run->rank, root = d->root;
  const rpl_buf *one = gather ? &d->in[0] : &d->out[0];
  const rpl_buf *many = gather ? d->out : d->in;
  rpl_dtype dt = one->dtype;
  size_t bytes = one->count * rpl_dtype_size(dt);
  if (r != root) {
    rpl_xfer x = gather ? rpl_send(run, root, one->ptr, bytes, dt, one->count, 0)
                        : rpl_recv(run, root, one->ptr, bytes, dt, one->count, 0);
    return rpl_exchange(run, &x, 1);
  }
  if (bytes && many[r].ptr != one->ptr) {
    if (gather) memcpy(many[r].ptr, one->ptr, bytes);
    else memcpy(one->ptr, many[r].ptr, bytes);
  }
  if (n == 1) return RPL_OK;
  rpl_xfer *xs = malloc(sizeof(rpl_xfer) * (size_t)n);
  if (!xs)
    return rpl_fail(run->err, RPL_ERR_NOMEM, "out of memory in %s", gather ? "gather" : "scatter");
  int k = 0;
  for (int p = 0; p < n; p++)
    if (p != r)
      xs[k++] = gather ? rpl_recv(run, p, many[p].ptr, bytes, dt, one->count, 0)
                       : rpl_send(run, p, many[p].ptr, bytes, dt, one->count, 0);
  rpl_status st = rpl_exchange(run, xs, k);
  free(xs);
  return st;
}

rpl_status rpl_algo_gather(rpl_run *run, const rpl_op_desc *d) { return root_blocks(run, d, 1); }

rpl_status rpl_algo_scatter(rpl_run *run, const rpl_op_desc *d) { return root_blocks(run, d, 0); }

rpl_status rpl_algo_reduce(rpl_run *run, const rpl_op_desc *d) {
  int n = run->size, r = run->rank, root = d->root;
  const rpl_buf *b = &d->in[0];
  rpl_dtype dt = b->dtype;
  size_t esz = rpl_dtype_size(dt), bytes = b->count * esz;
  rpl_status st;
  if (n == 1) {
    /* nothing to combine */
  } else if (bytes <= run->small_bytes && n <= MAX_DIRECT) {
    if (r != root) {
      rpl_xfer x = rpl_send(run, root, b->ptr, bytes, dt, b->count, 0);
      return rpl_exchange(run, &x, 1);
    }
    unsigned char *all = rpl_scratch(run, 0, bytes * (size_t)n);
    if (!all) return RPL_ERR_NOMEM;
    rpl_xfer xs[MAX_DIRECT];
    const void *srcs[MAX_DIRECT];
    int k = 0;
    for (int p = 0; p < n; p++)
      if (p != r) xs[k++] = rpl_recv(run, p, all + (size_t)p * bytes, bytes, dt, b->count, 0);
    if ((st = rpl_exchange(run, xs, k)) != RPL_OK) return st;
    for (int p = 0; p < n; p++) srcs[p] = p == r ? b->ptr : all + (size_t)p * bytes;
    rpl_reduce_many(b->ptr, srcs, n, b->count, dt, d->redop);
  } else {
    unsigned char *work = rpl_scratch(run, 0, bytes);
    if (!work) return RPL_ERR_NOMEM;
    memcpy(work, b->ptr, bytes);
    if ((st = rpl_ring_reduce_scatter(run, work, b->count, dt, d->redop, 0, 0)) != RPL_OK)
      return st;
    size_t off, cnt;
    if (r != root) {
      rpl_segment(b->count, n, r, &off, &cnt);
      rpl_xfer x = rpl_send(run, root, work + off * esz, cnt * esz, dt, b->count, 1);
      return rpl_exchange(run, &x, 1);
    }
    rpl_xfer *xs = malloc(sizeof(rpl_xfer) * (size_t)n);
    if (!xs) return rpl_fail(run->err, RPL_ERR_NOMEM, "out of memory in reduce");
    int k = 0;
    for (int p = 0; p < n; p++) {
      rpl_segment(b->count, n, p, &off, &cnt);
      if (p == r) memcpy((unsigned char *)b->ptr + off * esz, work + off * esz, cnt * esz);
      else xs[k++] = rpl_recv(run, p, (unsigned char *)b->ptr + off * esz, cnt * esz, dt,
                              b->count, 1);
    }
    st = rpl_exchange(run, xs, k);
    free(xs);
    if (st != RPL_OK) return st;
  }
  if (r == root && d->redop == RPL_AVG) rpl_divide(b->ptr, b->count, dt, (double)n);
  return RPL_OK;
}
