/* compress.c - quantisers of compressed partial rounds (compress.h). */
#include "compress.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define FP16_MAX 65504.0f
#define BF16_MAX 0x1.fep127f /* the largest finite bfloat16 */

const char *rpl_compress_name(rpl_compress mode) {
  switch (mode) {
    case RPL_COMPRESS_NONE: return "none";
    case RPL_COMPRESS_BF16: return "bf16";
    case RPL_COMPRESS_FP16: return "fp16";
    case RPL_COMPRESS_INT8: return "int8";
    default: return "?";
  }
}

static size_t round4(size_t b) { return (b + 3) & ~(size_t)3; }

static size_t nblocks(size_t n) { return (n + RPL_CQ_BLOCK - 1) / RPL_CQ_BLOCK; }

size_t rpl_cq_size(rpl_compress mode, size_t n) {
  switch (mode) {
    case RPL_COMPRESS_BF16:
    case RPL_COMPRESS_FP16: return round4(2 * n);
    case RPL_COMPRESS_INT8: return 4 * nblocks(n) + round4(n);
    default: return 0;
  }
}

float rpl_cq_limit(rpl_compress mode) {
  /* fp16: 32752 = 2047 * 16 is a half value, and 2 * 32752 = 65504 the largest finite one. */
  return mode == RPL_COMPRESS_FP16 ? 32752.0f : 0x1p100f;
}

int rpl_cq_in_range(const float *x, size_t n, float limit) {
  int ok = 1;
  /* No early exit: a branch-free loop vectorises, and NaN fails the comparison. */
  for (size_t i = 0; i < n; i++) ok &= fabsf(x[i]) <= limit;
  return ok;
}

/* Saturates to [-m, m]; NaN (a broken contract: rounds check their input first) gives 0. */
static float clampf(float v, float m) { return v > m ? m : (v < -m ? -m : (v == v ? v : 0.0f)); }

static void encode_int8(const float *x, size_t n, unsigned char *out) {
  size_t nb = nblocks(n);
  signed char *q = (signed char *)(out + 4 * nb);
  for (size_t b = 0; b < nb; b++) {
    size_t lo = b * RPL_CQ_BLOCK, hi = lo + RPL_CQ_BLOCK < n ? lo + RPL_CQ_BLOCK : n;
    float amax = 0.0f;
    for (size_t i = lo; i < hi; i++) amax = fmaxf(amax, fabsf(x[i]));
    float scale = amax / 127.0f;
    memcpy(out + 4 * b, &scale, 4);
    if (scale == 0.0f) { /* zeros, or magnitudes so tiny that the scale underflows */
      memset(q + lo, 0, hi - lo);
      continue;
    }
    for (size_t i = lo; i < hi; i++) {
      /* Division, not a multiplication by 127/amax: that inverse overflows for tiny amax. */
      float v = nearbyintf(clampf(x[i], amax) / scale);
      q[i] = (signed char)clampf(v, 127.0f);
    }
  }
  memset(q + n, 0, round4(n) - n);
}

void rpl_cq_encode(rpl_compress mode, const float *x, size_t n, void *out) {
  unsigned char *o = out;
  if (mode == RPL_COMPRESS_INT8) {
    encode_int8(x, n, o);
    return;
  }
  if (mode != RPL_COMPRESS_BF16 && mode != RPL_COMPRESS_FP16) return;
  uint16_t *h = out;
  if (mode == RPL_COMPRESS_BF16)
    for (size_t i = 0; i < n; i++) h[i] = rpl_float_to_bf16(clampf(x[i], BF16_MAX));
  else
    for (size_t i = 0; i < n; i++) h[i] = rpl_float_to_half(clampf(x[i], FP16_MAX));
  memset(o + 2 * n, 0, rpl_cq_size(mode, n) - 2 * n);
}

int rpl_cq_decode(rpl_compress mode, const void *in, size_t n, float bound, float *out) {
  const unsigned char *p = in;
  int ok = 1;
  if (mode == RPL_COMPRESS_INT8) {
    size_t nb = nblocks(n);
    const signed char *q = (const signed char *)(p + 4 * nb);
    for (size_t b = 0; b < nb; b++) {
      size_t lo = b * RPL_CQ_BLOCK, hi = lo + RPL_CQ_BLOCK < n ? lo + RPL_CQ_BLOCK : n;
      float scale;
      memcpy(&scale, p + 4 * b, 4);
      /* !(a <= b) also rejects NaN */
      if (!(scale >= 0.0f && scale <= bound / 127.0f * (1.0f + 0x1p-10f))) return -1;
      for (size_t i = lo; i < hi; i++) {
        ok &= q[i] != -128;
        out[i] = (float)q[i] * scale;
      }
    }
    return ok ? 0 : -1;
  }
  if (mode != RPL_COMPRESS_BF16 && mode != RPL_COMPRESS_FP16) return -1;
  const uint16_t *h = in;
  if (mode == RPL_COMPRESS_BF16)
    for (size_t i = 0; i < n; i++) out[i] = rpl_bf16_to_float(h[i]);
  else
    for (size_t i = 0; i < n; i++) out[i] = rpl_half_to_float(h[i]);
  return rpl_cq_in_range(out, n, bound) ? 0 : -1;
}
