/* single_copy.c - all-reduce between ranks of one host that read each other's buffers.
 *
 * The ring moves every byte through a shared-memory ring: copied in by the sender, copied out
 * by the receiver. Here a rank reads its peers' buffers directly (cross-memory attach,
 * rpl_read_peer), so each byte crosses between processes once:
 *
 *   0. handshake: every member sends every other its buffer's address and whether it may read
 *      every member's memory; all proceed only if all may (else all take the ring, the same
 *      decision everywhere, since all see the same flags);
 *   1. rank i owns segment i (rpl_segment): chunk by chunk it reads that segment of each
 *      peer's buffer into a small cache-resident scratch and reduces all of them, in rank
 *      order, into its own buffer (float16/bfloat16 accumulate in float32, rounded once);
 *      (AVG: and divides it, while the chunk is still in cache);
 *   2. barrier: every segment is reduced;
 *   3. each rank reads every other owner's reduced segment straight into its own buffer;
 *   4. barrier: nobody still reads anybody's buffer, so each may return.
 *
 * While a peer reads segment j of our buffer we write only our own segment (phase 1) or the
 * segments the peer no longer reads (phase 3), so no copy ever sees a half-written value.
 * Each segment is reduced once, by its owner: every rank ends with the same bits.
 * The barriers are ordinary zero-length messages, so a peer that called another collective,
 * with other sizes, or died, fails the exchange as in the other algorithms. */
#include "algorithms.h"

#include <string.h>

#include "../common.h"
#include "../ctx.h"
#include "../kernels.h"

#define SC_CHUNK_BYTES (64u * 1024u) /* per peer, reduced while still in cache */
#define SC_MAX_RANKS 64

typedef struct sc_hello {
  uint64_t addr; /* the buffer, in the sender's address space */
  uint64_t ok;   /* the sender may read every member */
} sc_hello;

/* Zero-length messages with every other member. */
static rpl_status barrier(rpl_run *run, const rpl_buf *b, unsigned step) {
  rpl_xfer xs[2 * SC_MAX_RANKS];
  int k = 0;
  for (int p = 0; p < run->size; p++) {
    if (p == run->rank) continue;
    xs[k++] = rpl_send(run, p, NULL, 0, b->dtype, b->count, step);
    xs[k++] = rpl_recv(run, p, NULL, 0, b->dtype, b->count, step);
  }
  return rpl_exchange(run, xs, k);
}

int rpl_single_copy_applies(const rpl_run *run, size_t bytes) {
  if (run->size < 2 || run->size > SC_MAX_RANKS || !run->same_host) return 0;
  if (run->single_copy_bytes == 0 || bytes < run->single_copy_bytes) return 0;
  for (int p = 0; p < run->size; p++)
    if (!rpl_peer_local(run, p)) return 0;
  return 1;
}

rpl_status rpl_single_copy_allreduce(rpl_run *run, const rpl_buf *b, rpl_redop op,
                                     unsigned step, int *used) {
  int n = run->size, me = run->rank;
  size_t esz = rpl_dtype_size(b->dtype);
  *used = 0;

  sc_hello mine = {(uint64_t)(uintptr_t)b->ptr, 1}, theirs[SC_MAX_RANKS];
  for (int p = 0; p < n; p++)
    if (p != me && !rpl_peer_readable(run, p)) mine.ok = 0;
  rpl_xfer xs[2 * SC_MAX_RANKS];
  int k = 0;
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    xs[k++] = rpl_send(run, p, &mine, sizeof mine, b->dtype, b->count, step);
    xs[k++] = rpl_recv(run, p, &theirs[p], sizeof theirs[p], b->dtype, b->count, step);
  }
  rpl_status st = rpl_exchange(run, xs, k);
  if (st != RPL_OK) return st;
  if (!mine.ok) return RPL_OK;
  for (int p = 0; p < n; p++)
    if (p != me && !theirs[p].ok) return RPL_OK;
  *used = 1;
  theirs[me] = mine;

  /* Phase 1: reduce our segment, chunk by chunk. */
  size_t off, cnt;
  rpl_segment(b->count, n, me, &off, &cnt);
  size_t chunk = SC_CHUNK_BYTES / esz;
  unsigned char *tmp = rpl_scratch(run, 1, (size_t)n * chunk * esz);
  if (!tmp) return RPL_ERR_NOMEM;
  unsigned char *base = b->ptr;
  const void *srcs[SC_MAX_RANKS];
  for (size_t done = 0; done < cnt; done += chunk) {
    size_t c = RPL_MIN(chunk, cnt - done), at = (off + done) * esz;
    for (int p = 0; p < n; p++) {
      if (p == me) {
        srcs[p] = base + at;
        continue;
      }
      unsigned char *dst = tmp + (size_t)p * chunk * esz;
      st = rpl_read_peer(run, p, theirs[p].addr + at, dst, c * esz);
      if (st != RPL_OK) return st;
      srcs[p] = dst;
    }
    rpl_reduce_many(base + at, srcs, n, c, b->dtype, op);
    if (op == RPL_AVG) rpl_divide(base + at, c, b->dtype, (double)n); /* still in cache */
  }
  if ((st = barrier(run, b, step)) != RPL_OK) return st;

  /* Phase 3: every other segment from its owner. */
  for (int p = 0; p < n; p++) {
    if (p == me) continue;
    rpl_segment(b->count, n, p, &off, &cnt);
    if (!cnt) continue;
    st = rpl_read_peer(run, p, theirs[p].addr + off * esz, base + off * esz, cnt * esz);
    if (st != RPL_OK) return st;
  }
  return barrier(run, b, step);
}
