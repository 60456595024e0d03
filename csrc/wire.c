/* wire.c - the link handshake's messages (see wire.h). */
#include "wire.h"

#include <string.h>

#include "bytes.h"
#include "crypto.h"

#define HS1_MAGIC 0x32484c52u /* "RLH2" little-endian */
#define HS2_MAGIC 0x33484c52u /* "RLH3" */
#define HS3_MAGIC 0x34484c52u /* "RLH4" */

static const char ACCEPTOR_LABEL[] = "ripples-link/1 acceptor";
static const char CONNECTOR_LABEL[] = "ripples-link/1 connector";


void rpl_hs1_make(unsigned char out[RPL_HS1_SIZE], int lo, int hi, int size,
                  uint64_t acceptor_id, const unsigned char nonce_lo[RPL_HS_NONCE_LEN]) {
  rpl_put32(out, HS1_MAGIC);
  rpl_put32(out + 4, (uint32_t)lo);
  rpl_put32(out + 8, (uint32_t)hi);
  rpl_put32(out + 12, (uint32_t)size);
  rpl_put64(out + 16, acceptor_id);
  memcpy(out + 24, nonce_lo, RPL_HS_NONCE_LEN);
}

int rpl_hs1_parse(const unsigned char in[RPL_HS1_SIZE], int self, int size, uint64_t self_id) {
  if (rpl_get32(in) != HS1_MAGIC || rpl_get32(in + 8) != (uint32_t)self ||
      rpl_get32(in + 12) != (uint32_t)size || rpl_get64(in + 16) != self_id)
    return -1;
  uint32_t lo = rpl_get32(in + 4);
  return lo < (uint32_t)self ? (int)lo : -1;
}

static void acceptor_mac(unsigned char mac[32], const unsigned char *key,
                         const unsigned char *hs1, const unsigned char *hs2_head) {
  const void *parts[] = {ACCEPTOR_LABEL, hs1, hs2_head};
  const size_t lens[] = {sizeof ACCEPTOR_LABEL, RPL_HS1_SIZE, 24};
  rpl_hmac_sha256(key, RPL_LINK_KEY_LEN, parts, lens, 3, mac);
}

static void connector_mac(unsigned char mac[32], const unsigned char *key,
                          const unsigned char *hs1, const unsigned char *hs2) {
  const void *parts[] = {CONNECTOR_LABEL, hs1, hs2};
  const size_t lens[] = {sizeof CONNECTOR_LABEL, RPL_HS1_SIZE, 24};
  rpl_hmac_sha256(key, RPL_LINK_KEY_LEN, parts, lens, 3, mac);
}

void rpl_hs2_make(unsigned char out[RPL_HS2_SIZE], const unsigned char key[RPL_LINK_KEY_LEN],
                  const unsigned char hs1[RPL_HS1_SIZE], int hi,
                  const unsigned char nonce_hi[RPL_HS_NONCE_LEN]) {
  rpl_put32(out, HS2_MAGIC);
  rpl_put32(out + 4, (uint32_t)hi);
  memcpy(out + 8, nonce_hi, RPL_HS_NONCE_LEN);
  acceptor_mac(out + 24, key, hs1, out);
}

int rpl_hs2_check(const unsigned char hs2[RPL_HS2_SIZE], const unsigned char key[RPL_LINK_KEY_LEN],
                  const unsigned char hs1[RPL_HS1_SIZE], int hi) {
  if (rpl_get32(hs2) != HS2_MAGIC || rpl_get32(hs2 + 4) != (uint32_t)hi) return 0;
  unsigned char mac[32];
  acceptor_mac(mac, key, hs1, hs2);
  return rpl_ct_equal(mac, hs2 + 24, 32);
}

void rpl_hs3_make(unsigned char out[RPL_HS3_SIZE], const unsigned char key[RPL_LINK_KEY_LEN],
                  const unsigned char hs1[RPL_HS1_SIZE], const unsigned char hs2[RPL_HS2_SIZE]) {
  rpl_put32(out, HS3_MAGIC);
  rpl_put32(out + 4, 0);
  connector_mac(out + 8, key, hs1, hs2);
}

int rpl_hs3_check(const unsigned char hs3[RPL_HS3_SIZE], const unsigned char key[RPL_LINK_KEY_LEN],
                  const unsigned char hs1[RPL_HS1_SIZE], const unsigned char hs2[RPL_HS2_SIZE]) {
  if (rpl_get32(hs3) != HS3_MAGIC || rpl_get32(hs3 + 4) != 0) return 0;
  unsigned char mac[32];
  connector_mac(mac, key, hs1, hs2);
  return rpl_ct_equal(mac, hs3 + 8, 32);
}

void rpl_link_key(const void *secret, size_t secret_len, const void *salt, size_t salt_len,
                  unsigned char key[RPL_LINK_KEY_LEN]) {
  static const char label[] = "ripples-link-key/1";
  const void *parts[] = {label, salt};
  const size_t lens[] = {sizeof label - 1, salt_len};
  rpl_hmac_sha256(secret, secret_len, parts, lens, 2, key);
}
