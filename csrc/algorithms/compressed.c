/* compressed.c - the compressed average of a partial round (docs/compression.md).
 *
 * Two stages over the run's n members, each a direct exchange (groups are small):
 *   1. reduce-scatter: member j quantises its values y_j (the caller's buffer plus the error
 *      feedback residual) chunk by chunk, q_j = Q(y_j), and sends chunk k to member k; the
 *      owner k decodes them and averages in float32, in member order: avg_k.
 *   2. all-gather, delta-coded: owner k sends member i Q(avg_k - q_i,k), the difference to
 *      i's own stage-1 value, which both know exactly; i takes q_i,k + that. The difference is
 *      as small as the members' disagreement, so little is lost rounding it; the owner keeps
 *      avg_k exactly.
 * Each member sends 2 (n-1)/n of the buffer, compressed: the ring all-reduce's bytes over the
 * compression ratio. Every value a peer sends is checked (compress.h) before use. */
#include "algorithms.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../common.h"
#include "../compress.h"
#include "../ctx.h"

#define STAGE1 1u
#define STAGE2 2u
#define SLACK (1.0f + 0x1p-6f) /* rounding headroom of honest values over the mode's limit */

static size_t align64(size_t b) { return (b + 63) & ~(size_t)63; }

static rpl_status bad_peer(rpl_run *run, int v, int stage) {
  return rpl_fail(run->err, RPL_ERR_PEER,
                  "rank %d sent an invalid compressed chunk in stage %d of a partial round (a "
                  "non-finite value or scale, or one out of range): refused",
                  run->members ? run->members[v] : v, stage);
}

rpl_status rpl_compressed_average(rpl_run *run, float *y, size_t count, rpl_compress mode,
                                  float *out) {
  int n = run->size, me = run->rank;
  const float limit = rpl_cq_limit(mode);
  size_t *coff = malloc(sizeof(size_t) * 3 * (size_t)n);
  rpl_xfer *xs = malloc(sizeof(rpl_xfer) * 2 * (size_t)n);
  if (!coff || !xs) {
    free(coff);
    free(xs);
    return rpl_fail(run->err, RPL_ERR_NOMEM, "out of memory in a compressed partial round");
  }
  size_t *ccnt = coff + n, *eoff = coff + 2 * (size_t)n;
  size_t etotal = 0, maxcnt = 0;
  for (int k = 0; k < n; k++) {
    rpl_segment(count, n, k, &coff[k], &ccnt[k]);
    eoff[k] = etotal;
    etotal += rpl_cq_size(mode, ccnt[k]);
    if (ccnt[k] > maxcnt) maxcnt = ccnt[k];
  }
  size_t emine = rpl_cq_size(mode, ccnt[me]);
  /* slot 0: my encoding, then one stage-1/stage-2 slot per member for my chunk;
   * slot 1: the stage-2 chunks from each owner, the owner's float32 sum, a temporary. */
  size_t s1 = align64(etotal) + (size_t)n * emine;
  size_t s2a = align64(etotal), s2 = s2a + align64(4 * ccnt[me]) + 4 * maxcnt;
  unsigned char *mine = rpl_scratch(run, 0, s1), *b1 = mine + align64(etotal);
  unsigned char *r2 = rpl_scratch(run, 1, s2);
  rpl_status st = RPL_OK;
  if (!mine || !r2) {
    st = RPL_ERR_NOMEM;
    goto out;
  }
  float *acc = (float *)(r2 + s2a), *tmp = (float *)(r2 + s2a + align64(4 * ccnt[me]));

  /* Quantise, and turn y into the residual y - deQ(Q(y)) the caller commits with the round. */
  for (int k = 0; k < n; k++) rpl_cq_encode_residual(mode, y + coff[k], ccnt[k], mine + eoff[k]);

  int m = 0;
  for (int v = 0; v < n; v++) {
    if (v == me) continue;
    xs[m++] = rpl_send(run, v, mine + eoff[v], rpl_cq_size(mode, ccnt[v]), RPL_UINT8, count,
                       STAGE1);
    xs[m++] = rpl_recv(run, v, b1 + (size_t)v * emine, emine, RPL_UINT8, count, STAGE1);
  }
  if ((st = rpl_exchange(run, xs, m)) != RPL_OK) goto out;

  /* The owner's average of chunk `me`, summed in member order (deterministic). */
  memset(acc, 0, 4 * ccnt[me]);
  for (int v = 0; v < n; v++) {
    const unsigned char *src = v == me ? mine + eoff[me] : b1 + (size_t)v * emine;
    if (rpl_cq_decode(mode, src, ccnt[me], limit * SLACK, tmp) != 0) {
      st = bad_peer(run, v, 1);
      goto out;
    }
    for (size_t i = 0; i < ccnt[me]; i++) acc[i] += tmp[i];
  }
  for (size_t i = 0; i < ccnt[me]; i++) acc[i] /= (float)n;

  /* Stage 2: each member's difference to the average, encoded over its stage-1 slot. */
  m = 0;
  for (int v = 0; v < n; v++) {
    if (v == me) continue;
    unsigned char *slot = b1 + (size_t)v * emine;
    rpl_cq_decode(mode, slot, ccnt[me], limit * SLACK, tmp); /* checked above */
    for (size_t i = 0; i < ccnt[me]; i++) tmp[i] = acc[i] - tmp[i];
    rpl_cq_encode(mode, tmp, ccnt[me], slot);
    xs[m++] = rpl_send(run, v, slot, emine, RPL_UINT8, count, STAGE2);
    xs[m++] = rpl_recv(run, v, r2 + eoff[v], rpl_cq_size(mode, ccnt[v]), RPL_UINT8, count,
                       STAGE2);
  }
  if ((st = rpl_exchange(run, xs, m)) != RPL_OK) goto out;

  for (int k = 0; k < n; k++) {
    float *o = out + coff[k];
    if (k == me) {
      memcpy(o, acc, 4 * ccnt[k]);
      continue;
    }
    rpl_cq_decode(mode, mine + eoff[k], ccnt[k], limit * SLACK, o);
    if (rpl_cq_decode(mode, r2 + eoff[k], ccnt[k], 2.0f * limit * SLACK, tmp) != 0) {
      st = bad_peer(run, k, 2);
      goto out;
    }
    for (size_t i = 0; i < ccnt[k]; i++) o[i] += tmp[i];
  }
out:
  free(coff);
  free(xs);
  return st;
}
