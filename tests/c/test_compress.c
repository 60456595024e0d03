/*
 * test_compress.c - the quantisers of compressed partial rounds (csrc/compress.c), and one
 * compressed round over ranks as threads on two simulated hosts.
 *
 * Quantisers: round trips stay within the documented bounds (bf16: 2^-8 relative, fp16: 2^-11
 * relative for normals, int8: absmax_block/254), blocks are independent, odd lengths pad with
 * zeros, and decoders refuse what no honest encoder produces (NaN/inf values or scales, -128,
 * magnitudes beyond the bound). Rounds: the compressed average equals the exact one within the
 * bound, error feedback keeps sub-grid increments that the naive quantiser loses, and a
 * member whose compression setting differs fails the round with RPL_ERR_MISMATCH.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "compress.h"
#include "harness.h"
#include "kernels.h"
#include "ripples.h"
#include "sched/rpl_sched.h"

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static double urand(void) { /* xorshift64*, in [0, 1) */
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return (double)((g_rng * 0x2545f4914f6cdd1dull) >> 11) * 0x1p-53;
}

static float *roundtrip(rpl_compress m, const float *x, size_t n, unsigned char *enc) {
  float *y = malloc(sizeof(float) * (n ? n : 1));
  rpl_cq_encode(m, x, n, enc);
  REQUIRE(rpl_cq_decode(m, enc, n, rpl_cq_limit(m) * 1.02f, y) == 0, "%s decode of n=%zu",
          rpl_compress_name(m), n);
  return y;
}

/* The inline conversions of compress.c against kernels.c's (themselves tested against an
 * independent reference in test_kernels.c): every finite half, and many floats of every
 * magnitude within the range, ties included. */
static void test_conversions(void) {
  int bad = 0;
  for (uint32_t h = 0; h < 0x10000; h++) {
    if ((h & 0x7c00) == 0x7c00) continue; /* inf/NaN: refused before conversion */
    float a = rpl_cq_from_half((uint16_t)h), b = rpl_half_to_float((uint16_t)h);
    bad += memcmp(&a, &b, 4) != 0;
  }
  CHECK(bad == 0, "half -> float differs from kernels.c for %d halves", bad);
  int bad_h = 0, bad_b = 0;
  for (int i = 0; i < 2000000; i++) {
    float f;
    if (i < 65536) { /* exact ties and neighbours around every half */
      uint32_t u = (uint32_t)((i & 0x7fff) << 13) + ((uint32_t)(127 - 15) << 23);
      u += (uint32_t)((i >> 15) & 1) * 0x1000; /* half-way between two halves */
      memcpy(&f, &u, 4);
      if (!(f <= 65504.0f)) continue;
    } else {
      f = (float)(ldexp(urand() * 2 - 1, (int)(urand() * 45) - 29));
    }
    bad_h += rpl_cq_to_half(f) != rpl_float_to_half(f);
    bad_b += rpl_cq_to_bf16(f) != rpl_float_to_bf16(f);
  }
  CHECK(bad_h == 0, "float -> half differs from kernels.c for %d values", bad_h);
  CHECK(bad_b == 0, "float -> bf16 differs from kernels.c for %d values", bad_b);
}

static void test_sizes(void) {
  CHECK(rpl_cq_size(RPL_COMPRESS_BF16, 7) == 16, "bf16 pads to 4 bytes");
  CHECK(rpl_cq_size(RPL_COMPRESS_FP16, 8) == 16, "fp16 8 -> 16");
  CHECK(rpl_cq_size(RPL_COMPRESS_INT8, 128) == 4 + 128, "int8 one block");
  CHECK(rpl_cq_size(RPL_COMPRESS_INT8, 129) == 8 + 132, "int8 two blocks, padded");
  CHECK(rpl_cq_size(RPL_COMPRESS_INT8, 0) == 0 && rpl_cq_size(RPL_COMPRESS_NONE, 5) == 0, "empty");
  /* ratio on a model-sized buffer: 4 bytes per float against ~1.03 */
  double r = 4.0 * 1100000 / (double)rpl_cq_size(RPL_COMPRESS_INT8, 1100000);
  CHECK(r > 3.8 && r < 3.9, "int8 ratio %g", r);
}

static void test_float16_bounds(rpl_compress m, double rel) {
  size_t n = 1001; /* odd */
  float *x = malloc(sizeof(float) * n);
  unsigned char *enc = malloc(rpl_cq_size(m, n));
  for (size_t i = 0; i < n; i++) x[i] = (float)((urand() - 0.5) * 2000.0);
  x[0] = 0.0f;
  x[1] = -0.0f;
  x[2] = rpl_cq_limit(m);
  x[3] = -rpl_cq_limit(m);
  float *y = roundtrip(m, x, n, enc);
  int bad = 0;
  for (size_t i = 0; i < n; i++) bad += fabs((double)y[i] - x[i]) > rel * fabs(x[i]);
  CHECK(bad == 0, "%s: %d values beyond %g relative error", rpl_compress_name(m), bad, rel);
  CHECK(y[2] == rpl_cq_limit(m) && y[3] == -rpl_cq_limit(m), "%s limit is exact",
        rpl_compress_name(m));
  unsigned char *pad = enc + 2 * n;
  CHECK(pad[0] == 0 && pad[1] == 0, "%s pads with zeros", rpl_compress_name(m));
  free(y);
  /* Tiny values: fp16 subnormals keep an absolute error of 2^-25, bf16 keeps float's range. */
  for (size_t i = 0; i < n; i++) x[i] = (float)((urand() - 0.5) * 1e-6);
  y = roundtrip(m, x, n, enc);
  bad = 0;
  for (size_t i = 0; i < n; i++)
    bad += fabs((double)y[i] - x[i]) > rel * fabs(x[i]) + (m == RPL_COMPRESS_FP16 ? 0x1p-25 : 0);
  CHECK(bad == 0, "%s tiny values: %d beyond the bound", rpl_compress_name(m), bad);
  free(y);
  /* Beyond the format (a broken contract): saturates, never inf. */
  x[0] = 1e30f;
  x[1] = -FLT_MAX;
  rpl_cq_encode(m, x, 2, enc);
  float z[2];
  CHECK(rpl_cq_decode(m, enc, 2, FLT_MAX, z) == 0 && isfinite(z[0]) && isfinite(z[1]) &&
            z[0] > 0 && z[1] < 0,
        "%s saturates: %g %g", rpl_compress_name(m), z[0], z[1]);
  free(x);
  free(enc);
}

static void test_int8(void) {
  size_t n = 3 * RPL_CQ_BLOCK + 5;
  float *x = malloc(sizeof(float) * n);
  unsigned char *enc = malloc(rpl_cq_size(RPL_COMPRESS_INT8, n));
  for (size_t i = 0; i < n; i++) x[i] = (float)((urand() - 0.5) * 10.0);
  /* block 1 has one large value: its grid is coarse, the other blocks' are not */
  x[RPL_CQ_BLOCK + 3] = 1000.0f;
  for (size_t i = 2 * RPL_CQ_BLOCK; i < 3 * RPL_CQ_BLOCK; i++) x[i] = 0.0f; /* all zeros */
  x[3 * RPL_CQ_BLOCK + 1] = 1e-40f; /* denormal tail block */
  x[3 * RPL_CQ_BLOCK + 2] = -3e-39f;
  float *y = roundtrip(RPL_COMPRESS_INT8, x, n, enc);
  int bad = 0;
  for (size_t b = 0; b * RPL_CQ_BLOCK < n; b++) {
    size_t lo = b * RPL_CQ_BLOCK, hi = lo + RPL_CQ_BLOCK < n ? lo + RPL_CQ_BLOCK : n;
    double amax = 0;
    for (size_t i = lo; i < hi; i++) amax = fmax(amax, fabs(x[i]));
    for (size_t i = lo; i < hi; i++)
      bad += fabs((double)y[i] - x[i]) > amax / 254.0 * (1 + 0x1p-20) + 64 * 0x1p-149;
  }
  CHECK(bad == 0, "int8: %d values beyond absmax/254", bad);
  int zeros = 1;
  for (size_t i = 2 * RPL_CQ_BLOCK; i < 3 * RPL_CQ_BLOCK; i++) zeros &= y[i] == 0.0f;
  CHECK(zeros, "a block of zeros decodes to zeros");
  CHECK(fabs(y[5] - x[5]) <= 5.0 / 254 * 1.0001, "block 0 keeps its fine grid");
  /* Hostile encodings: NaN/inf/negative/oversized scales, -128. */
  float s;
  unsigned char bad_enc[4 + 4];
  memset(bad_enc, 0, sizeof bad_enc);
  float out[4];
  float scales[] = {NAN, INFINITY, -1.0f, 1e30f};
  for (int k = 0; k < 4; k++) {
    s = scales[k];
    memcpy(bad_enc, &s, 4);
    CHECK(rpl_cq_decode(RPL_COMPRESS_INT8, bad_enc, 4, 1e6f, out) == -1, "scale %g refused", s);
  }
  s = 1.0f;
  memcpy(bad_enc, &s, 4);
  bad_enc[4] = 0x80;
  CHECK(rpl_cq_decode(RPL_COMPRESS_INT8, bad_enc, 4, 1e6f, out) == -1, "-128 refused");
  bad_enc[4] = 127;
  CHECK(rpl_cq_decode(RPL_COMPRESS_INT8, bad_enc, 4, 1e6f, out) == 0 && out[0] == 127.0f,
        "a valid encoding decodes");
  free(x);
  free(y);
  free(enc);
}

static void test_hostile_16(void) {
  uint16_t h[2];
  float out[2];
  h[1] = 0;
  h[0] = 0x7fc0; /* bf16 NaN */
  CHECK(rpl_cq_decode(RPL_COMPRESS_BF16, h, 2, 1e30f, out) == -1, "bf16 NaN refused");
  h[0] = 0x7f80; /* bf16 inf */
  CHECK(rpl_cq_decode(RPL_COMPRESS_BF16, h, 2, 1e30f, out) == -1, "bf16 inf refused");
  h[0] = 0x7c00; /* fp16 inf */
  CHECK(rpl_cq_decode(RPL_COMPRESS_FP16, h, 2, 1e30f, out) == -1, "fp16 inf refused");
  h[0] = 0x7bff; /* 65504 > bound 40000 */
  CHECK(rpl_cq_decode(RPL_COMPRESS_FP16, h, 2, 40000.0f, out) == -1, "fp16 beyond bound");
  float x[3] = {1.0f, NAN, 2.0f};
  CHECK(!rpl_cq_in_range(x, 3, 10.0f), "NaN is out of range");
  x[1] = INFINITY;
  CHECK(!rpl_cq_in_range(x, 3, 10.0f), "inf is out of range");
  x[1] = 11.0f;
  CHECK(!rpl_cq_in_range(x, 3, 10.0f) && rpl_cq_in_range(x, 3, 11.0f), "range is inclusive");
}

/* Error feedback on one quantiser, no network: an increment smaller than half the grid step,
 * added before every "round", is lost by the naive quantiser and kept with the residual. */
static void test_error_feedback(void) {
  rpl_compress m = RPL_COMPRESS_BF16;
  float base = 1.0f, inc = 0x1p-10f; /* bf16's step at 1 is 2^-7: inc is 1/8 of it */
  float naive = base, ef = base, resid = 0.0f;
  double exact = base;
  unsigned char enc[4];
  for (int t = 0; t < 512; t++) {
    exact += inc;
    float v = naive + inc, q;
    rpl_cq_encode(m, &v, 1, enc);
    rpl_cq_decode(m, enc, 1, 1e30f, &q);
    naive = q;
    float y = ef + inc + resid;
    rpl_cq_encode(m, &y, 1, enc);
    rpl_cq_decode(m, enc, 1, 1e30f, &q);
    resid = y - q;
    ef = q; /* what the round hands back: the model is on the grid, the rest is carried */
  }
  CHECK(naive == base, "the naive quantiser loses every increment: %g", naive);
  CHECK(fabs(ef + resid - exact) < 1e-5 && fabs(ef - exact) <= 0x1p-8 * 2,
        "error feedback tracks the exact sum: %g + %g vs %g", ef, resid, exact);
}

/* ---- one compressed round over four ranks on two hosts ---- */

#define WN 4
#define WLEN 1000
static const int W_HOST_OF[WN] = {0, 0, 1, 1};
static rpl_compress g_mode;
static int g_mismatch; /* rank 3 sets another mode */

typedef struct wshared {
  float vals[WN][WLEN];
} wshared;

static int g_cross_rounds, g_mismatches; /* seen by the ranks, for the suite's checks */

static int group_of(int rank, uint64_t round, int *members) {
  rpl_layout *l;
  rpl_error err;
  rpl_layout_create(WN, W_HOST_OF, &l, &err);
  int n = 0;
  uint64_t gid;
  rpl_static_group(l, rank, round, members, WN, &n, &gid, &err);
  rpl_layout_destroy(l);
  return n;
}

static void body_round(job *j, rpl_comm *c) {
  wshared *sh = j->arg;
  int r = j->rank;
  rpl_compress mode = g_mismatch && r == WN - 1 ? RPL_COMPRESS_NONE : g_mode;
  rpl_partial_config pc = {.schedule = "static", .host_of = W_HOST_OF, .compression = mode,
                           .timeout_s = 30};
  rpl_error err;
  REQUIRE(rpl_comm_enable_partial(c, &pc, &err) == RPL_OK, "enable: %s", err.msg);
  float mine[WLEN];
  for (int i = 0; i < WLEN; i++) mine[i] = (float)(r * 10 + sin(i * 0.1) * (i % 7));
  for (uint64_t round = 0; round < 4; round++) {
    float before[WN][WLEN], kept[WLEN];
    rpl_op_desc bar = {.kind = RPL_OP_BARRIER};
    memcpy(sh->vals[r], mine, sizeof mine);
    REQUIRE(run_op(c, bar, &err) == RPL_OK, "barrier");
    memcpy(before, sh->vals, sizeof before);
    REQUIRE(run_op(c, bar, &err) == RPL_OK, "barrier");
    memcpy(kept, mine, sizeof mine);
    rpl_buf b = {mine, WLEN, RPL_FLOAT32};
    rpl_op_desc d = {.kind = RPL_OP_PARTIAL_ALLREDUCE, .redop = RPL_AVG, .in = &b, .nin = 1};
    rpl_partial_stats s0, s;
    rpl_comm_partial_stats(c, &s0);
    rpl_status st = run_op(c, d, &err);
    rpl_comm_partial_stats(c, &s);
    int members[WN], n = group_of(r, round, members), hosts = 0;
    for (int k = 0; k < n; k++) hosts |= 1 << W_HOST_OF[members[k]];
    int has_odd = 0;
    for (int k = 0; k < n; k++) has_odd |= members[k] == WN - 1;
    if (g_mismatch && n > 1 && has_odd) {
      CHECK(st == RPL_ERR_MISMATCH && strstr(err.msg, "compression") && strstr(err.msg, "none"),
            "rank %d: a mismatch of compression fails naming it: %d %s", r, (int)st, err.msg);
      CHECK(memcmp(mine, kept, sizeof mine) == 0, "a failed round leaves the buffer");
      __atomic_fetch_add(&g_mismatches, 1, __ATOMIC_RELAXED);
      continue;
    }
    CHECK(st == RPL_OK, "rank %d: %s", r, err.msg);
    if (n < 2) continue;
    double worst = 0;
    for (int i = 0; i < WLEN; i++) {
      double mean = 0;
      for (int k = 0; k < n; k++) mean += before[members[k]][i];
      worst = fmax(worst, fabs(mean / n - mine[i]));
    }
    int cross = hosts == 3;
    /* Stage 1 (|x| <= 36: absmax/254 for int8, 2^-8 relative for bf16, 2^-11 for fp16) plus
     * the much smaller stage 2 and the residual carried from earlier rounds (< one step). */
    double step = g_mode == RPL_COMPRESS_INT8 ? 36.0 / 254 : 36.0 * 0x1p-8;
    double bound = cross && g_mode != RPL_COMPRESS_NONE ? 3 * step : 1e-5;
    CHECK(worst <= bound, "rank %d %s round %d: within %g of the group mean (bound %g)", r,
          rpl_compress_name(g_mode), (int)round, worst, bound);
    CHECK(s.compressed - s0.compressed == (uint64_t)cross, "rank %d: compressed %llu, cross %d",
          r, (unsigned long long)(s.compressed - s0.compressed), cross);
    uint64_t wire = s.wire_bytes - s0.wire_bytes, payload = s.bytes - s0.bytes;
    if (cross) {
      __atomic_fetch_add(&g_cross_rounds, 1, __ATOMIC_RELAXED);
      /* 2 (n-1)/n of the payload over the ratio (>= 1.9 for bf16/fp16, ~3.9 for int8) */
      double want = 2.0 * (n - 1) / n * payload / (g_mode == RPL_COMPRESS_INT8 ? 3.5 : 1.9);
      CHECK(wire <= want + 200 * n, "rank %d: wire %llu for a payload of %llu", r,
            (unsigned long long)wire, (unsigned long long)payload);
    }
  }
}

int main(void) {
  test_conversions();
  test_sizes();
  test_float16_bounds(RPL_COMPRESS_BF16, 0x1p-8);
  test_float16_bounds(RPL_COMPRESS_FP16, 0x1p-11);
  test_int8();
  test_hostile_16();
  test_error_feedback();
  static wshared sh;
  g_layout = (world_layout){.hosts = 2};
  rpl_compress modes[] = {RPL_COMPRESS_BF16, RPL_COMPRESS_FP16, RPL_COMPRESS_INT8};
  for (int k = 0; k < 3; k++) {
    g_mode = modes[k];
    run_world(WN, 30, body_round, &sh);
  }
  CHECK(g_cross_rounds >= 3 * 2, "cross-host groups ran compressed: %d", g_cross_rounds);
  g_mismatch = 1;
  g_mode = RPL_COMPRESS_BF16;
  run_world(WN, 30, body_round, &sh);
  CHECK(g_mismatches >= 2, "mismatched settings were met: %d", g_mismatches);
  return report("compress");
}
