/* allgather.c - exact all-gather: every rank's input lands in out[rank] on every rank.
 *
 * Small totals: direct exchange with every peer (one round). Otherwise a ring: each step
 * forwards the block received in the previous step, straight into the output. */
#include "algorithms.h"

#include <string.h>

#include "../common.h"
#include "../ctx.h"
#include "../kernels.h"

#define MAX_DIRECT 64

rpl_status rpl_algo_allgather(rpl_run *run, const rpl_op_desc *d) {
  int n = run->size, r = run->rank;
  const rpl_buf *in = &d->in[0];
  size_t bytes = in->count * rpl_dtype_size(in->dtype);
  if (bytes && d->out[r].ptr != in->ptr) memcpy(d->out[r].ptr, in->ptr, bytes);
  if (n == 1) return RPL_OK;
  if (bytes * (size_t)n <= run->small_bytes && n <= MAX_DIRECT) {
    rpl_xfer xs[2 * MAX_DIRECT];
    int k = 0;
    for (int p = 0; p < n; p++) {
      if (p == r) continue;
      xs[k++] = rpl_send(run, p, in->ptr, bytes, in->dtype, in->count, 0);
      xs[k++] = rpl_recv(run, p, d->out[p].ptr, bytes, in->dtype, in->count, 0);
    }
    return rpl_exchange(run, xs, k);
  }
  int right = (r + 1) % n, left = (r - 1 + n) % n;
  for (int s = 0; s < n - 1; s++) {
    int sb = ((r - s) % n + n) % n, rb = ((r - s - 1) % n + n) % n;
    rpl_xfer xs[2] = {
        rpl_send(run, right, d->out[sb].ptr, bytes, in->dtype, in->count, 0),
        rpl_recv(run, left, d->out[rb].ptr, bytes, in->dtype, in->count, 0),
    };
    rpl_status st = rpl_exchange(run, xs, 2);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}
