/* alltoall.c - exact all-to-all: in[p] goes to rank p's out[rank]; block sizes may differ.
 *
 * All sends and receives are posted at once; the transport interleaves them, so no pair waits
 * on another. A receiver checks each block's byte size against what it expects. */
#include "algorithms.h"

#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../ctx.h"
#include "../kernels.h"

rpl_status rpl_algo_alltoall(rpl_run *run, const rpl_op_desc *d) {
  int n = run->size, r = run->rank;
  rpl_dtype dt = d->in[0].dtype;
  size_t esz = rpl_dtype_size(dt);
  size_t self = d->in[r].count * esz;
  if (self && d->out[r].ptr != d->in[r].ptr) memmove(d->out[r].ptr, d->in[r].ptr, self);
  if (n == 1) return RPL_OK;
  rpl_xfer *xs = malloc(sizeof(rpl_xfer) * 2 * (size_t)n);
  if (!xs) return rpl_fail(run->err, RPL_ERR_NOMEM, "out of memory in alltoall");
  int k = 0;
  /* Staggered order (r+1, r+2, ...) spreads the load instead of everyone hitting rank 0. */
  for (int s = 1; s < n; s++) {
    int to = (r + s) % n, from = (r - s + n) % n;
    xs[k++] = rpl_send(run, to, d->in[to].ptr, d->in[to].count * esz, dt, RPL_ANY_COUNT, 0);
    xs[k++] = rpl_recv(run, from, d->out[from].ptr, d->out[from].count * esz, dt,
                       RPL_ANY_COUNT, 0);
  }
  rpl_status st = rpl_exchange(run, xs, k);
  free(xs);
  return st;
}
