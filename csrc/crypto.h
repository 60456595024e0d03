/*
 * crypto.h - the little cryptography the core needs (internal to csrc/): the kernel's random
 * bytes, SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), and a constant-time comparison.
 * No state, no dependencies; every function is safe to call from any thread.
 */
#ifndef RPL_CRYPTO_H
#define RPL_CRYPTO_H

#include <stddef.h>
#include <stdint.h>

#include "ripples.h"

/* Fills buf with n bytes from the kernel's CSPRNG (getrandom, retried on EINTR and short
 * reads; blocks until the pool is initialised). Never falls back to a weaker source: on
 * failure returns RPL_ERR_SYSTEM with the reason. */
rpl_status rpl_random_bytes(void *buf, size_t n, rpl_error *err);

#define RPL_SHA256_LEN 32
void rpl_sha256(const void *data, size_t n, unsigned char out[RPL_SHA256_LEN]);
/* SHA-256 uses the CPU's SHA extensions where it has them (x86-64 SHA-NI; rpl_sha256_hw says
 * whether); rpl_sha256_sw is the portable code alone, for tests that compare the two. */
int rpl_sha256_hw(void);
void rpl_sha256_sw(const void *data, size_t n, unsigned char out[RPL_SHA256_LEN]);

/* HMAC-SHA256 of the concatenation of `nparts` parts. */
void rpl_hmac_sha256(const void *key, size_t key_len, const void *const *parts,
                     const size_t *lens, int nparts, unsigned char out[RPL_SHA256_LEN]);

/* Incremental HMAC-SHA256, for data that arrives or leaves in pieces (authenticated data-link
 * frames): init with a key, update any number of times, final. A plain struct the caller
 * owns; final leaves it to be initialised again. */
typedef struct rpl_hmac {
  uint32_t h[8];
  uint64_t bytes;
  unsigned char block[64];
  size_t used;
  unsigned char opad[64];
} rpl_hmac;
void rpl_hmac_init(rpl_hmac *m, const void *key, size_t key_len);
void rpl_hmac_update(rpl_hmac *m, const void *data, size_t n);
void rpl_hmac_final(rpl_hmac *m, unsigned char out[RPL_SHA256_LEN]);

/* Constant-time comparison: 1 when the n bytes are equal. */
int rpl_ct_equal(const void *a, const void *b, size_t n);

#endif /* RPL_CRYPTO_H */
