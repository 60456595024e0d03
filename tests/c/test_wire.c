/* The link handshake's messages (wire.h): a genuine exchange passes; a wrong key, a replay, a
 * message meant for another rank or transport, and any single changed byte fail. */
#include <string.h>

#include "crypto.h"
#include "harness.h"
#include "wire.h"

static unsigned char key_a[RPL_LINK_KEY_LEN], key_b[RPL_LINK_KEY_LEN];

static void exchange(const unsigned char *k_lo, const unsigned char *k_hi, unsigned char *hs1,
                     unsigned char *hs2, unsigned char *hs3) {
  unsigned char n_lo[RPL_HS_NONCE_LEN], n_hi[RPL_HS_NONCE_LEN];
  rpl_error err;
  rpl_random_bytes(n_lo, sizeof n_lo, &err);
  rpl_random_bytes(n_hi, sizeof n_hi, &err);
  rpl_hs1_make(hs1, 1, 3, 4, 0x1122334455667788ull, n_lo);
  rpl_hs2_make(hs2, k_hi, hs1, 3, n_hi);
  rpl_hs3_make(hs3, k_lo, hs1, hs2);
}

static void test_genuine(void) {
  unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE], hs3[RPL_HS3_SIZE];
  exchange(key_a, key_a, hs1, hs2, hs3);
  CHECK(rpl_hs1_parse(hs1, 3, 4, 0x1122334455667788ull) == 1, "HS1 names rank 1");
  CHECK(rpl_hs2_check(hs2, key_a, hs1, 3), "HS2 passes with the shared key");
  CHECK(rpl_hs3_check(hs3, key_a, hs1, hs2), "HS3 passes with the shared key");
}

static void test_refused(void) {
  unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE], hs3[RPL_HS3_SIZE];
  exchange(key_a, key_a, hs1, hs2, hs3);
  CHECK(rpl_hs1_parse(hs1, 2, 4, 0x1122334455667788ull) < 0, "HS1 for rank 3 refused by 2");
  CHECK(rpl_hs1_parse(hs1, 3, 5, 0x1122334455667788ull) < 0, "HS1 of a group of 4 refused");
  CHECK(rpl_hs1_parse(hs1, 3, 4, 0x1122334455667789ull) < 0, "HS1 for another transport");
  unsigned char n[RPL_HS_NONCE_LEN] = {0};
  unsigned char up[RPL_HS1_SIZE];
  rpl_hs1_make(up, 3, 3, 4, 7, n);
  CHECK(rpl_hs1_parse(up, 3, 4, 7) < 0, "a rank cannot connect to itself");
  rpl_hs1_make(up, 4, 3, 4, 7, n);
  CHECK(rpl_hs1_parse(up, 3, 4, 7) < 0, "only a lower rank connects");
  rpl_hs1_make(up, -1, 3, 4, 7, n);
  CHECK(rpl_hs1_parse(up, 3, 4, 7) < 0, "a negative rank is refused");

  /* Wrong keys, either side. */
  exchange(key_a, key_b, hs1, hs2, hs3);
  CHECK(!rpl_hs2_check(hs2, key_a, hs1, 3), "an acceptor with another key is not believed");
  exchange(key_b, key_a, hs1, hs2, hs3);
  CHECK(rpl_hs2_check(hs2, key_a, hs1, 3), "(the acceptor is genuine)");
  CHECK(!rpl_hs3_check(hs3, key_a, hs1, hs2), "a connector with another key is refused");

  /* Replay: a recorded HS1 and HS3 against a fresh challenge. */
  unsigned char r1[RPL_HS1_SIZE], r2[RPL_HS2_SIZE], r3[RPL_HS3_SIZE];
  exchange(key_a, key_a, r1, r2, r3);
  unsigned char fresh[RPL_HS2_SIZE], nonce[RPL_HS_NONCE_LEN];
  rpl_error err;
  rpl_random_bytes(nonce, sizeof nonce, &err);
  rpl_hs2_make(fresh, key_a, r1, 3, nonce);
  CHECK(!rpl_hs3_check(r3, key_a, r1, fresh), "a replayed HS3 fails a fresh challenge");
  /* Reflection: the acceptor's MAC is no connector's MAC. */
  unsigned char refl[RPL_HS3_SIZE];
  memcpy(refl, r3, 8);
  memcpy(refl + 8, r2 + 24, 32);
  CHECK(!rpl_hs3_check(refl, key_a, r1, r2), "an acceptor's proof is not a connector's");
}

/* Every single-byte change of HS2 or HS3 is refused. */
static void test_every_byte(void) {
  unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE], hs3[RPL_HS3_SIZE];
  exchange(key_a, key_a, hs1, hs2, hs3);
  int bad2 = 0, bad3 = 0;
  for (int i = 0; i < RPL_HS2_SIZE; i++) {
    hs2[i] ^= 0x41;
    bad2 += rpl_hs2_check(hs2, key_a, hs1, 3);
    hs2[i] ^= 0x41;
  }
  for (int i = 0; i < RPL_HS3_SIZE; i++) {
    hs3[i] ^= 0x10;
    bad3 += rpl_hs3_check(hs3, key_a, hs1, hs2);
    hs3[i] ^= 0x10;
  }
  for (int i = 0; i < RPL_HS1_SIZE; i++) { /* HS1 is covered by both MACs */
    hs1[i] ^= 0x01;
    bad3 += rpl_hs3_check(hs3, key_a, hs1, hs2);
    bad2 += rpl_hs2_check(hs2, key_a, hs1, 3);
    hs1[i] ^= 0x01;
  }
  CHECK(bad2 == 0, "%d changed HS2s (or HS1s) passed", bad2);
  CHECK(bad3 == 0, "%d changed HS3s (or HS1s) passed", bad3);
}

static void test_key_derivation(void) {
  unsigned char k1[RPL_LINK_KEY_LEN], k2[RPL_LINK_KEY_LEN], k3[RPL_LINK_KEY_LEN];
  rpl_link_key("secret", 6, "salt", 4, k1);
  rpl_link_key("secret", 6, "salt", 4, k2);
  rpl_link_key("secreT", 6, "salt", 4, k3);
  CHECK(memcmp(k1, k2, sizeof k1) == 0, "the key is a function of secret and salt");
  CHECK(memcmp(k1, k3, sizeof k1) != 0, "another secret, another key");
  rpl_link_key("", 0, "salt", 4, k3);
  CHECK(memcmp(k1, k3, sizeof k1) != 0, "no secret, another key");
}

int main(void) {
  rpl_error err;
  CHECK(rpl_random_bytes(key_a, sizeof key_a, &err) == RPL_OK, "random: %s", err.msg);
  rpl_random_bytes(key_b, sizeof key_b, &err);
  test_genuine();
  test_refused();
  test_every_byte();
  test_key_derivation();
  return report("wire");
}
