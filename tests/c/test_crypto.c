/*
 * test_crypto.c - csrc/crypto.c against published known answers: SHA-256 from FIPS 180-4's
 * examples (and the million-'a' message), HMAC-SHA256 from RFC 4231 (test cases 1-4, 6, 7),
 * the same HMAC fed in several parts and byte by byte, the constant-time comparison, and
 * kernel randomness (fills the buffer; two draws differ).
 */
#include <stdlib.h>
#include <string.h>

#include "crypto.h"
#include "harness.h"

static void hex(const unsigned char *b, size_t n, char *out) {
  for (size_t i = 0; i < n; i++) sprintf(out + 2 * i, "%02x", b[i]);
}

static void check_sha(const void *msg, size_t n, const char *want, const char *what) {
  unsigned char d[RPL_SHA256_LEN];
  char got[2 * RPL_SHA256_LEN + 1];
  rpl_sha256(msg, n, d);
  hex(d, sizeof d, got);
  CHECK(strcmp(got, want) == 0, "SHA-256(%s) = %s, want %s", what, got, want);
}

static void check_hmac(const void *key, size_t klen, const void *msg, size_t n, const char *want,
                       const char *what) {
  unsigned char d[RPL_SHA256_LEN];
  char got[2 * RPL_SHA256_LEN + 1];
  const void *parts[1] = {msg};
  size_t lens[1] = {n};
  rpl_hmac_sha256(key, klen, parts, lens, 1, d);
  hex(d, sizeof d, got);
  CHECK(strcmp(got, want) == 0, "HMAC(%s) = %s, want %s", what, got, want);
  /* The same message in three parts (one empty), then byte by byte: the same MAC. */
  size_t a = n / 3;
  const void *p3[3] = {msg, (const char *)msg + a, (const char *)msg + a};
  size_t l3[3] = {a, 0, n - a};
  unsigned char d3[RPL_SHA256_LEN];
  rpl_hmac_sha256(key, klen, p3, l3, 3, d3);
  CHECK(memcmp(d, d3, sizeof d) == 0, "HMAC(%s) in three parts differs", what);
  const void **pb = malloc(sizeof *pb * (n ? n : 1));
  size_t *lb = malloc(sizeof *lb * (n ? n : 1));
  for (size_t i = 0; i < n; i++) {
    pb[i] = (const char *)msg + i;
    lb[i] = 1;
  }
  rpl_hmac_sha256(key, klen, pb, lb, (int)n, d3);
  CHECK(memcmp(d, d3, sizeof d) == 0, "HMAC(%s) byte by byte differs", what);
  free(pb);
  free(lb);
  /* Incremental (rpl_hmac_*): in pieces of every size from 1 to 70 bytes, the same MAC, and
   * a context is reusable after final. */
  for (size_t step = 1; step <= 70; step++) {
    rpl_hmac h;
    rpl_hmac_init(&h, key, klen);
    for (size_t i = 0; i < n; i += step)
      rpl_hmac_update(&h, (const char *)msg + i, n - i < step ? n - i : step);
    rpl_hmac_final(&h, d3);
    CHECK(memcmp(d, d3, sizeof d) == 0, "incremental HMAC(%s) in %zu-byte pieces", what, step);
  }
}

int main(void) {
  /* The hardware path (SHA-NI, where the CPU has it) agrees with the portable code on every
   * length around block boundaries and on a few MiB of random bytes. */
  {
    size_t big = 3 << 20;
    unsigned char *buf = malloc(big), d1[RPL_SHA256_LEN], d2[RPL_SHA256_LEN];
    rpl_error e;
    REQUIRE(rpl_random_bytes(buf, big, &e) == RPL_OK, "%s", e.msg);
    for (size_t n = 0; n <= 300; n++) {
      rpl_sha256(buf, n, d1);
      rpl_sha256_sw(buf, n, d2);
      CHECK(memcmp(d1, d2, sizeof d1) == 0, "SHA-256 of %zu bytes: hardware != portable", n);
    }
    rpl_sha256(buf + 1, big - 1, d1); /* unaligned */
    rpl_sha256_sw(buf + 1, big - 1, d2);
    CHECK(memcmp(d1, d2, sizeof d1) == 0, "SHA-256 of %zu bytes: hardware != portable", big);
    printf("  SHA-256 %s\n", rpl_sha256_hw() ? "with SHA-NI (checked against the portable code)"
                                              : "portable (no SHA-NI on this CPU)");
    free(buf);
  }
  /* FIPS 180-4 / NIST CSRC examples. */
  check_sha("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "\"\"");
  check_sha("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            "\"abc\"");
  const char *m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  check_sha(m448, strlen(m448),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1", "448-bit");
  char *million = malloc(1000000);
  memset(million, 'a', 1000000);
  check_sha(million, 1000000,
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0", "10^6 'a'");
  free(million);

  /* RFC 4231 section 4. */
  unsigned char k[131], data[50];
  memset(k, 0x0b, 20);
  check_hmac(k, 20, "Hi There", 8,
             "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7", "case 1");
  const char *m2 = "what do ya want for nothing?";
  check_hmac("Jefe", 4, m2, strlen(m2),
             "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843", "case 2");
  memset(k, 0xaa, 20);
  memset(data, 0xdd, 50);
  check_hmac(k, 20, data, 50,
             "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe", "case 3");
  for (int i = 0; i < 25; i++) k[i] = (unsigned char)(i + 1);
  memset(data, 0xcd, 50);
  check_hmac(k, 25, data, 50,
             "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b", "case 4");
  memset(k, 0xaa, 131);
  const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  check_hmac(k, 131, m6, strlen(m6),
             "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54", "case 6");
  const char *m7 = "This is a test using a larger than block-size key and a larger than "
                   "block-size data. The key needs to be hashed before being used by the HMAC "
                   "algorithm.";
  check_hmac(k, 131, m7, strlen(m7),
             "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2", "case 7");

  CHECK(rpl_ct_equal("abcdef", "abcdef", 6) == 1, "equal buffers compare unequal");
  CHECK(rpl_ct_equal("abcdef", "abcdeg", 6) == 0, "last byte differs, compares equal");
  CHECK(rpl_ct_equal("xbcdef", "abcdef", 6) == 0, "first byte differs, compares equal");
  CHECK(rpl_ct_equal("a", "b", 0) == 1, "empty buffers compare unequal");

  unsigned char r1[64], r2[64], zero[64];
  memset(r1, 0, sizeof r1);
  memset(r2, 0, sizeof r2);
  memset(zero, 0, sizeof zero);
  rpl_error err;
  CHECK(rpl_random_bytes(r1, sizeof r1, &err) == RPL_OK, "rpl_random_bytes: %s", err.msg);
  CHECK(rpl_random_bytes(r2, sizeof r2, &err) == RPL_OK, "rpl_random_bytes: %s", err.msg);
  CHECK(memcmp(r1, zero, sizeof r1) != 0 && memcmp(r1, r2, sizeof r1) != 0,
        "two 64-byte random draws are zero or equal");
  CHECK(rpl_random_bytes(r1, 0, &err) == RPL_OK, "an empty draw fails: %s", err.msg);
  return report("crypto");
}
