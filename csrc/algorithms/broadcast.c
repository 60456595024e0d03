/* broadcast.c - exact broadcast.
 *
 * Small buffers (or two ranks): the root sends to every rank directly.
 * Large buffers: a pipelined chain root -> root+1 -> ... in chunks, so every link carries
 * data at once and the time approaches one buffer transfer instead of (size-1). */
#include "algorithms.h"

#include "../common.h"
#include "../ctx.h"
#include "../kernels.h"

#define MAX_DIRECT 256

static rpl_status direct(rpl_run *run, const rpl_buf *b, int root, unsigned step) {
  size_t bytes = b->count * rpl_dtype_size(b->dtype);
  if (run->rank != root) {
    rpl_xfer x = rpl_recv(run, root, b->ptr, bytes, b->dtype, b->count, step);
    return rpl_exchange(run, &x, 1);
  }
  rpl_xfer xs[MAX_DIRECT];
  int k = 0;
  for (int p = 0; p < run->size; p++)
    if (p != root) xs[k++] = rpl_send(run, p, b->ptr, bytes, b->dtype, b->count, step);
  return rpl_exchange(run, xs, k);
}

static rpl_status chain(rpl_run *run, const rpl_buf *b, int root, unsigned step) {
  int n = run->size, r = run->rank;
  int pos = (r - root + n) % n;
  int next = (r + 1) % n, prev = (r - 1 + n) % n;
  size_t esz = rpl_dtype_size(b->dtype);
  size_t chunk = run->chunk_bytes / esz;
  if (chunk == 0) chunk = 1;
  size_t nch = (b->count + chunk - 1) / chunk;
  unsigned char *base = b->ptr;
  /* Chunk c covers elements [c*chunk, min((c+1)*chunk, count)). Step t receives chunk t and
   * forwards chunk t-1, so the whole chain moves in nch+1 steps. */
  for (size_t t = 0; t <= nch; t++) {
    rpl_xfer xs[2];
    int k = 0;
    if (pos != 0 && t < nch) {
      size_t off = t * chunk, cnt = RPL_MIN(chunk, b->count - off);
      xs[k++] = rpl_recv(run, prev, base + off * esz, cnt * esz, b->dtype, b->count, step);
    }
    int forward = pos == 0 ? t < nch : (pos != n - 1 && t >= 1);
    if (forward) {
      size_t c = pos == 0 ? t : t - 1;
      size_t off = c * chunk, cnt = RPL_MIN(chunk, b->count - off);
      xs[k++] = rpl_send(run, next, base + off * esz, cnt * esz, b->dtype, b->count, step);
    }
    if (k) {
      rpl_status st = rpl_exchange(run, xs, k);
      if (st != RPL_OK) return st;
    }
  }
  return RPL_OK;
}

rpl_status rpl_algo_broadcast(rpl_run *run, const rpl_op_desc *d) {
  if (run->size == 1) return RPL_OK;
  for (int i = 0; i < d->nin; i++) {
    const rpl_buf *b = &d->in[i];
    size_t bytes = b->count * rpl_dtype_size(b->dtype);
    int use_direct = (bytes <= run->small_bytes || run->size == 2 || b->count == 0) &&
                     run->size <= MAX_DIRECT;
    rpl_status st = use_direct ? direct(run, b, d->root, (unsigned)i)
                               : chain(run, b, d->root, (unsigned)i);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}
