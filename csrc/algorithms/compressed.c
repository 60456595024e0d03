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

/* One compressed average's layout: chunk k of the buffer (coff[k], ccnt[k] elements) is
 * owned by member k; its encoding lies at eoff[k] of an encoded buffer. coff and xs are
 * owned (freed by plan_free); the rest points into the run's scratch. */
typedef struct cq_plan {
  int n, me;
  rpl_compress mode;
  float limit;
  size_t count;
  size_t *coff, *ccnt, *eoff;
  size_t emine;             /* encoded size of my chunk */
  unsigned char *mine, *b1; /* slot 0: my encoding, then one stage-1/2 slot per member */
  unsigned char *r2;        /* slot 1: the stage-2 chunks from each owner */
  float *acc, *tmp;         /* slot 1: the owner's float32 sum, a temporary */
  rpl_xfer *xs;             /* 2 (n-1) transfers */
} cq_plan;

static void plan_free(cq_plan *pl) {
  free(pl->coff);
  free(pl->xs);
}

static rpl_status plan_make(rpl_run *run, size_t count, rpl_compress mode, cq_plan *pl) {
  int n = run->size, me = run->rank;
  *pl = (cq_plan){.n = n, .me = me, .mode = mode, .limit = rpl_cq_limit(mode), .count = count};
  pl->coff = malloc(sizeof(size_t) * 3 * (size_t)n);
  pl->xs = malloc(sizeof(rpl_xfer) * 2 * (size_t)n);
  if (!pl->coff || !pl->xs) {
    plan_free(pl);
    return rpl_fail(run->err, RPL_ERR_NOMEM, "out of memory in a compressed partial round");
  }
  size_t *coff = pl->coff, *ccnt = coff + n, *eoff = coff + 2 * (size_t)n;
  pl->ccnt = ccnt;
  pl->eoff = eoff;
  size_t etotal = 0, maxcnt = 0;
  for (int k = 0; k < n; k++) {
    rpl_segment(count, n, k, &coff[k], &ccnt[k]);
    eoff[k] = etotal;
    etotal += rpl_cq_size(mode, ccnt[k]);
    if (ccnt[k] > maxcnt) maxcnt = ccnt[k];
  }
  size_t emine = pl->emine = rpl_cq_size(mode, ccnt[me]);
  size_t s1 = align64(etotal) + (size_t)n * emine;
  size_t s2a = align64(etotal), s2 = s2a + align64(4 * ccnt[me]) + 4 * maxcnt;
  pl->mine = rpl_scratch(run, 0, s1);
  pl->b1 = pl->mine + align64(etotal);
  pl->r2 = rpl_scratch(run, 1, s2);
  if (!pl->mine || !pl->r2) {
    plan_free(pl);
    return RPL_ERR_NOMEM;
  }
  pl->acc = (float *)(pl->r2 + s2a);
  pl->tmp = (float *)(pl->r2 + s2a + align64(4 * ccnt[me]));
  return RPL_OK;
}

/* Stage 1: quantise, turning y into the residual y - deQ(Q(y)) the caller commits with the
 * round, and send chunk k to member k. */
static rpl_status stage1(rpl_run *run, cq_plan *pl, float *y) {
  const cq_plan *p = pl;
  for (int k = 0; k < p->n; k++)
    rpl_cq_encode_residual(p->mode, y + p->coff[k], p->ccnt[k], p->mine + p->eoff[k]);
  int m = 0;
  for (int v = 0; v < p->n; v++) {
    if (v == p->me) continue;
    p->xs[m++] = rpl_send(run, v, p->mine + p->eoff[v], rpl_cq_size(p->mode, p->ccnt[v]),
                          RPL_UINT8, p->count, STAGE1);
    p->xs[m++] = rpl_recv(run, v, p->b1 + (size_t)v * p->emine, p->emine, RPL_UINT8, p->count,
                          STAGE1);
  }
  return rpl_exchange(run, p->xs, m);
}

/* The owner's average of chunk `me`, summed in member order (deterministic). */
static rpl_status owner_average(rpl_run *run, const cq_plan *p) {
  size_t c = p->ccnt[p->me];
  memset(p->acc, 0, 4 * c);
  for (int v = 0; v < p->n; v++) {
    const unsigned char *src =
        v == p->me ? p->mine + p->eoff[p->me] : p->b1 + (size_t)v * p->emine;
    if (rpl_cq_decode(p->mode, src, c, p->limit * SLACK, p->tmp) != 0) return bad_peer(run, v, 1);
    for (size_t i = 0; i < c; i++) p->acc[i] += p->tmp[i];
  }
  for (size_t i = 0; i < c; i++) p->acc[i] /= (float)p->n;
  return RPL_OK;
}

/* Stage 2: each member's difference to the average, encoded over its stage-1 slot. */
static rpl_status stage2(rpl_run *run, const cq_plan *p) {
  size_t c = p->ccnt[p->me];
  int m = 0;
  for (int v = 0; v < p->n; v++) {
    if (v == p->me) continue;
    unsigned char *slot = p->b1 + (size_t)v * p->emine;
    rpl_cq_decode(p->mode, slot, c, p->limit * SLACK, p->tmp); /* checked above */
    for (size_t i = 0; i < c; i++) p->tmp[i] = p->acc[i] - p->tmp[i];
    rpl_cq_encode(p->mode, p->tmp, c, slot);
    p->xs[m++] = rpl_send(run, v, slot, p->emine, RPL_UINT8, p->count, STAGE2);
    p->xs[m++] = rpl_recv(run, v, p->r2 + p->eoff[v], rpl_cq_size(p->mode, p->ccnt[v]),
                          RPL_UINT8, p->count, STAGE2);
  }
  return rpl_exchange(run, p->xs, m);
}

/* Every chunk of the average: my stage-1 value plus the owner's difference (my own chunk
 * exactly). */
static rpl_status assemble(rpl_run *run, const cq_plan *p, float *out) {
  for (int k = 0; k < p->n; k++) {
    float *o = out + p->coff[k];
    if (k == p->me) {
      memcpy(o, p->acc, 4 * p->ccnt[k]);
      continue;
    }
    rpl_cq_decode(p->mode, p->mine + p->eoff[k], p->ccnt[k], p->limit * SLACK, o);
    if (rpl_cq_decode(p->mode, p->r2 + p->eoff[k], p->ccnt[k], 2.0f * p->limit * SLACK,
                      p->tmp) != 0)
      return bad_peer(run, k, 2);
    for (size_t i = 0; i < p->ccnt[k]; i++) o[i] += p->tmp[i];
  }
  return RPL_OK;
}

rpl_status rpl_compressed_average(rpl_run *run, float *y, size_t count, rpl_compress mode,
                                  float *out) {
  cq_plan pl;
  rpl_status st = plan_make(run, count, mode, &pl);
  if (st != RPL_OK) return st;
  st = stage1(run, &pl, y);
  if (st == RPL_OK) st = owner_average(run, &pl);
  if (st == RPL_OK) st = stage2(run, &pl);
  if (st == RPL_OK) st = assemble(run, &pl, out);
  plan_free(&pl);
  return st;
}
