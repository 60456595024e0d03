/*
 * test_kernels.c - unit test of csrc/kernels.c (reductions, scaling, float16/bfloat16).
 *
 * Every result is compared with a reference written here independently and as plainly as
 * possible (scalar loops, ldexp-based conversions, a nearest-value search for rounding), so
 * a wrong kernel cannot agree with it by sharing code. Prints one line per failed check and
 * a summary; exits non-zero if anything failed.
 */
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kernels.h"
#include "ripples.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { /* xorshift64*: deterministic, so failures reproduce */
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return g_rng * 0x2545f4914f6cdd1dull;
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  return p;
}

static uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float bitsf(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint64_t dbits(double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  return u;
}

/* ---- Reference conversions ------------------------------------------------------------------- */

/* Value of a 16-bit float pattern (a sign bit, `ebits` exponent bits, the rest mantissa: 5 for
 * half, 8 for bfloat16), computed from the IEEE definition. NaN for NaN patterns. */
static double ref_value16(uint16_t p, int ebits) {
  int mbits = 15 - ebits, bias = (1 << (ebits - 1)) - 1, emax = (1 << ebits) - 1;
  int sign = p >> 15, e = (p >> mbits) & emax, m = p & ((1 << mbits) - 1);
  double v;
  if (e == emax)
    v = m ? NAN : INFINITY;
  else if (e == 0)
    v = ldexp((double)m, 1 - bias - mbits);
  else
    v = ldexp((double)((1 << mbits) + m), e - bias - mbits);
  return sign ? -v : v;
}
static double ref_half_value(uint16_t h) { return ref_value16(h, 5); }
static double ref_bf16_value(uint16_t b) { return ref_value16(b, 8); }

static int is_half_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff); }
static int is_bf16_nan(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x7f); }
/* Equal bits, or both NaN. */
static int elem_eq_16(rpl_dtype d, uint16_t a, uint16_t b) {
  if (d == RPL_FLOAT16 ? is_half_nan(a) : is_bf16_nan(a))
    return d == RPL_FLOAT16 ? is_half_nan(b) : is_bf16_nan(b);
  return a == b;
}

/* Round |x| to the nearest of the ascending magnitudes value(0..top), where value(top) is the
 * first value past the largest finite one (it stands for infinity: IEEE rounds as if the
 * exponent were unbounded), ties to the even pattern. Found by binary search: no bit tricks. */
static uint16_t ref_round(double x, double (*value)(uint16_t), uint16_t top) {
  if (x >= value(top)) return top;
  uint16_t lo = 0, hi = top; /* value(lo) <= x < value(hi) */
  while (hi - lo > 1) {
    uint16_t mid = (uint16_t)((lo + hi) / 2);
    if (value(mid) <= x)
      lo = mid;
    else
      hi = mid;
  }
  double dl = x - value(lo), dh = value(hi) - x;
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}
/* The pattern past the largest finite value, valued as the next binade would start. */
static double half_mag(uint16_t h) { return h == 0x7c00 ? 65536.0 : ref_half_value(h); }
static double bf16_mag(uint16_t b) { return b == 0x7f80 ? ldexp(1.0, 128) : ref_bf16_value(b); }

/* Reference float->half; NaN maps to 0x7e00 here and callers compare NaN-ness only. */
static uint16_t ref_f2h(float f) {
  if (isnan(f)) return 0x7e00;
  uint16_t s = signbit(f) ? 0x8000 : 0;
  return (uint16_t)(s | ref_round(fabs((double)f), half_mag, 0x7c00));
}
static uint16_t ref_f2b(float f) {
  if (isnan(f)) return 0x7fc0;
  uint16_t s = signbit(f) ? 0x8000 : 0;
  return (uint16_t)(s | ref_round(fabs((double)f), bf16_mag, 0x7f80));
}
static float ref_h2f(uint16_t h) { return (float)ref_half_value(h); }
static float ref_b2f(uint16_t b) { return (float)ref_bf16_value(b); }

/* A million random float bit patterns (all exponents, NaNs, subnormals) through `conv`: a NaN
 * stays a NaN with its sign, anything else gives the reference's pattern. */
static void check_random_floats(const char *name, uint16_t (*conv)(float), uint16_t (*ref)(float),
                                int (*is_nan)(uint16_t)) {
  long bad = 0;
  for (int i = 0; i < 1000000; i++) {
    float f = bitsf((uint32_t)rnd());
    uint16_t got = conv(f);
    int ok = isnan(f) ? is_nan(got) && ((got >> 15) == (fbits(f) >> 31)) : got == ref(f);
    if (!ok && bad++ < 5)
      CHECK(0, "%s(%a [0x%08x]) = 0x%04x, want 0x%04x", name, f, fbits(f), got, ref(f));
  }
  CHECK(bad == 0, "%s wrong for %ld random floats", name, bad);
}

/* ---- Conversion tests ------------------------------------------------------------------------ */

/* Every 16-bit pattern through to_f and back: the reference's value and an exact round trip;
 * a NaN stays NaN as the float nan_bits(p) (quieted, sign and payload kept) and comes back as
 * p | quiet. `name` ("half", "bf16") starts the messages. */
static void check_all_patterns(const char *name, float (*to_f)(uint16_t), uint16_t (*from_f)(float),
                               float (*ref)(uint16_t), int (*is_nan)(uint16_t),
                               uint32_t (*nan_bits)(uint32_t), uint32_t quiet) {
  long bad_value = 0, bad_trip = 0, bad_nan = 0;
  for (uint32_t p = 0; p < 65536; p++) {
    float f = to_f((uint16_t)p);
    uint16_t back = from_f(f);
    if (is_nan((uint16_t)p)) {
      if (!isnan(f) || fbits(f) != nan_bits(p)) bad_nan++;
      if (!is_nan(back) || back != (p | quiet)) bad_nan++;
      continue;
    }
    if (fbits(f) != fbits(ref((uint16_t)p)) && bad_value++ < 5)
      CHECK(0, "%s_to_float(0x%04x) = %a, want %a", name, p, f, ref((uint16_t)p));
    if (back != p && bad_trip++ < 5)
      CHECK(0, "%s 0x%04x -> float -> %s gives 0x%04x", name, p, name, back);
  }
  CHECK(bad_value == 0, "%s_to_float wrong for %ld of 65536 patterns", name, bad_value);
  CHECK(bad_trip == 0, "%s round trip wrong for %ld patterns", name, bad_trip);
  CHECK(bad_nan == 0, "%s NaN handling wrong for %ld checks", name, bad_nan);
}

/* A half NaN widens with its sign and payload (shifted into the float's top bits), quieted as
 * the F16C instruction does; a bfloat16 is the float's top half. */
static uint32_t half_nan_bits(uint32_t h) {
  return ((h & 0x8000u) << 16) | 0x7fc00000u | ((h & 0x3ffu) << 13);
}
static uint32_t bf16_nan_bits(uint32_t b) { return b << 16; }

static void test_half_conversions(void) {
  check_all_patterns("half", rpl_half_to_float, rpl_float_to_half, ref_h2f, is_half_nan,
                     half_nan_bits, 0x200u);

  /* Known values. */
  static const struct {
    float f;
    uint16_t h;
  } known[] = {
      {0.0f, 0x0000},         {-0.0f, 0x8000},         {1.0f, 0x3c00},
      {-2.0f, 0xc000},        {0.5f, 0x3800},          {65504.0f, 0x7bff},
      {65519.99f, 0x7bff},    {65520.0f, 0x7c00},      {1e6f, 0x7c00},
      {-1e6f, 0xfc00},        {INFINITY, 0x7c00},      {-INFINITY, 0xfc00},
      {0x1p-14f, 0x0400},     {0x1p-24f, 0x0001},      {0x1p-25f, 0x0000},
      {0x1.000002p-25f, 0x0001}, {0x3p-25f, 0x0002},   {0x5p-25f, 0x0002},
      {1e-8f, 0x0000},        {0.1f, 0x2e66},          {0x1.002p0f, 0x3c00},
      {0x1.006p0f, 0x3c02},   {0x1.004p0f, 0x3c01},    {0x1.00201p0f, 0x3c01},
      {0x1.ffcp-15f, 0x0400}, {3.14159265f, 0x4248},   {-0x1p-24f, 0x8001},
  };
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
    uint16_t got = rpl_float_to_half(known[i].f);
    CHECK(got == known[i].h, "float_to_half(%a) = 0x%04x, want 0x%04x", known[i].f, got,
          known[i].h);
  }
  CHECK(isnan(rpl_half_to_float(rpl_float_to_half(NAN))), "float_to_half(NaN) is not NaN");
  CHECK(is_half_nan(rpl_float_to_half(-NAN)) && (rpl_float_to_half(-NAN) & 0x8000),
        "float_to_half(-NaN) lost NaN-ness or sign");
  CHECK(is_half_nan(rpl_float_to_half(bitsf(0x7f800001u))),
        "float_to_half(signalling NaN with payload only in low bits) is not NaN");

  /* Every rounding boundary: for each pair of adjacent halves, the exact midpoint (a tie, which
   * must go to the even pattern) and the floats just either side of it; plus each value +-1
   * float ulp. Both signs. */
  long bad = 0;
  for (uint16_t h = 0; h < 0x7c00; h++) {
    double lo = half_mag(h), hi = half_mag((uint16_t)(h + 1));
    float mid = (float)((lo + hi) / 2); /* exact: needs one more bit than half has */
    float probes[] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY), (float)lo,
                      nextafterf((float)lo, 0.0f), nextafterf((float)lo, INFINITY)};
    for (size_t k = 0; k < sizeof probes / sizeof probes[0]; k++) {
      for (int s = 0; s < 2; s++) {
        float p = s ? -probes[k] : probes[k];
        uint16_t got = rpl_float_to_half(p), want = ref_f2h(p);
        if (got != want && bad++ < 5)
          CHECK(0, "float_to_half(%a) = 0x%04x, want 0x%04x", p, got, want);
      }
    }
  }
  CHECK(bad == 0, "float_to_half wrong at %ld rounding boundaries", bad);

  check_random_floats("float_to_half", rpl_float_to_half, ref_f2h, is_half_nan);
}

static void test_bf16_conversions(void) {
  static const struct {
    uint32_t f;
    uint16_t b;
  } known[] = {
      {0x3f800000u, 0x3f80}, /* 1.0 */
      {0x3f808000u, 0x3f80}, /* 1 + 2^-8: tie, to even */
      {0x3f818000u, 0x3f82}, /* 1 + 3*2^-8: tie, to even (up) */
      {0x3f808001u, 0x3f81}, /* just above the tie */
      {0x40490fdbu, 0x4049}, /* pi */
      {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds to inf */
      {0x7f7f7fffu, 0x7f7f}, /* largest that stays finite */
      {0x7f7f8000u, 0x7f80}, /* tie at the top: the even neighbour is inf */
      {0xff7fffffu, 0xff80}, /* -FLT_MAX */
      {0x7f800000u, 0x7f80}, /* inf */
      {0x00010000u, 0x0001}, /* float subnormal, exact in bf16 */
      {0x00008000u, 0x0000}, /* subnormal tie, to even (down) */
      {0x00018000u, 0x0002}, /* subnormal tie, to even (up) */
      {0x80000000u, 0x8000}, /* -0 */
  };
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
    uint16_t got = rpl_float_to_bf16(bitsf(known[i].f));
    CHECK(got == known[i].b, "float_to_bf16(0x%08x) = 0x%04x, want 0x%04x", known[i].f, got,
          known[i].b);
  }
  CHECK(is_bf16_nan(rpl_float_to_bf16(NAN)), "float_to_bf16(NaN) is not NaN");
  CHECK(is_bf16_nan(rpl_float_to_bf16(bitsf(0x7f800001u))),
        "float_to_bf16(NaN with payload only in dropped bits) is not NaN");
  CHECK(is_bf16_nan(rpl_float_to_bf16(bitsf(0xffffffffu))), "float_to_bf16(0xffffffff) not NaN");

  check_all_patterns("bf16", rpl_bf16_to_float, rpl_float_to_bf16, ref_b2f, is_bf16_nan,
                     bf16_nan_bits, 0x40u);

  check_random_floats("float_to_bf16", rpl_float_to_bf16, ref_f2b, is_bf16_nan);
}

/* The kernels convert whole blocks (with F16C instructions where the CPU has them); those must
 * give exactly the bits of the scalar functions tested above, NaN payloads included. A
 * one-source rpl_reduce_many is exactly narrow(widen(x)); a two-source SUM narrows arbitrary
 * float sums. */
static void test_block_conversions(void) {
  for (int bf = 0; bf < 2; bf++) {
    rpl_dtype d = bf ? RPL_BFLOAT16 : RPL_FLOAT16;
    float (*to_f)(uint16_t) = bf ? rpl_bf16_to_float : rpl_half_to_float;
    uint16_t (*from_f)(float) = bf ? rpl_float_to_bf16 : rpl_float_to_half;
    enum { N = 65536 };
    uint16_t *x = xmalloc(N * 2), *y = xmalloc(N * 2), *out = xmalloc(N * 2);
    for (uint32_t i = 0; i < N; i++) x[i] = (uint16_t)i;
    const void *one[1] = {x};
    rpl_reduce_many(out, one, 1, N, d, RPL_SUM);
    long bad = 0;
    for (uint32_t i = 0; i < N; i++) {
      uint16_t want = from_f(to_f((uint16_t)i));
      if (out[i] != want && bad++ < 3)
        CHECK(0, "%s block convert 0x%04x -> 0x%04x, scalar gives 0x%04x", rpl_dtype_name(d), i,
              out[i], want);
    }
    CHECK(bad == 0, "%s block round trip differs from scalar for %ld patterns", rpl_dtype_name(d),
          bad);
    for (int rep = 0; rep < 16; rep++) {
      for (uint32_t i = 0; i < N; i++) {
        x[i] = (uint16_t)rnd();
        y[i] = (uint16_t)rnd();
      }
      const void *two[2] = {x, y};
      rpl_reduce_many(out, two, 2, N, d, RPL_SUM);
      bad = 0;
      for (uint32_t i = 0; i < N; i++) {
        uint16_t want = from_f(to_f(x[i]) + to_f(y[i]));
        if (!elem_eq_16(d, out[i], want) && bad++ < 3)
          CHECK(0, "%s block 0x%04x + 0x%04x = 0x%04x, scalar gives 0x%04x", rpl_dtype_name(d),
                x[i], y[i], out[i], want);
      }
      CHECK(bad == 0, "%s block sums differ from scalar for %ld pairs", rpl_dtype_name(d), bad);
    }
    free(x);
    free(y);
    free(out);
  }
}

/* ---- Reference reductions -------------------------------------------------------------------- */

static const rpl_dtype k_dtypes[] = {RPL_BOOL,  RPL_UINT8,   RPL_INT8,     RPL_INT16,   RPL_INT32,
                                     RPL_INT64, RPL_FLOAT16, RPL_BFLOAT16, RPL_FLOAT32, RPL_FLOAT64};
static const rpl_redop k_ops[] = {RPL_SUM, RPL_AVG,  RPL_PRODUCT, RPL_MIN,
                                  RPL_MAX, RPL_BAND, RPL_BOR,     RPL_BXOR};
#define NDT (sizeof k_dtypes / sizeof k_dtypes[0])
#define NOPS (sizeof k_ops / sizeof k_ops[0])

static int is_float_dt(rpl_dtype d) {
  return d == RPL_FLOAT16 || d == RPL_BFLOAT16 || d == RPL_FLOAT32 || d == RPL_FLOAT64;
}
static int is_bitwise(rpl_redop op) { return op == RPL_BAND || op == RPL_BOR || op == RPL_BXOR; }
static int supported(rpl_dtype d, rpl_redop op) {
  if (op == RPL_AVG) return is_float_dt(d);
  if (is_bitwise(op)) return !is_float_dt(d);
  return 1;
}
static size_t esize(rpl_dtype d) {
  switch (d) {
    case RPL_BOOL: case RPL_UINT8: case RPL_INT8: return 1;
    case RPL_INT16: case RPL_FLOAT16: case RPL_BFLOAT16: return 2;
    case RPL_INT32: case RPL_FLOAT32: return 4;
    default: return 8;
  }
}

/* Integer element as a signed 64-bit value (uint8 zero-extended). */
static int64_t load_int(rpl_dtype d, const void *p) {
  switch (d) {
    case RPL_UINT8: { uint8_t v; memcpy(&v, p, 1); return v; }
    case RPL_INT8: { int8_t v; memcpy(&v, p, 1); return v; }
    case RPL_INT16: { int16_t v; memcpy(&v, p, 2); return v; }
    case RPL_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
    default: { int64_t v; memcpy(&v, p, 8); return v; }
  }
}
/* Store the low bits (two's complement wraparound, written via unsigned types). */
static void store_int(rpl_dtype d, void *p, uint64_t v) {
  switch (esize(d)) {
    case 1: { uint8_t u = (uint8_t)v; memcpy(p, &u, 1); break; }
    case 2: { uint16_t u = (uint16_t)v; memcpy(p, &u, 2); break; }
    case 4: { uint32_t u = (uint32_t)v; memcpy(p, &u, 4); break; }
    default: memcpy(p, &v, 8);
  }
}

/* Float combine, NaN-propagating MIN/MAX; equal operands keep the left one. */
static double ref_fop(rpl_redop op, double a, double b, int is_single) {
  double r;
  switch (op) {
    case RPL_SUM: case RPL_AVG: r = is_single ? (double)((float)a + (float)b) : a + b; break;
    case RPL_PRODUCT: r = is_single ? (double)((float)a * (float)b) : a * b; break;
    case RPL_MIN: r = isnan(a) ? a : isnan(b) ? b : (b < a ? b : a); break;
    default: r = isnan(a) ? a : isnan(b) ? b : (b > a ? b : a); break;
  }
  return r;
}

/* A float element's value (half types through the reference conversions, exact in double),
 * and a value stored as dtype d (rounded to float first for all but float64). */
static double load_float(rpl_dtype d, const void *p) {
  uint16_t h;
  float f;
  double v;
  switch (d) {
    case RPL_FLOAT16: memcpy(&h, p, 2); return ref_h2f(h);
    case RPL_BFLOAT16: memcpy(&h, p, 2); return ref_b2f(h);
    case RPL_FLOAT32: memcpy(&f, p, 4); return f;
    default: memcpy(&v, p, 8); return v;
  }
}
static void store_float(rpl_dtype d, void *p, double v) {
  uint16_t h;
  float f;
  switch (d) {
    case RPL_FLOAT16: h = ref_f2h((float)v); memcpy(p, &h, 2); break;
    case RPL_BFLOAT16: h = ref_f2b((float)v); memcpy(p, &h, 2); break;
    case RPL_FLOAT32: f = (float)v; memcpy(p, &f, 4); break;
    default: memcpy(p, &v, 8);
  }
}

/* out = a op b for one element of dtype d (half types: through float, rounded). */
static void ref_elem(rpl_dtype d, rpl_redop op, const void *a, const void *b, void *out) {
  switch (d) {
    case RPL_BOOL: {
      int x = *(const uint8_t *)a != 0, y = *(const uint8_t *)b != 0, r;
      if (op == RPL_SUM || op == RPL_MAX || op == RPL_BOR) r = x || y;
      else if (op == RPL_BXOR) r = x != y;
      else r = x && y;
      *(uint8_t *)out = (uint8_t)r;
      return;
    }
    case RPL_FLOAT16: case RPL_BFLOAT16: case RPL_FLOAT32: case RPL_FLOAT64:
      store_float(d, out, ref_fop(op, load_float(d, a), load_float(d, b), d != RPL_FLOAT64));
      return;
    default: {
      int64_t x = load_int(d, a), y = load_int(d, b);
      uint64_t r;
      switch (op) {
        case RPL_SUM: r = (uint64_t)x + (uint64_t)y; break;
        case RPL_PRODUCT: r = (uint64_t)x * (uint64_t)y; break;
        case RPL_MIN: r = (uint64_t)(x < y ? x : y); break;
        case RPL_MAX: r = (uint64_t)(x > y ? x : y); break;
        case RPL_BAND: r = (uint64_t)x & (uint64_t)y; break;
        case RPL_BOR: r = (uint64_t)x | (uint64_t)y; break;
        default: r = (uint64_t)x ^ (uint64_t)y; break;
      }
      store_int(d, out, r);
    }
  }
}

/* Element equality: bitwise, except that any NaN equals any NaN (payloads are not specified). */
static int elem_eq(rpl_dtype d, const void *x, const void *y) {
  switch (d) {
    case RPL_FLOAT16: case RPL_BFLOAT16: {
      uint16_t a, b;
      memcpy(&a, x, 2);
      memcpy(&b, y, 2);
      if (d == RPL_FLOAT16 ? is_half_nan(a) : is_bf16_nan(a))
        return d == RPL_FLOAT16 ? is_half_nan(b) : is_bf16_nan(b);
      return a == b;
    }
    case RPL_FLOAT32: {
      float a, b;
      memcpy(&a, x, 4);
      memcpy(&b, y, 4);
      return isnan(a) ? isnan(b) : fbits(a) == fbits(b);
    }
    case RPL_FLOAT64: {
      double a, b;
      memcpy(&a, x, 8);
      memcpy(&b, y, 8);
      return isnan(a) ? isnan(b) : dbits(a) == dbits(b);
    }
    default: return memcmp(x, y, esize(d)) == 0;
  }
}

static void fmt_elem(rpl_dtype d, const void *p, char *buf, size_t cap) {
  switch (d) {
    case RPL_FLOAT16: { uint16_t v; memcpy(&v, p, 2); snprintf(buf, cap, "0x%04x(%g)", v, ref_half_value(v)); break; }
    case RPL_BFLOAT16: { uint16_t v; memcpy(&v, p, 2); snprintf(buf, cap, "0x%04x(%g)", v, ref_bf16_value(v)); break; }
    case RPL_FLOAT32: { float v; memcpy(&v, p, 4); snprintf(buf, cap, "%a", v); break; }
    case RPL_FLOAT64: { double v; memcpy(&v, p, 8); snprintf(buf, cap, "%a", v); break; }
    case RPL_BOOL: snprintf(buf, cap, "%u", *(const uint8_t *)p); break;
    default: snprintf(buf, cap, "%" PRId64, load_int(d, p));
  }
}

/* Random element: integers get random bits (exercising wraparound); bool mostly 0/1 with a few
 * other nonzero bytes; floats mostly moderate values (so that sums and products are
 * non-trivial) mixed with random bit patterns (NaN, inf, subnormals, huge values) and zeros. */
static void rand_elem(rpl_dtype d, void *p) {
  uint64_t r = rnd();
  int kind = (int)(r % 16);
  r = rnd();
  switch (d) {
    case RPL_BOOL: *(uint8_t *)p = (uint8_t)(kind == 0 ? (r | 2) : (r & 1)); return;
    case RPL_FLOAT16: case RPL_BFLOAT16: case RPL_FLOAT32: case RPL_FLOAT64: {
      double v = ldexp((double)(int64_t)(r >> 11) - ldexp(1.0, 52), -50 - (int)(rnd() % 8));
      if (kind == 0) v = 0.0;
      if (kind == 1) v = -0.0;
      if (d == RPL_FLOAT16) {
        uint16_t h = kind == 2 ? (uint16_t)r : ref_f2h((float)v);
        memcpy(p, &h, 2);
      } else if (d == RPL_BFLOAT16) {
        uint16_t b = kind == 2 ? (uint16_t)r : ref_f2b((float)v);
        memcpy(p, &b, 2);
      } else if (d == RPL_FLOAT32) {
        float f = kind == 2 ? bitsf((uint32_t)r) : (float)v;
        memcpy(p, &f, 4);
      } else {
        if (kind == 2) memcpy(&v, &r, 8);
        memcpy(p, &v, 8);
      }
      return;
    }
    default:
      /* Small values often, so that MIN/MAX/products see equal and nearby operands too. */
      store_int(d, p, kind < 4 ? (uint64_t)(int64_t)((int)(r % 7) - 3) : r);
  }
}

/* ---- rpl_reduce_into ------------------------------------------------------------------------- */

static const size_t k_sizes[] = {0, 1, 7, 255, 256, 257, 1000, 1023, 1024, 1025, 2049, 4099};
#define NSIZES (sizeof k_sizes / sizeof k_sizes[0])
#define GUARD 16 /* elements after dst's end that must stay untouched */

/* Runs one_case(d, op) for every dtype and every op it supports. */
static void each_supported(void (*one_case)(rpl_dtype, rpl_redop)) {
  for (size_t di = 0; di < NDT; di++)
    for (size_t oi = 0; oi < NOPS; oi++)
      if (supported(k_dtypes[di], k_ops[oi])) one_case(k_dtypes[di], k_ops[oi]);
}

static void reduce_into_case(rpl_dtype d, rpl_redop op) {
  size_t es = esize(d);
  for (size_t si = 0; si < NSIZES; si++) {
    for (int shift = 0; shift < 2; shift++) { /* shift: misalign by one element */
      size_t n = k_sizes[si];
      char *dstm = xmalloc((n + GUARD + 1) * es), *srcm = xmalloc((n + 1) * es);
      char *want = xmalloc((n + GUARD) * es);
      char *dst = dstm + shift * es, *src = srcm + shift * es;
      for (size_t i = 0; i < n + GUARD; i++) rand_elem(d, dst + i * es);
      for (size_t i = 0; i < n; i++) rand_elem(d, src + i * es);
      memcpy(want, dst, (n + GUARD) * es);
      for (size_t i = 0; i < n; i++)
        ref_elem(d, op, dst + i * es, src + i * es, want + i * es);
      rpl_reduce_into(dst, src, n, d, op);
      size_t bad = n + GUARD, nbad = 0;
      for (size_t i = 0; i < n + GUARD; i++)
        if (i < n ? !elem_eq(d, dst + i * es, want + i * es)
                  : memcmp(dst + i * es, want + i * es, es) != 0) {
          if (bad == n + GUARD) bad = i;
          nbad++;
        }
      char g[64] = "", w[64] = "";
      if (nbad) {
        fmt_elem(d, dst + bad * es, g, sizeof g);
        fmt_elem(d, want + bad * es, w, sizeof w);
      }
      CHECK(nbad == 0, "reduce_into %s %s n=%zu shift=%d: %zu wrong, first [%zu] got %s want %s%s",
            rpl_dtype_name(d), rpl_redop_name(op), n, shift, nbad, bad, g, w,
            bad >= n && nbad ? " (past the end!)" : "");
      free(dstm);
      free(srcm);
      free(want);
    }
  }
  /* dst == src: x op x. */
  size_t n = 1500;
  char *x = xmalloc(n * es), *want = xmalloc(n * es);
  for (size_t i = 0; i < n; i++) rand_elem(d, x + i * es);
  for (size_t i = 0; i < n; i++) ref_elem(d, op, x + i * es, x + i * es, want + i * es);
  rpl_reduce_into(x, x, n, d, op);
  size_t nbad = 0;
  for (size_t i = 0; i < n; i++) nbad += !elem_eq(d, x + i * es, want + i * es);
  CHECK(nbad == 0, "reduce_into %s %s with dst == src: %zu wrong", rpl_dtype_name(d),
        rpl_redop_name(op), nbad);
  free(x);
  free(want);
}
static void test_reduce_into(void) { each_supported(reduce_into_case); }

/* ---- rpl_reduce_many ------------------------------------------------------------------------- */

/* Left to right; half types accumulate in float and round once. */
static void ref_many(rpl_dtype d, rpl_redop op, char *const *srcs, int nsrc, size_t n, char *out) {
  size_t es = esize(d);
  for (size_t i = 0; i < n; i++) {
    if (d == RPL_FLOAT16 || d == RPL_BFLOAT16) {
      uint16_t v;
      memcpy(&v, srcs[0] + i * 2, 2);
      float acc = d == RPL_FLOAT16 ? ref_h2f(v) : ref_b2f(v);
      for (int j = 1; j < nsrc; j++) {
        memcpy(&v, srcs[j] + i * 2, 2);
        acc = (float)ref_fop(op, acc, d == RPL_FLOAT16 ? ref_h2f(v) : ref_b2f(v), 1);
      }
      v = d == RPL_FLOAT16 ? ref_f2h(acc) : ref_f2b(acc);
      memcpy(out + i * 2, &v, 2);
    } else {
      char acc[8], tmp[8];
      memcpy(acc, srcs[0] + i * es, es);
      for (int j = 1; j < nsrc; j++) {
        ref_elem(d, op, acc, srcs[j] + i * es, tmp);
        memcpy(acc, tmp, es);
      }
      memcpy(out + i * es, acc, es);
    }
  }
}

static void reduce_many_case(rpl_dtype d, rpl_redop op) {
  static const int nsrcs[] = {1, 2, 3, 5};
  static const size_t sizes[] = {0, 1, 7, 256, 257, 1025, 4099};
  size_t es = esize(d);
  for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
    size_t n = sizes[si];
    for (size_t ki = 0; ki < sizeof nsrcs / sizeof nsrcs[0]; ki++) {
      int nsrc = nsrcs[ki];
      /* alias: -1 = separate dst, else dst is srcs[alias]. */
      for (int alias = -1; alias < nsrc; alias++) {
        char *srcs[5], *orig[5];
        for (int j = 0; j < nsrc; j++) {
          srcs[j] = xmalloc(n * es);
          orig[j] = xmalloc(n * es);
          for (size_t i = 0; i < n; i++) rand_elem(d, srcs[j] + i * es);
          memcpy(orig[j], srcs[j], n * es);
        }
        char *sep = xmalloc((n + GUARD) * es), *want = xmalloc(n * es);
        for (size_t i = 0; i < n + GUARD; i++) rand_elem(d, sep + i * es);
        char *guard = xmalloc(GUARD * es);
        memcpy(guard, sep + n * es, GUARD * es);
        char *dst = alias < 0 ? sep : srcs[alias];
        ref_many(d, op, orig, nsrc, n, want);
        rpl_reduce_many(dst, (const void *const *)srcs, nsrc, n, d, op);
        size_t nbad = 0, first = 0;
        for (size_t i = 0; i < n; i++)
          if (!elem_eq(d, dst + i * es, want + i * es) && nbad++ == 0) first = i;
        char g[64] = "", w[64] = "";
        if (nbad) {
          fmt_elem(d, dst + first * es, g, sizeof g);
          fmt_elem(d, want + first * es, w, sizeof w);
        }
        CHECK(nbad == 0, "reduce_many %s %s n=%zu nsrc=%d dst=%s%d: %zu wrong, first [%zu] got %s want %s",
              rpl_dtype_name(d), rpl_redop_name(op), n, nsrc, alias < 0 ? "separate" : "srcs",
              alias, nbad, first, g, w);
        int untouched = 1;
        for (int j = 0; j < nsrc; j++)
          if (j != alias && memcmp(srcs[j], orig[j], n * es) != 0) untouched = 0;
        CHECK(untouched, "reduce_many %s %s n=%zu nsrc=%d alias=%d modified a source",
              rpl_dtype_name(d), rpl_redop_name(op), n, nsrc, alias);
        if (alias < 0)
          CHECK(memcmp(sep + n * es, guard, GUARD * es) == 0,
                "reduce_many %s %s n=%zu wrote past the end of dst", rpl_dtype_name(d),
                rpl_redop_name(op), n);
        for (int j = 0; j < nsrc; j++) {
          free(srcs[j]);
          free(orig[j]);
        }
        free(sep);
        free(want);
        free(guard);
      }
    }
  }
}
static void test_reduce_many(void) { each_supported(reduce_many_case); }

/* Order and float32 accumulation, with values chosen so that other choices give other bits. */
static void test_reduce_many_semantics(void) {
  /* float32: (1e8 + 1) - 1e8 == 0 (1 is lost), while 1e8 - 1e8 + 1 == 1. */
  float a[3] = {1e8f, 1e8f, 1e8f}, b[3] = {1.0f, -1e8f, 1.0f}, c[3] = {-1e8f, 1.0f, -1e8f};
  float out[3];
  const void *s1[3] = {a, b, c};
  rpl_reduce_many(out, s1, 3, 3, RPL_FLOAT32, RPL_SUM);
  CHECK(out[0] == 0.0f && out[1] == 1.0f && out[2] == 0.0f,
        "reduce_many float32 not left to right: got %g %g %g, want 0 1 0", out[0], out[1], out[2]);
  float c2[3] = {-1e8f, 1.0f, -1e8f};
  const void *s2[3] = {a, b, c2};
  rpl_reduce_many(c2, s2, 3, 3, RPL_FLOAT32, RPL_SUM); /* dst is the last source */
  CHECK(c2[0] == 0.0f && c2[1] == 1.0f && c2[2] == 0.0f,
        "reduce_many float32 (dst == last src) not left to right: got %g %g %g", c2[0], c2[1],
        c2[2]);

  /* 4096 copies of 1.0 in float16/bfloat16: a running sum in the narrow type stalls (at 2048
   * and 256), a float32 accumulator reaches 4096, which both represent exactly. */
  enum { K = 4096, N = 300 };
  static const void *srcs[K];
  uint16_t one_h[N], one_b[N], out_h[N], out_b[N];
  for (int i = 0; i < N; i++) {
    one_h[i] = 0x3c00;
    one_b[i] = 0x3f80;
  }
  for (int j = 0; j < K; j++) srcs[j] = one_h;
  rpl_reduce_many(out_h, srcs, K, N, RPL_FLOAT16, RPL_SUM);
  int ok = 1;
  for (int i = 0; i < N; i++) ok &= out_h[i] == 0x6c00;
  CHECK(ok, "reduce_many float16: 4096 x 1.0 = 0x%04x, want 0x6c00 (4096)", out_h[0]);
  for (int j = 0; j < K; j++) srcs[j] = one_b;
  rpl_reduce_many(out_b, srcs, K, N, RPL_BFLOAT16, RPL_AVG);
  ok = 1;
  for (int i = 0; i < N; i++) ok &= out_b[i] == 0x4580;
  CHECK(ok, "reduce_many bfloat16: 4096 x 1.0 = 0x%04x, want 0x4580 (4096)", out_b[0]);
  /* The same through pairwise rpl_reduce_into stalls: shows the check above can fail. */
  uint16_t run[N];
  memcpy(run, one_h, sizeof run);
  for (int j = 1; j < K; j++) rpl_reduce_into(run, one_h, N, RPL_FLOAT16, RPL_SUM);
  CHECK(run[0] == 0x6800, "pairwise float16 running sum of 4096 x 1.0 = 0x%04x, want 0x6800",
        run[0]);

  /* One rounding: 1 + 2^-11 + 2^-11 is 1 + 2^-10 in float32 (exact in half), but rounding
   * after each step (ties to even) leaves 1.0. */
  uint16_t x = 0x3c00, y = 0x1000, z = 0x1000, r; /* 1.0, 2^-11, 2^-11 */
  const void *s3[3] = {&x, &y, &z};
  rpl_reduce_many(&r, s3, 3, 1, RPL_FLOAT16, RPL_SUM);
  CHECK(r == 0x3c01, "reduce_many float16 1 + 2^-11 + 2^-11 = 0x%04x, want 0x3c01", r);
  rpl_reduce_many(&x, s3, 3, 1, RPL_FLOAT16, RPL_SUM); /* dst == srcs[0] */
  CHECK(x == 0x3c01, "reduce_many float16 in place (dst == srcs[0]) = 0x%04x, want 0x3c01", x);

  /* Integer: order-independent but check nsrc = 1 copies and the block boundary. */
  int32_t i1[2] = {5, -7}, io[2] = {0, 0};
  const void *s4[1] = {i1};
  rpl_reduce_many(io, s4, 1, 2, RPL_INT32, RPL_PRODUCT);
  CHECK(io[0] == 5 && io[1] == -7, "reduce_many nsrc=1 did not copy: %d %d", io[0], io[1]);
}

/* ---- rpl_scale / rpl_divide ------------------------------------------------------------------ */

static void test_scale_divide(void) {
  enum { N = 5000 };
  static const double divisors[] = {1, 2, 3, 5, 6, 7, 10, 12, 24, 100, 1000, 3.5};
  static const double factors[] = {0.5, 1.0 / 3.0, 0.1, 8.0, 1e-3, 0.7};
  float *f = xmalloc(N * sizeof *f), *f0 = xmalloc(N * sizeof *f);
  double *g = xmalloc(N * sizeof *g), *g0 = xmalloc(N * sizeof *g);
  for (int i = 0; i < N; i++) {
    rand_elem(RPL_FLOAT32, &f0[i]);
    rand_elem(RPL_FLOAT64, &g0[i]);
  }
  long recip_differs_f = 0, recip_differs_d = 0;
  for (size_t k = 0; k < sizeof divisors / sizeof divisors[0]; k++) {
    double dv = divisors[k];
    memcpy(f, f0, N * sizeof *f);
    rpl_divide(f, N, RPL_FLOAT32, dv);
    long bad = 0;
    for (int i = 0; i < N; i++) {
      float want = f0[i] / (float)dv;
      if (!(isnan(want) ? isnan(f[i]) : fbits(f[i]) == fbits(want))) bad++;
      if (fbits(f0[i] * (1.0f / (float)dv)) != fbits(want) && !isnan(want)) recip_differs_f++;
    }
    CHECK(bad == 0, "divide float32 by %g: %ld elements differ from x / (float)d", dv, bad);

    memcpy(g, g0, N * sizeof *g);
    rpl_divide(g, N, RPL_FLOAT64, dv);
    bad = 0;
    for (int i = 0; i < N; i++) {
      double want = g0[i] / dv;
      if (!(isnan(want) ? isnan(g[i]) : dbits(g[i]) == dbits(want))) bad++;
      if (dbits(g0[i] * (1.0 / dv)) != dbits(want) && !isnan(want)) recip_differs_d++;
    }
    CHECK(bad == 0, "divide float64 by %g: %ld elements differ from x / d", dv, bad);

  }
  /* The data must be able to tell division from multiplication by the reciprocal. */
  CHECK(recip_differs_f > 0 && recip_differs_d > 0,
        "test data cannot distinguish x/d from x*(1/d) (%ld, %ld cases)", recip_differs_f,
        recip_differs_d);

  for (size_t k = 0; k < sizeof factors / sizeof factors[0]; k++) {
    double fa = factors[k];
    memcpy(f, f0, N * sizeof *f);
    memcpy(g, g0, N * sizeof *g);
    rpl_scale(f, N, RPL_FLOAT32, fa);
    rpl_scale(g, N, RPL_FLOAT64, fa);
    long bf = 0, bd = 0;
    for (int i = 0; i < N; i++) {
      float wf = f0[i] * (float)fa;
      double wd = g0[i] * fa;
      bf += !elem_eq(RPL_FLOAT32, &f[i], &wf);
      bd += !elem_eq(RPL_FLOAT64, &g[i], &wd);
    }
    CHECK(bf == 0 && bd == 0, "scale by %g: float32 %ld, float64 %ld elements wrong", fa, bf, bd);
  }

  /* Integers and bool: no-ops. */
  int32_t iv[5] = {1, -2, 3, 7, 100}, ic[5];
  memcpy(ic, iv, sizeof iv);
  rpl_divide(iv, 5, RPL_INT32, 2.0);
  rpl_scale(iv, 5, RPL_INT32, 0.5);
  CHECK(memcmp(iv, ic, sizeof iv) == 0, "divide/scale changed an int32 buffer");
  uint8_t bv[3] = {0, 1, 1};
  rpl_divide(bv, 3, RPL_BOOL, 2.0);
  CHECK(bv[0] == 0 && bv[1] == 1 && bv[2] == 1, "divide changed a bool buffer");
  rpl_divide(NULL, 0, RPL_FLOAT32, 2.0); /* n == 0 with NULL must be fine */
  free(f);
  free(f0);
  free(g);
  free(g0);
}

/* float16/bfloat16 scale and divide over every bit pattern: computed in float32 (torch's opmath
 * for these types, with the scalar cast to float) and rounded once. */
static void test_scale_divide_half(void) {
  static const double vals[] = {2, 3, 7, 12, 1000, 0.1, 1.0 / 3.0, 0.7, 1e-3};
  uint16_t *h = xmalloc(65536 * 2);
  long differs_from_double = 0;
  for (int bf = 0; bf < 2; bf++) {
    rpl_dtype d = bf ? RPL_BFLOAT16 : RPL_FLOAT16;
    for (size_t k = 0; k < sizeof vals / sizeof vals[0]; k++) {
      for (int divide = 0; divide < 2; divide++) {
        double v = vals[k];
        for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
        if (divide)
          rpl_divide(h, 65536, d, v);
        else
          rpl_scale(h, 65536, d, v);
        long bad = 0;
        for (uint32_t i = 0; i < 65536; i++) {
          float x = bf ? ref_b2f((uint16_t)i) : ref_h2f((uint16_t)i);
          float y = divide ? x / (float)v : x * (float)v;
          double yd = divide ? x / v : x * v;
          uint16_t want = bf ? ref_f2b(y) : ref_f2h(y);
          uint16_t alt = bf ? ref_f2b((float)yd) : ref_f2h((float)yd);
          if (!elem_eq(d, &h[i], &want) && bad++ < 3) {
            CHECK(0, "%s %s 0x%04x by %g = 0x%04x, want 0x%04x", divide ? "divide" : "scale",
                  rpl_dtype_name(d), i, v, h[i], want);
          }
          if (!elem_eq(d, &want, &alt)) differs_from_double++;
        }
        CHECK(bad == 0, "%s %s by %g: %ld patterns wrong", divide ? "divide" : "scale",
              rpl_dtype_name(d), v, bad);
      }
    }
  }
  /* The data must tell float32 arithmetic from double arithmetic. */
  CHECK(differs_from_double > 0, "no pattern distinguishes float32 from double scaling");
  free(h);
}

/* ---- Bool and integer specifics -------------------------------------------------------------- */

static void test_bool(void) {
  /* Truth tables over all pairs, plus nonzero bytes other than 1 which must count as true and
   * come out as 1. */
  static const uint8_t xa[] = {0, 0, 1, 1, 2, 255, 0, 7};
  static const uint8_t xb[] = {0, 1, 0, 1, 0, 0, 128, 3};
  struct {
    rpl_redop op;
    uint8_t want[8];
  } tab[] = {
      {RPL_SUM, {0, 1, 1, 1, 1, 1, 1, 1}},  {RPL_MAX, {0, 1, 1, 1, 1, 1, 1, 1}},
      {RPL_BOR, {0, 1, 1, 1, 1, 1, 1, 1}},  {RPL_PRODUCT, {0, 0, 0, 1, 0, 0, 0, 1}},
      {RPL_MIN, {0, 0, 0, 1, 0, 0, 0, 1}},  {RPL_BAND, {0, 0, 0, 1, 0, 0, 0, 1}},
      {RPL_BXOR, {0, 1, 1, 0, 1, 1, 1, 0}},
  };
  for (size_t t = 0; t < sizeof tab / sizeof tab[0]; t++) {
    uint8_t a[8];
    memcpy(a, xa, 8);
    rpl_reduce_into(a, xb, 8, RPL_BOOL, tab[t].op);
    CHECK(memcmp(a, tab[t].want, 8) == 0,
          "bool %s: got %u%u%u%u%u%u%u%u want %u%u%u%u%u%u%u%u", rpl_redop_name(tab[t].op), a[0],
          a[1], a[2], a[3], a[4], a[5], a[6], a[7], tab[t].want[0], tab[t].want[1],
          tab[t].want[2], tab[t].want[3], tab[t].want[4], tab[t].want[5], tab[t].want[6],
          tab[t].want[7]);
  }
  /* Many sources: a SUM of three trues is still 1 (not 3); XOR of three trues is 1. */
  uint8_t t1[1] = {1}, out[1];
  const void *s[3] = {t1, t1, t1};
  rpl_reduce_many(out, s, 3, 1, RPL_BOOL, RPL_SUM);
  CHECK(out[0] == 1, "bool reduce_many SUM of 3 trues = %u, want 1", out[0]);
  rpl_reduce_many(out, s, 3, 1, RPL_BOOL, RPL_BXOR);
  CHECK(out[0] == 1, "bool reduce_many BXOR of 3 trues = %u, want 1", out[0]);
}

static void test_int_wrap(void) {
  { int8_t a[3] = {127, -128, -128}, b[3] = {1, -1, 2};
    rpl_reduce_into(a, b, 3, RPL_INT8, RPL_SUM);
    CHECK(a[0] == -128 && a[1] == 127 && a[2] == -126, "int8 SUM wrap: %d %d %d", a[0], a[1], a[2]); }
  { int8_t a[2] = {-128, 16}, b[2] = {-1, 16};
    rpl_reduce_into(a, b, 2, RPL_INT8, RPL_PRODUCT);
    CHECK(a[0] == -128 && a[1] == 0, "int8 PRODUCT wrap: %d %d", a[0], a[1]); }
  { uint8_t a[2] = {255, 16}, b[2] = {1, 17};
    uint8_t c[2] = {255, 16};
    rpl_reduce_into(a, b, 2, RPL_UINT8, RPL_SUM);
    rpl_reduce_into(c, b, 2, RPL_UINT8, RPL_PRODUCT);
    CHECK(a[0] == 0 && a[1] == 33 && c[0] == 255 && c[1] == 16,
          "uint8 wrap: %u %u %u %u", a[0], a[1], c[0], c[1]); }
  { int16_t a[3] = {32767, 256, -32768}, b[3] = {1, 256, -1};
    int16_t c[3] = {32767, 256, -32768};
    rpl_reduce_into(a, b, 3, RPL_INT16, RPL_SUM);
    rpl_reduce_into(c, b, 3, RPL_INT16, RPL_PRODUCT);
    CHECK(a[0] == -32768 && a[1] == 512 && a[2] == 32767, "int16 SUM wrap: %d %d %d", a[0], a[1], a[2]);
    CHECK(c[0] == 32767 && c[1] == 0 && c[2] == -32768, "int16 PRODUCT wrap: %d %d %d", c[0], c[1], c[2]); }
  { int16_t a[1] = {-1}, b[1] = {-1}; /* 0xffff * 0xffff overflows a promoted int: must not trap */
    rpl_reduce_into(a, b, 1, RPL_INT16, RPL_PRODUCT);
    CHECK(a[0] == 1, "int16 -1 * -1 = %d", a[0]); }
  { int32_t a[3] = {INT32_MAX, 65536, INT32_MIN}, b[3] = {1, 65536, -1};
    int32_t c[3] = {INT32_MAX, 65536, INT32_MIN};
    rpl_reduce_into(a, b, 3, RPL_INT32, RPL_SUM);
    rpl_reduce_into(c, b, 3, RPL_INT32, RPL_PRODUCT);
    CHECK(a[0] == INT32_MIN && a[1] == 131072 && a[2] == INT32_MAX, "int32 SUM wrap: %d %d %d", a[0], a[1], a[2]);
    CHECK(c[0] == INT32_MAX && c[1] == 0 && c[2] == INT32_MIN, "int32 PRODUCT wrap: %d %d %d", c[0], c[1], c[2]); }
  { int64_t a[2] = {INT64_MAX, INT64_MIN}, b[2] = {1, -1};
    int64_t c[2] = {(int64_t)1 << 32, INT64_MIN}, e[2] = {(int64_t)1 << 32, -1};
    rpl_reduce_into(a, b, 2, RPL_INT64, RPL_SUM);
    rpl_reduce_into(c, e, 2, RPL_INT64, RPL_PRODUCT);
    CHECK(a[0] == INT64_MIN && a[1] == INT64_MAX, "int64 SUM wrap: %" PRId64 " %" PRId64, a[0], a[1]);
    CHECK(c[0] == 0 && c[1] == INT64_MIN, "int64 PRODUCT wrap: %" PRId64 " %" PRId64, c[0], c[1]); }
  { /* 3^40 mod 2^64 via repeated reduce_many PRODUCT of 40 threes. */
    int64_t three = 3, out = 0;
    const void *s[40];
    for (int i = 0; i < 40; i++) s[i] = &three;
    rpl_reduce_many(&out, s, 40, 1, RPL_INT64, RPL_PRODUCT);
    uint64_t want = 1;
    for (int i = 0; i < 40; i++) want *= 3u;
    CHECK((uint64_t)out == want, "int64 3^40 wrap: %" PRId64, out); }
  { /* signed MIN/MAX compare as signed, uint8 as unsigned */
    int8_t a[1] = {-1}, b[1] = {1};
    rpl_reduce_into(a, b, 1, RPL_INT8, RPL_MIN);
    uint8_t c[1] = {255}, e[1] = {1};
    rpl_reduce_into(c, e, 1, RPL_UINT8, RPL_MAX);
    CHECK(a[0] == -1 && c[0] == 255, "int8 MIN / uint8 MAX signedness: %d %u", a[0], c[0]); }
}

static void test_float_minmax_nan(void) {
  float a[4] = {NAN, 1.0f, NAN, 2.0f}, b[4] = {1.0f, NAN, NAN, -INFINITY};
  float mn[4], mx[4];
  memcpy(mn, a, sizeof a);
  memcpy(mx, a, sizeof a);
  rpl_reduce_into(mn, b, 4, RPL_FLOAT32, RPL_MIN);
  rpl_reduce_into(mx, b, 4, RPL_FLOAT32, RPL_MAX);
  CHECK(isnan(mn[0]) && isnan(mn[1]) && isnan(mn[2]) && mn[3] == -INFINITY,
        "float32 MIN NaN propagation: %g %g %g %g", mn[0], mn[1], mn[2], mn[3]);
  CHECK(isnan(mx[0]) && isnan(mx[1]) && isnan(mx[2]) && mx[3] == 2.0f,
        "float32 MAX NaN propagation: %g %g %g %g", mx[0], mx[1], mx[2], mx[3]);
  uint16_t h[2] = {0x7e00, 0x3c00}, k[2] = {0x3c00, 0x7e00};
  rpl_reduce_into(h, k, 2, RPL_FLOAT16, RPL_MAX);
  CHECK(is_half_nan(h[0]) && is_half_nan(h[1]), "float16 MAX NaN propagation: 0x%04x 0x%04x",
        h[0], h[1]);
  double d[2] = {NAN, 0.0}, e[2] = {5.0, NAN};
  rpl_reduce_into(d, e, 2, RPL_FLOAT64, RPL_MIN);
  CHECK(isnan(d[0]) && isnan(d[1]), "float64 MIN NaN propagation: %g %g", d[0], d[1]);
}

/* ---- Checks, names, sizes -------------------------------------------------------------------- */

static void test_check_and_names(void) {
  static const char *const names[] = {"bool",    "uint8",    "int8",    "int16",  "int32",
                                      "int64",   "float16",  "bfloat16", "float32", "float64"};
  static const size_t sizes[] = {1, 1, 1, 2, 4, 8, 2, 2, 4, 8};
  static const char *const opnames[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
  for (int d = 0; d < RPL_DTYPE_COUNT; d++) {
    CHECK(strcmp(rpl_dtype_name((rpl_dtype)d), names[d]) == 0, "dtype_name(%d) = %s", d,
          rpl_dtype_name((rpl_dtype)d));
    CHECK(rpl_dtype_size((rpl_dtype)d) == sizes[d], "dtype_size(%s) = %zu", names[d],
          rpl_dtype_size((rpl_dtype)d));
    CHECK(!rpl_dtype_is_floating((rpl_dtype)d) == !(d >= RPL_FLOAT16),
          "dtype_is_floating(%s) wrong", names[d]);
  }
  for (int o = 0; o < RPL_REDOP_COUNT; o++)
    CHECK(strcmp(rpl_redop_name((rpl_redop)o), opnames[o]) == 0, "redop_name(%d) = %s", o,
          rpl_redop_name((rpl_redop)o));
  CHECK(rpl_dtype_size((rpl_dtype)RPL_DTYPE_COUNT) == 0 && rpl_dtype_size((rpl_dtype)-1) == 0,
        "dtype_size of unknown dtypes is not 0");
  CHECK(strcmp(rpl_dtype_name((rpl_dtype)99), "?") == 0, "dtype_name(99) is not \"?\"");
  CHECK(strcmp(rpl_redop_name((rpl_redop)99), "?") == 0, "redop_name(99) is not \"?\"");
  CHECK(!rpl_dtype_is_floating((rpl_dtype)99), "dtype_is_floating(99) is true");

  for (size_t di = 0; di < NDT; di++) {
    for (size_t oi = 0; oi < NOPS; oi++) {
      rpl_dtype d = k_dtypes[di];
      rpl_redop op = k_ops[oi];
      rpl_error err;
      memset(&err, 0, sizeof err);
      rpl_status st = rpl_reduce_check(d, op, &err);
      rpl_status st_null = rpl_reduce_check(d, op, NULL);
      CHECK(st == st_null, "reduce_check(%s, %s) depends on err being NULL", rpl_dtype_name(d),
            rpl_redop_name(op));
      if (supported(d, op)) {
        CHECK(st == RPL_OK, "reduce_check(%s, %s) = %d, want RPL_OK", rpl_dtype_name(d),
              rpl_redop_name(op), (int)st);
        continue;
      }
      char opname[32];
      snprintf(opname, sizeof opname, "ReduceOp.%s", rpl_redop_name(op));
      CHECK(st == RPL_ERR_UNSUPPORTED && err.code == RPL_ERR_UNSUPPORTED,
            "reduce_check(%s, %s) = %d (err.code %d), want RPL_ERR_UNSUPPORTED",
            rpl_dtype_name(d), rpl_redop_name(op), (int)st, (int)err.code);
      CHECK(strstr(err.msg, opname) && strstr(err.msg, rpl_dtype_name(d)),
            "reduce_check(%s, %s) message does not name op and dtype: \"%s\"", rpl_dtype_name(d),
            rpl_redop_name(op), err.msg);
      /* An unsupported combination must not touch the buffer. */
      uint8_t buf[16], src[16], orig[16];
      for (int i = 0; i < 16; i++) buf[i] = orig[i] = (uint8_t)(i * 37 + 1), src[i] = (uint8_t)(200 - i);
      size_t n = 16 / esize(d);
      rpl_reduce_into(buf, src, n, d, op);
      const void *ss[2] = {src, src};
      rpl_reduce_many(buf, ss, 2, n, d, op);
      CHECK(memcmp(buf, orig, 16) == 0, "unsupported %s %s modified dst", rpl_dtype_name(d),
            rpl_redop_name(op));
    }
  }
  rpl_error err;
  CHECK(rpl_reduce_check(RPL_FLOAT32, RPL_BAND, &err) == RPL_ERR_UNSUPPORTED &&
            strcmp(err.msg, "ReduceOp.BAND is not defined for float32 tensors (bitwise ops need "
                            "an integer or bool dtype)") == 0,
        "BAND/float32 message: \"%s\"", err.msg);
  CHECK(rpl_reduce_check(RPL_INT32, RPL_AVG, &err) == RPL_ERR_UNSUPPORTED &&
            strcmp(err.msg, "ReduceOp.AVG needs a floating-point tensor; got int32") == 0,
        "AVG/int32 message: \"%s\"", err.msg);
  CHECK(rpl_reduce_check(RPL_BOOL, RPL_AVG, &err) == RPL_ERR_UNSUPPORTED,
        "AVG on bool accepted");
  err.msg[0] = 0;
  CHECK(rpl_reduce_check((rpl_dtype)RPL_DTYPE_COUNT, RPL_SUM, &err) == RPL_ERR_UNSUPPORTED &&
            err.msg[0] != 0,
        "unknown dtype accepted or no message");
  err.msg[0] = 0;
  CHECK(rpl_reduce_check(RPL_FLOAT32, (rpl_redop)RPL_REDOP_COUNT, &err) == RPL_ERR_UNSUPPORTED &&
            err.msg[0] != 0,
        "unknown op accepted or no message");
  CHECK(rpl_reduce_check((rpl_dtype)-3, (rpl_redop)-1, NULL) == RPL_ERR_UNSUPPORTED,
        "negative enums accepted");
}

int main(void) {
  test_check_and_names();
  test_half_conversions();
  test_bf16_conversions();
  test_block_conversions();
  test_bool();
  test_int_wrap();
  test_float_minmax_nan();
  test_reduce_into();
  test_reduce_many();
  test_reduce_many_semantics();
  test_scale_divide();
  test_scale_divide_half();
  return report("kernels");
}
