/*
 * crypto.h - the few cryptographic primitives the core needs (internal to csrc/), with no
 * dependency: kernel randomness, SHA-256 (FIPS 180-4), HMAC-SHA256 (RFC 2104) and a
 * constant-time comparison. Used for nonces (shared-memory segment names) and for keyed
 * challenge-response on links. Thread-safe: no state outside the caller's buffers.
 */
#ifndef RPL_CRYPTO_H
#define RPL_CRYPTO_H

#include <stddef.h>

#include "ripples.h"

/* Fills buf with n bytes from the kernel's CSPRNG (getrandom, retried on EINTR and short
 * reads; blocks until the pool is initialised). Never falls back to a weaker source: on
 * failure returns RPL_ERR_SYSTEM with the reason. */
rpl_status rpl_random_bytes(void *buf, size_t n, rpl_error *err);

#define RPL_SHA256_LEN 32
void rpl_sha256(const void *data, size_t n, unsigned char out[RPL_SHA256_LEN]);

/* HMAC-SHA256 (RFC 2104) of the concatenation of `nparts` parts. */
void rpl_hmac_sha256(const void *key, size_t key_len, const void *const *parts,
                     const size_t *lens, int nparts, unsigned char out[RPL_SHA256_LEN]);

/* Constant-time comparison: 1 when equal. The time depends on n only. */
int rpl_ct_equal(const void *a, const void *b, size_t n);

/* Overwrites n bytes at p with zeros in a way the compiler does not drop (for keys). */
void rpl_wipe(void *p, size_t n);

#endif /* RPL_CRYPTO_H */
