/* crypto.c - kernel randomness, SHA-256, HMAC-SHA256, constant-time compare (see crypto.h).
 *
 * SHA-256 follows FIPS 180-4 section 6.2: 64-byte blocks, big-endian words, the message padded
 * with 0x80, zeros and its bit length as a 64-bit big-endian number. HMAC follows RFC 2104:
 * H((K ^ opad) || H((K ^ ipad) || text)), a key longer than the block hashed first. */
#include "crypto.h"

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>

#include "common.h"

rpl_status rpl_random_bytes(void *buf, size_t n, rpl_error *err) {
  unsigned char *p = buf;
  while (n > 0) {
    /* flags 0: the urandom pool, blocking only until it is first initialised. */
    ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return rpl_fail_errno(err, RPL_ERR_SYSTEM, errno,
                            "cannot read random bytes from the kernel (getrandom)");
    }
    p += got;
    n -= (size_t)got;
  }
  return RPL_OK;
}

/* ---- SHA-256 --------------------------------------------------------------------------- */

typedef struct sha256_ctx {
  uint32_t h[8];
  unsigned char block[64];
  size_t used;    /* bytes in block */
  uint64_t total; /* bytes hashed so far */
} sha256_ctx;

/* FIPS 180-4 4.2.2: the first 32 bits of the fractional parts of the cube roots of the first
 * 64 primes. */
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

static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

static void sha256_init(sha256_ctx *c) {
  /* FIPS 180-4 5.3.3: fractional parts of the square roots of the first 8 primes. */
  static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  memcpy(c->h, H0, sizeof H0);
  c->used = 0;
  c->total = 0;
}

static void sha256_block(sha256_ctx *c, const unsigned char *b) {
  uint32_t w[64];
  for (int t = 0; t < 16; t++)
    w[t] = (uint32_t)b[4 * t] << 24 | (uint32_t)b[4 * t + 1] << 16 |
           (uint32_t)b[4 * t + 2] << 8 | (uint32_t)b[4 * t + 3];
  for (int t = 16; t < 64; t++) {
    uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = c->h[0], bb = c->h[1], cc = c->h[2], d = c->h[3];
  uint32_t e = c->h[4], f = c->h[5], g = c->h[6], h = c->h[7];
  for (int t = 0; t < 64; t++) {
    uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
    uint32_t ch = (e & f) ^ (~e & g);
    uint32_t t1 = h + S1 + ch + K[t] + w[t];
    uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
    uint32_t maj = (a & bb) ^ (a & cc) ^ (bb & cc);
    uint32_t t2 = S0 + maj;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = cc;
    cc = bb;
    bb = a;
    a = t1 + t2;
  }
  c->h[0] += a;
  c->h[1] += bb;
  c->h[2] += cc;
  c->h[3] += d;
  c->h[4] += e;
  c->h[5] += f;
  c->h[6] += g;
  c->h[7] += h;
}

static void sha256_update(sha256_ctx *c, const void *data, size_t n) {
  const unsigned char *p = data;
  c->total += n;
  if (c->used) {
    size_t k = RPL_MIN(n, sizeof c->block - c->used);
    memcpy(c->block + c->used, p, k);
    c->used += k;
    p += k;
    n -= k;
    if (c->used < sizeof c->block) return;
    sha256_block(c, c->block);
    c->used = 0;
  }
  for (; n >= 64; p += 64, n -= 64) sha256_block(c, p);
  memcpy(c->block, p, n);
  c->used = n;
}

static void sha256_final(sha256_ctx *c, unsigned char out[RPL_SHA256_LEN]) {
  uint64_t bits = c->total * 8;
  c->block[c->used++] = 0x80;
  if (c->used > 56) {
    memset(c->block + c->used, 0, 64 - c->used);
    sha256_block(c, c->block);
    c->used = 0;
  }
  memset(c->block + c->used, 0, 56 - c->used);
  for (int i = 0; i < 8; i++) c->block[56 + i] = (unsigned char)(bits >> (56 - 8 * i));
  sha256_block(c, c->block);
  for (int i = 0; i < 8; i++) {
    out[4 * i] = (unsigned char)(c->h[i] >> 24);
    out[4 * i + 1] = (unsigned char)(c->h[i] >> 16);
    out[4 * i + 2] = (unsigned char)(c->h[i] >> 8);
    out[4 * i + 3] = (unsigned char)c->h[i];
  }
  rpl_wipe(c, sizeof *c);
}

void rpl_sha256(const void *data, size_t n, unsigned char out[RPL_SHA256_LEN]) {
  sha256_ctx c;
  sha256_init(&c);
  sha256_update(&c, data, n);
  sha256_final(&c, out);
}

/* ---- HMAC-SHA256 ----------------------------------------------------------------------- */

void rpl_hmac_sha256(const void *key, size_t key_len, const void *const *parts,
                     const size_t *lens, int nparts, unsigned char out[RPL_SHA256_LEN]) {
  unsigned char k[64], pad[64], inner[RPL_SHA256_LEN];
  memset(k, 0, sizeof k);
  if (key_len > sizeof k) rpl_sha256(key, key_len, k);
  else if (key_len) memcpy(k, key, key_len);
  sha256_ctx c;
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
  sha256_init(&c);
  sha256_update(&c, pad, sizeof pad);
  for (int i = 0; i < nparts; i++)
    if (lens[i]) sha256_update(&c, parts[i], lens[i]);
  sha256_final(&c, inner);
  for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
  sha256_init(&c);
  sha256_update(&c, pad, sizeof pad);
  sha256_update(&c, inner, sizeof inner);
  sha256_final(&c, out);
  rpl_wipe(k, sizeof k);
  rpl_wipe(pad, sizeof pad);
  rpl_wipe(inner, sizeof inner);
}

int rpl_ct_equal(const void *a, const void *b, size_t n) {
  const volatile unsigned char *x = a, *y = b;
  unsigned char diff = 0;
  for (size_t i = 0; i < n; i++) diff |= (unsigned char)(x[i] ^ y[i]);
  return diff == 0;
}

void rpl_wipe(void *p, size_t n) {
  volatile unsigned char *v = p;
  while (n--) *v++ = 0;
}
