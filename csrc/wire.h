/*
 * wire.h - the link handshake of the transport (internal to csrc/): pure functions that build
 * and check its three messages, no I/O, so they can be unit-tested and fuzzed.
 *
 * A data link is accepted only after a challenge-response in both directions, keyed by the
 * communicator's link key (bootstrap.c derives it from the job secret and a per-communicator
 * salt read from the store):
 *
 *   connector (lower rank) -> acceptor:  HS1 = magic, lo, hi, size, acceptor_id, nonce_lo
 *   acceptor -> connector:               HS2 = magic, hi, nonce_hi, HMAC(key, "acceptor", HS1, hi, nonce_hi)
 *   connector -> acceptor:               HS3 = magic, 0, HMAC(key, "connector", HS1, HS2 without its MAC)
 *
 * Each side proves it holds the key over a fresh random value chosen by the other, so a
 * recorded handshake is worthless: a replayed HS1 gets a new nonce_hi, and a replayed HS3
 * cannot match it. acceptor_id is the acceptor's per-transport random identity, published
 * with its address: a connection meant for another transport (a stale address, another job)
 * is told apart at once, before any MAC is computed. Distinct labels keep one side's MAC from
 * being reflected as the other's. All integers little-endian.
 */
#ifndef RPL_WIRE_H
#define RPL_WIRE_H

#include <stddef.h>
#include <stdint.h>

#define RPL_LINK_KEY_LEN 32
#define RPL_HS_NONCE_LEN 16
#define RPL_HS1_SIZE 40
#define RPL_HS2_SIZE 56
#define RPL_HS3_SIZE 40

/* HS1, written by the connector `lo` to the acceptor `hi` of a group of `size`. */
void rpl_hs1_make(unsigned char out[RPL_HS1_SIZE], int lo, int hi, int size,
                  uint64_t acceptor_id, const unsigned char nonce_lo[RPL_HS_NONCE_LEN]);
/* The connector's rank named by an HS1 that the acceptor `self` (of a group of `size`, with
 * identity `self_id`) received, or -1 when it is not a valid HS1 for it (wrong magic, group,
 * identity, or a rank that is not lower than self). */
int rpl_hs1_parse(const unsigned char in[RPL_HS1_SIZE], int self, int size, uint64_t self_id);

/* HS2, the acceptor's answer to `hs1`. */
void rpl_hs2_make(unsigned char out[RPL_HS2_SIZE], const unsigned char key[RPL_LINK_KEY_LEN],
                  const unsigned char hs1[RPL_HS1_SIZE], int hi,
                  const unsigned char nonce_hi[RPL_HS_NONCE_LEN]);
/* 1 when `hs2` is the valid answer of the acceptor `hi` to the `hs1` we sent. */
int rpl_hs2_check(const unsigned char hs2[RPL_HS2_SIZE], const unsigned char key[RPL_LINK_KEY_LEN],
                  const unsigned char hs1[RPL_HS1_SIZE], int hi);

/* HS3, the connector's proof over both nonces. */
void rpl_hs3_make(unsigned char out[RPL_HS3_SIZE], const unsigned char key[RPL_LINK_KEY_LEN],
                  const unsigned char hs1[RPL_HS1_SIZE], const unsigned char hs2[RPL_HS2_SIZE]);
/* 1 when `hs3` proves the key over the exchange hs1, hs2. */
int rpl_hs3_check(const unsigned char hs3[RPL_HS3_SIZE], const unsigned char key[RPL_LINK_KEY_LEN],
                  const unsigned char hs1[RPL_HS1_SIZE], const unsigned char hs2[RPL_HS2_SIZE]);

/* The link key of a communicator: HMAC-SHA256(secret, "ripples-link-key/1" || salt). `secret`
 * may be empty (no user secret: the salt, read from the store, is then all there is). */
void rpl_link_key(const void *secret, size_t secret_len, const void *salt, size_t salt_len,
                  unsigned char key[RPL_LINK_KEY_LEN]);

#endif /* RPL_WIRE_H */
