/* crypto.c - SHA-256, HMAC-SHA256 and random bytes (see crypto.h). */
#include "crypto.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>

#include "common.h"

rpl_status rpl_random_bytes(void *buf, size_t n, rpl_error *err) {
  unsigned char *p = buf;
  while (n > 0) {
    ssize_t r = getrandom(p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return rpl_fail_errno(err, RPL_ERR_SYSTEM, errno,
                            "cannot read random bytes from the kernel (getrandom)");
    }
    p += r;
    n -= (size_t)r;
  }
  return RPL_OK;
}

typedef struct {
  uint32_t h[8];
  uint64_t bytes;
  unsigned char block[64];
  size_t used;
  int sw; /* the portable compression only (rpl_sha256_sw) */
} sha256_ctx;

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

static uint32_t ror(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void compress(uint32_t h[8], const unsigned char *b) {
  uint32_t w[64];
  for (int i = 0; i < 16; i++)
    w[i] = (uint32_t)b[4 * i] << 24 | (uint32_t)b[4 * i + 1] << 16 |
           (uint32_t)b[4 * i + 2] << 8 | b[4 * i + 3];
  for (int i = 16; i < 64; i++) {
    uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
    uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h[0], bb = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
  for (int i = 0; i < 64; i++) {
    uint32_t t1 = hh + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
    uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & bb) ^ (a & c) ^ (bb & c));
    hh = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = bb;
    bb = a;
    a = t1 + t2;
  }
  h[0] += a;
  h[1] += bb;
  h[2] += c;
  h[3] += d;
  h[4] += e;
  h[5] += f;
  h[6] += g;
  h[7] += hh;
}

static void blocks_sw(uint32_t h[8], const unsigned char *p, size_t n) {
  for (; n > 0; n--, p += 64) compress(h, p);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>

/* The SHA extensions (SHA-NI): the same compression, 5-10x faster. The state is kept as the
 * instructions want it (ABEF, CDGH); each group of four rounds adds its four constants and
 * message words, and the schedule is extended four words at a time. */
__attribute__((target("sha,sse4.1,ssse3"))) static void blocks_ni(uint32_t h[8],
                                                                  const unsigned char *p,
                                                                  size_t n) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1); /* CDAB */
  __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B); /* EFGH */
  __m128i s0 = _mm_alignr_epi8(t, s1, 8);                                         /* ABEF */
  s1 = _mm_blend_epi16(s1, t, 0xF0);                                             /* CDGH */
  for (; n > 0; n--, p += 64) {
    __m128i save0 = s0, save1 = s1, w[4];
    for (int g = 0; g < 16; g++) {
      __m128i m;
      if (g < 4) {
        m = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * g)), bswap);
      } else {
        __m128i x = _mm_sha256msg1_epu32(w[g & 3], w[(g + 1) & 3]);
        x = _mm_add_epi32(x, _mm_alignr_epi8(w[(g + 3) & 3], w[(g + 2) & 3], 4));
        m = _mm_sha256msg2_epu32(x, w[(g + 3) & 3]);
      }
      w[g & 3] = m;
      __m128i k = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)&K[4 * g]));
      s1 = _mm_sha256rnds2_epu32(s1, s0, k);
      s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(k, 0x0E));
    }
    s0 = _mm_add_epi32(s0, save0);
    s1 = _mm_add_epi32(s1, save1);
  }
  t = _mm_shuffle_epi32(s0, 0x1B);   /* FEBA */
  s1 = _mm_shuffle_epi32(s1, 0xB1);  /* DCHG */
  _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(t, s1, 0xF0)); /* DCBA */
  _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(s1, t, 8));    /* HGFE */
}

/* 1 when this CPU has SHA-NI (and the SSE levels it needs): a fact about the machine, read
 * once (cpuid is slow) and kept in a relaxed atomic; any thread may compute it first. */
static int have_ni(void) {
  static int known = -1;
  int v = __atomic_load_n(&known, __ATOMIC_RELAXED);
  if (v < 0) {
    unsigned a, b, c, d;
    int ssse3_sse41 = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 9)) && (c & (1u << 19));
    v = ssse3_sse41 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 29));
    __atomic_store_n(&known, v, __ATOMIC_RELAXED);
  }
  return v;
}
#else
static int have_ni(void) { return 0; }
static void blocks_ni(uint32_t h[8], const unsigned char *p, size_t n) { blocks_sw(h, p, n); }
#endif

static void blocks(const sha256_ctx *s, uint32_t h[8], const unsigned char *p, size_t n) {
  if (!s->sw && have_ni()) blocks_ni(h, p, n);
  else blocks_sw(h, p, n);
}

int rpl_sha256_hw(void) { return have_ni(); }

static void sha_init(sha256_ctx *s) {
  static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(s->h, iv, sizeof iv);
  s->bytes = 0;
  s->used = 0;
  s->sw = 0;
}

static void sha_update(sha256_ctx *s, const void *data, size_t n) {
  const unsigned char *p = data;
  s->bytes += n;
  if (s->used > 0) { /* fill the pending block first */
    size_t k = 64 - s->used < n ? 64 - s->used : n;
    memcpy(s->block + s->used, p, k);
    s->used += k;
    p += k;
    n -= k;
    if (s->used < 64) return;
    blocks(s, s->h, s->block, 1);
    s->used = 0;
  }
  if (n >= 64) { /* whole blocks straight from the caller's memory */
    blocks(s, s->h, p, n / 64);
    p += n - n % 64;
    n %= 64;
  }
  memcpy(s->block, p, n);
  s->used = n;
}
static void sha_final(sha256_ctx *s, unsigned char out[RPL_SHA256_LEN]) {
  uint64_t bits = s->bytes * 8;
  unsigned char pad = 0x80, zero = 0, len[8];
  sha_update(s, &pad, 1);
  while (s->used != 56) sha_update(s, &zero, 1);
  for (int i = 0; i < 8; i++) len[i] = (unsigned char)(bits >> (56 - 8 * i));
  sha_update(s, len, 8);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (unsigned char)(s->h[i] >> 24);
    out[4 * i + 1] = (unsigned char)(s->h[i] >> 16);
    out[4 * i + 2] = (unsigned char)(s->h[i] >> 8);
    out[4 * i + 3] = (unsigned char)s->h[i];
  }
}

void rpl_sha256(const void *data, size_t n, unsigned char out[RPL_SHA256_LEN]) {
  sha256_ctx s;
  sha_init(&s);
  sha_update(&s, data, n);
  sha_final(&s, out);
}

void rpl_sha256_sw(const void *data, size_t n, unsigned char out[RPL_SHA256_LEN]) {
  sha256_ctx s;
  sha_init(&s);
  s.sw = 1;
  sha_update(&s, data, n);
  sha_final(&s, out);
}

void rpl_hmac_sha256(const void *key, size_t key_len, const void *const *parts,
                     const size_t *lens, int nparts, unsigned char out[RPL_SHA256_LEN]) {
  unsigned char k[64] = {0}, pad[64], inner[RPL_SHA256_LEN];
  if (key_len > 64) rpl_sha256(key, key_len, k); /* long keys are hashed first (RFC 2104) */
  else if (key_len) memcpy(k, key, key_len);
  sha256_ctx s;
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
  sha_init(&s);
  sha_update(&s, pad, 64);
  for (int i = 0; i < nparts; i++) sha_update(&s, parts[i], lens[i]);
  sha_final(&s, inner);
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
  sha_init(&s);
  sha_update(&s, pad, 64);
  sha_update(&s, inner, sizeof inner);
  sha_final(&s, out);
}

void rpl_hmac_init(rpl_hmac *m, const void *key, size_t key_len) {
  unsigned char k[64] = {0}, pad[64];
  if (key_len > 64) rpl_sha256(key, key_len, k);
  else if (key_len) memcpy(k, key, key_len);
  for (int i = 0; i < 64; i++) {
    pad[i] = k[i] ^ 0x36;
    m->opad[i] = k[i] ^ 0x5c;
  }
  sha256_ctx s;
  sha_init(&s);
  sha_update(&s, pad, 64);
  memcpy(m->h, s.h, sizeof s.h);
  m->bytes = s.bytes;
  m->used = s.used;
}

static void hmac_load(const rpl_hmac *m, sha256_ctx *s) {
  s->sw = 0;
  memcpy(s->h, m->h, sizeof s->h);
  s->bytes = m->bytes;
  s->used = m->used;
  memcpy(s->block, m->block, m->used);
}

static void hmac_store(rpl_hmac *m, const sha256_ctx *s) {
  memcpy(m->h, s->h, sizeof s->h);
  m->bytes = s->bytes;
  m->used = s->used;
  memcpy(m->block, s->block, s->used);
}

void rpl_hmac_update(rpl_hmac *m, const void *data, size_t n) {
  sha256_ctx s;
  hmac_load(m, &s);
  sha_update(&s, data, n);
  hmac_store(m, &s);
}

void rpl_hmac_final(rpl_hmac *m, unsigned char out[RPL_SHA256_LEN]) {
  sha256_ctx s;
  unsigned char inner[RPL_SHA256_LEN];
  hmac_load(m, &s);
  sha_final(&s, inner);
  sha_init(&s);
  sha_update(&s, m->opad, 64);
  sha_update(&s, inner, sizeof inner);
  sha_final(&s, out);
}

int rpl_ct_equal(const void *a, const void *b, size_t n) {
  const volatile unsigned char *x = a, *y = b;
  unsigned char d = 0;
  for (size_t i = 0; i < n; i++) d |= x[i] ^ y[i];
  return d == 0;
}
