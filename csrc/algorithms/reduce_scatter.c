/* reduce_scatter.c - exact reduce-scatter: out = reduction over ranks of their in[rank].
 *
 * Inputs are never modified. Small blocks: every rank sends in[p] to p, and each reduces the
 * blocks it receives in rank order. Otherwise a ring reduce-scatter over a scratch copy. */
#include "algorithms.h"

#include <string.h>

#include "../common.h"
#include "../ctx.h"
#include "../kernels.h"

#define MAX_DIRECT 64

rpl_status rpl_algo_reduce_scatter(rpl_run *run, const rpl_op_desc *d) {
  int n = run->size, r = run->rank;
  const rpl_buf *out = &d->out[0];
  rpl_dtype dt = out->dtype;
  size_t esz = rpl_dtype_size(dt), bytes = out->count * esz;
  rpl_status st = RPL_OK;
  if (n == 1) {
    if (bytes && out->ptr != d->in[0].ptr) memcpy(out->ptr, d->in[0].ptr, bytes);
  } else if (bytes * (size_t)n <= run->small_bytes && n <= MAX_DIRECT) {
    unsigned char *all = rpl_scratch(run, 0, bytes * (size_t)n);
    if (!all) return RPL_ERR_NOMEM;
    rpl_xfer xs[2 * MAX_DIRECT];
    const void *srcs[MAX_DIRECT];
    int k = 0;
    for (int p = 0; p < n; p++) {
      if (p == r) continue;
      xs[k++] = rpl_send(run, p, d->in[p].ptr, bytes, dt, out->count, 0);
      xs[k++] = rpl_recv(run, p, all + (size_t)p * bytes, bytes, dt, out->count, 0);
    }
    if ((st = rpl_exchange(run, xs, k)) != RPL_OK) return st;
    for (int p = 0; p < n; p++) srcs[p] = p == r ? d->in[r].ptr : all + (size_t)p * bytes;
    rpl_reduce_many(out->ptr, srcs, n, out->count, dt, d->redop);
  } else {
    /* Lay the blocks out contiguously so block p is ring segment p, then reduce-scatter with
     * shift 0: this rank ends up owning segment `rank`. */
    unsigned char *work = rpl_scratch(run, 0, bytes * (size_t)n);
    if (!work) return RPL_ERR_NOMEM;
    for (int p = 0; p < n; p++)
      if (bytes) memcpy(work + (size_t)p * bytes, d->in[p].ptr, bytes);
    st = rpl_ring_reduce_scatter(run, work, out->count * (size_t)n, dt, d->redop, 0, 0);
    if (st != RPL_OK) return st;
    if (bytes) memcpy(out->ptr, work + (size_t)r * bytes, bytes);
  }
  if (d->redop == RPL_AVG) rpl_divide(out->ptr, out->count, dt, (double)n);
  return RPL_OK;
}
