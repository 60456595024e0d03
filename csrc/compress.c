/* compress.c - quantisers of compressed partial rounds (compress.h). */
#include "compress.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* ---- branch-free conversions of finite values (the callers clamp first), inline so that the
 * loops vectorise; tests/c/test_compress.c checks them against kernels.c's. */

static inline uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float bitsf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even */
  uint32_t u = fbits(f);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float from_bf16(uint16_t b) { return bitsf((uint32_t)b << 16); }

/* |f| <= 65504: normals by rebiasing with round to nearest even, subnormals through the float
 * adder (adding 0.5 aligns the mantissa so that the hardware rounds it). */
static inline uint16_t to_half(float f) {
  uint32_t u = fbits(f), sign = u & 0x80000000u;
  u ^= sign;
  uint32_t normal = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  uint32_t sub = fbits(bitsf(u) + 0.5f) - fbits(0.5f);
  uint32_t h = u >= 0x38800000u ? normal : sub; /* 2^-14, the smallest normal half */
  return (uint16_t)(h | (sign >> 16));
}
static inline float from_half(uint16_t h) { /* finite halves; the caller rejects the rest */
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
  float normal = bitsf((em << 13) + ((uint32_t)(127 - 15) << 23));
  float sub = (float)(int32_t)em * 0x1p-24f;
  return bitsf(fbits(em >= 0x400u ? normal : sub) | sign);
}

static size_t round4(size_t b) { return (b + 3) & ~(size_t)3; }

static size_t nblocks(size_t n) { return (n + RPL_CQ_BLOCK - 1) / RPL_CQ_BLOCK; }

/* The int8 layout (compress.h), shared by the encoder, the decoder and the residual: the end
 * of the block starting at lo, block b's scale, and where the values start. */
static size_t block_end(size_t lo, size_t n) {
  return lo + RPL_CQ_BLOCK < n ? lo + RPL_CQ_BLOCK : n;
}
static float block_scale(const unsigned char *p, size_t b) {
  float scale;
  memcpy(&scale, p + 4 * b, 4);
  return scale;
}
static const signed char *int8_values(const unsigned char *p, size_t n) {
  return (const signed char *)(p + 4 * nblocks(n));
}

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
    size_t lo = b * RPL_CQ_BLOCK, hi = block_end(lo, n);
    float amax = 0.0f;
    for (size_t i = lo; i < hi; i++) {
      float v = fabsf(x[i]);
      amax = v > amax ? v : amax; /* (no NaN here: the round checked its input) */
    }
    float scale = amax / 127.0f;
    memcpy(out + 4 * b, &scale, 4);
    if (scale == 0.0f) { /* zeros, or magnitudes so tiny that the scale underflows */
      memset(q + lo, 0, hi - lo);
      continue;
    }
    /* 1.5 * 2^23 added and taken away rounds |v| <= 2^22 to the nearest integer (even on
     * ties) in the default rounding mode, and vectorises, unlike nearbyintf. */
    const float magic = 12582912.0f, inv = 127.0f / amax;
    if (inv <= FLT_MAX) {
      for (size_t i = lo; i < hi; i++) {
        float v = (clampf(x[i], amax) * inv + magic) - magic;
        q[i] = (signed char)clampf(v, 127.0f);
      }
    } else { /* amax so tiny that 127 / amax overflows: divide */
      for (size_t i = lo; i < hi; i++) {
        float v = (clampf(x[i], amax) / scale + magic) - magic;
        q[i] = (signed char)clampf(v, 127.0f);
      }
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
    for (size_t i = 0; i < n; i++) h[i] = to_bf16(clampf(x[i], BF16_MAX));
  else
    for (size_t i = 0; i < n; i++) h[i] = to_half(clampf(x[i], FP16_MAX));
  memset(o + 2 * n, 0, rpl_cq_size(mode, n) - 2 * n);
}

int rpl_cq_decode(rpl_compress mode, const void *in, size_t n, float bound, float *out) {
  const unsigned char *p = in;
  int ok = 1;
  if (mode == RPL_COMPRESS_INT8) {
    const signed char *q = int8_values(p, n);
    for (size_t b = 0; b < nblocks(n); b++) {
      size_t lo = b * RPL_CQ_BLOCK, hi = block_end(lo, n);
      float scale = block_scale(p, b);
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
  if (mode == RPL_COMPRESS_BF16) {
    for (size_t i = 0; i < n; i++) out[i] = from_bf16(h[i]);
  } else {
    for (size_t i = 0; i < n; i++) {
      ok &= (h[i] & 0x7c00u) != 0x7c00u; /* inf and NaN halves */
      out[i] = from_half(h[i]);
    }
  }
  return ok && rpl_cq_in_range(out, n, bound) ? 0 : -1;
}

void rpl_cq_encode_residual(rpl_compress mode, float *y, size_t n, void *out) {
  rpl_cq_encode(mode, y, n, out);
  if (mode == RPL_COMPRESS_BF16) {
    const uint16_t *h = out;
    for (size_t i = 0; i < n; i++) y[i] -= from_bf16(h[i]);
  } else if (mode == RPL_COMPRESS_FP16) {
    const uint16_t *h = out;
    for (size_t i = 0; i < n; i++) y[i] -= from_half(h[i]);
  } else if (mode == RPL_COMPRESS_INT8) {
    const unsigned char *p = out;
    const signed char *q = int8_values(p, n);
    for (size_t b = 0; b < nblocks(n); b++) {
      size_t lo = b * RPL_CQ_BLOCK, hi = block_end(lo, n);
      float scale = block_scale(p, b);
      for (size_t i = lo; i < hi; i++) y[i] -= (float)q[i] * scale;
    }
  }
}

/* Exposed for the unit test's comparison with kernels.c. */
uint16_t rpl_cq_to_half(float f) { return to_half(f); }
float rpl_cq_from_half(uint16_t h) { return from_half(h); }
uint16_t rpl_cq_to_bf16(float f) { return to_bf16(f); }
