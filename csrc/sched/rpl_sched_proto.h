/*
 * rpl_sched_proto.h - the Group Generator's wire protocol (coordinator/PROTOCOL.md): message
 * layout, the encoder and the bounds-checked parser (csrc/sched/proto.c), job tokens, and the
 * worker client's handling of coordinator replies without sockets (csrc/sched/client.c). Used
 * by both ends: the worker-side client and the coordinator, and by their fuzzers. Pure
 * functions, no I/O, no state; part of the public API (rpl_sched.h includes it).
 *
 * Errors: functions return an rpl_status and fill the caller's rpl_error (from ripples.h).
 */
#ifndef RPL_SCHED_PROTO_H
#define RPL_SCHED_PROTO_H

#include <stddef.h>
#include <stdint.h>

#include "ripples.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RPL_PROTO_MAGIC 0x47504c52u /* "RPLG" little-endian */
#define RPL_PROTO_VERSION 6
#define RPL_PROTO_HEADER 36
#define RPL_TOKEN_LEN 16
/* Header bytes 20..36: the message's MAC, the first RPL_MAC_LEN bytes of
 * HMAC-SHA256(key, direction || header[0..20) || body), the direction 'W' for what workers and
 * tools send and 'C' for what the coordinator sends. The key is the job token for a session's
 * opening (HELLO and STATUS without the coordinator's nonce, CHALLENGE) and the session's key
 * (rpl_session_key) for everything after it (PROTOCOL.md, "Sessions"). The token itself never
 * travels. */
#define RPL_MAC_LEN 16
/* HELLO, STATUS and CHALLENGE carry the opener's nonce and the coordinator's. */
#define RPL_NONCE_LEN 16
/* The one header flag: an unauthenticated ERROR(BAD_TOKEN) whose MAC field echoes the MAC of
 * the message it refuses (the coordinator cannot MAC an answer for a sender whose token it
 * does not know). Any other flag, or this one on any other message, is malformed. */
#define RPL_PROTO_FLAG_ECHO 1u
/* A client's two sockets set their routing ids to 'R' (requests) or 'H' (heartbeats) followed
 * by 16 random bytes of their own, fresh for each connection: a session binds the rank to the
 * 'R' route, and its heartbeats count from any route (they carry the session's MAC and rising
 * sequence numbers), so knowing or taking a heartbeat route gains nothing (PROTOCOL.md). */
#define RPL_ROUTE_ID_LEN 17
#define RPL_ROUTE_REQUEST 'R'
#define RPL_ROUTE_HEARTBEAT 'H'
#define RPL_PROTO_MAX_TEXT 4096                 /* ERROR text */
#define RPL_PROTO_MAX_BODY (1u << 24)           /* STATUS_REPLY json; everything else smaller */
/* Heartbeats: the coordinator's interval (HELLO_ACK.heartbeat_ms) lies in
 * [RPL_HEARTBEAT_MIN_MS, RPL_HEARTBEAT_MAX_MS] and its dead_ms spans at least
 * RPL_DEAD_MIN_BEATS intervals (at most RPL_DEAD_MAX_MS): a coordinator refuses other settings,
 * and a client bounds what a HELLO_ACK says to these (what a peer sends is never trusted). */
#define RPL_HEARTBEAT_MIN_MS 50
#define RPL_HEARTBEAT_MAX_MS 60000
#define RPL_DEAD_MIN_BEATS 3
#define RPL_DEAD_MAX_MS 3600000

typedef enum {
  RPL_MSG_HELLO = 1,
  RPL_MSG_HELLO_ACK = 2,
  RPL_MSG_REQUEST = 3,
  RPL_MSG_GROUP = 4,
  RPL_MSG_CANCEL = 5,
  RPL_MSG_DONE = 6,
  RPL_MSG_HEARTBEAT = 7,
  RPL_MSG_HEARTBEAT_ACK = 8,
  RPL_MSG_FENCE = 9,
  RPL_MSG_UNFENCE = 10,
  RPL_MSG_LEAVE = 11,
  RPL_MSG_ACK = 12,
  RPL_MSG_STATUS = 13,
  RPL_MSG_STATUS_REPLY = 14,
  RPL_MSG_ERROR = 15,
  RPL_MSG_PASS = 16,
  RPL_MSG_CHALLENGE = 17,
  RPL_MSG_TYPE_MAX = 17
} rpl_msg_type;

const char *rpl_msg_type_name(int type);

/* Error codes carried by RPL_MSG_ERROR. */
typedef enum {
  RPL_PERR_BAD_TOKEN = 1,
  RPL_PERR_BAD_RANK = 2,    /* also: the rank is bound to another live connection */
  RPL_PERR_WORLD_MISMATCH = 3,
  RPL_PERR_LEFT = 4,
  RPL_PERR_MALFORMED = 5,
  RPL_PERR_INTERNAL = 6,
  RPL_PERR_NOT_REGISTERED = 7 /* a heartbeat from a worker that said no HELLO to this instance
                                 (the coordinator restarted): say HELLO again */
} rpl_proto_error;

/* A decoded message. Variable parts point into the parsed buffer (valid while it is). */
typedef struct rpl_msg {
  uint8_t type;
  /* Encoding: the key of the message's MAC (the job token; never written to the wire).
   * Parsing leaves it zero: the MAC is checked with rpl_msg_authentic. */
  uint8_t token[RPL_TOKEN_LEN];
  /* Parsing: the header's MAC field. Encoding with `echo` set: written as is (see
   * RPL_PROTO_FLAG_ECHO), and the message is an unauthenticated ERROR(BAD_TOKEN). */
  uint8_t mac[RPL_MAC_LEN];
  uint8_t echo;
  int32_t rank;             /* sender (worker messages) or addressee (replies); -1 = tool */
  uint32_t seq;             /* replies echo the sequence number of what they answer */
  /* HELLO, STATUS, CHALLENGE: the opener's nonce and the coordinator's (all zero in an
   * opening that asks for a CHALLENGE) */
  uint8_t nonce_w[RPL_NONCE_LEN];
  uint8_t nonce_c[RPL_NONCE_LEN];
  /* HELLO */
  int32_t nworkers;
  int32_t host_label;
  /* HELLO_ACK */
  uint8_t policy;
  uint32_t heartbeat_ms;
  uint32_t dead_ms;
  /* REQUEST, GROUP, PASS */
  uint64_t round;
  /* GROUP, PASS */
  uint32_t period;
  /* GROUP, CANCEL, DONE */
  uint64_t group_id;
  uint32_t nmembers;
  const uint8_t *members_le;/* nmembers little-endian int32, use rpl_msg_member() */
  /* CANCEL */
  int32_t culprit;
  uint32_t reason;
  /* DONE */
  uint32_t status;
  /* ERROR (code + text), STATUS_REPLY (text = json) */
  uint32_t code;
  const char *text;         /* not NUL-terminated */
  uint32_t text_len;
} rpl_msg;

/* Parses and bounds-checks one message. RPL_ERR_INVALID with a reason for anything
 * malformed: short, wrong magic/version/type, lengths that disagree, member counts or ranks
 * out of range (ranks must be in [0, max_workers) when max_workers > 0), a flag other than
 * RPL_PROTO_FLAG_ECHO on ERROR(BAD_TOKEN). Never reads past buf[len). Does not check the MAC:
 * rpl_msg_authentic does. */
rpl_status rpl_msg_parse(const void *buf, size_t len, int max_workers, rpl_msg *out,
                         rpl_error *err);
int32_t rpl_msg_member(const rpl_msg *m, uint32_t i);

/* 1 if buf[0..len) is a message MACed with `key` (constant-time comparison). An echo
 * (RPL_PROTO_FLAG_ECHO) is never authentic. */
int rpl_msg_authentic(const void *buf, size_t len, const uint8_t key[RPL_TOKEN_LEN]);
/* (Re)writes the MAC of the message in buf[0..len) (len >= RPL_PROTO_HEADER) for `key`,
 * whatever its content: what rpl_msg_encode does last (and the fuzzers after mutating). */
void rpl_msg_sign(void *buf, size_t len, const uint8_t key[RPL_TOKEN_LEN]);

/* 1 if a HELLO or STATUS asks for a CHALLENGE (its coordinator nonce is all zero). */
int rpl_msg_opening(const rpl_msg *m);
/* The key of a session opened by `type` (RPL_MSG_HELLO: a worker's; RPL_MSG_STATUS: one
 * query's) for `rank` with the two nonces: the first RPL_TOKEN_LEN bytes of
 * HMAC-SHA256(token, label || rank || nonce_w || nonce_c), a label per type. Only holders of
 * the token can compute it, and fresh nonces make every session's key its own. */
void rpl_session_key(const uint8_t token[RPL_TOKEN_LEN], int type, int32_t rank,
                     const uint8_t nonce_w[RPL_NONCE_LEN], const uint8_t nonce_c[RPL_NONCE_LEN],
                     uint8_t key[RPL_TOKEN_LEN]);

/* Bytes rpl_msg_encode needs for m. */
size_t rpl_msg_encoded_size(const rpl_msg *m);
/* Encodes m into buf, MACed with m->token (or, with m->echo, carrying m->mac: ERROR of code
 * BAD_TOKEN only); for GROUP the members come from `members` (host ints), not m->members_le.
 * Returns bytes written, 0 if cap is too small or m is invalid. */
size_t rpl_msg_encode(const rpl_msg *m, const int *members, void *buf, size_t cap);

/* 32 lowercase hex digits <-> 16 bytes. */
void rpl_token_to_hex(const uint8_t token[RPL_TOKEN_LEN], char hex[2 * RPL_TOKEN_LEN + 1]);
rpl_status rpl_token_from_hex(const char *hex, uint8_t token[RPL_TOKEN_LEN], rpl_error *err);
/* Fresh random token from the OS. */
rpl_status rpl_token_generate(uint8_t token[RPL_TOKEN_LEN], rpl_error *err);
/* Constant-time comparison: 1 if equal. */
int rpl_token_equal(const uint8_t a[RPL_TOKEN_LEN], const uint8_t b[RPL_TOKEN_LEN]);

/* ---- The client's handling of coordinator replies, without sockets (client.c) -------------
 * Pure functions, so the fuzzer (fuzz/fuzz_client.c) drives exactly what the
 * client runs. */

/* 1 if buf[0..n) is the reply awaited by `rank` under `seq`: it parses (ranks < nworkers),
 * is addressed to rank, echoes seq, and is MACed with `key` (the session's key, or the token
 * while a session opens), or is an ERROR(NOT_REGISTERED) MACed with the token (an instance
 * that holds no session of ours: it restarted, or is a standby), or the coordinator's
 * unauthenticated refusal of the token (an echoed ERROR(BAD_TOKEN)); *m is then filled. */
int rpl_client_accept(const void *buf, size_t n, const uint8_t key[RPL_TOKEN_LEN],
                      const uint8_t token[RPL_TOKEN_LEN], int nworkers, int rank, uint32_t seq,
                      rpl_msg *m);

typedef enum {
  RPL_REPLY_GROUP, /* members[0..*n), *group_id filled */
  RPL_REPLY_PASS,  /* the round is passed: members = {rank}, *group_id = 0 */
  RPL_REPLY_RETRY, /* cancelled: ask again */
  RPL_REPLY_LOST,  /* the coordinator does not know us (restarted): fail over */
  RPL_REPLY_FAIL   /* err says why */
} rpl_reply_kind;

/* What an accepted reply to REQUEST(round) of `rank` means; members holds cap ints. */
rpl_reply_kind rpl_client_request_reply(const rpl_msg *m, uint64_t round, int rank,
                                        int *members, int cap, int *n, uint64_t *group_id,
                                        const char *endpoint, rpl_error *err);

enum { RPL_BEAT_IGNORE, RPL_BEAT_ACK, RPL_BEAT_LOST };
/* What a message on the heartbeat socket means (RPL_BEAT_*): a reply counts only if it is
 * MACed as rpl_client_accept says, addressed to `rank` and answers a heartbeat sent after the
 * last one answered: its seq in (answered, sent] (serial arithmetic). An old reply replayed, or one for another worker, is
 * ignored: it must not keep a worker attached to a coordinator that died, nor make it
 * register anew. On a reply that counts, *seq_out (may be NULL) is the seq it answered, the
 * caller's new `answered`. */
int rpl_client_beat_reply(const void *buf, size_t n, const uint8_t key[RPL_TOKEN_LEN],
                          const uint8_t token[RPL_TOKEN_LEN], int nworkers, int rank,
                          uint32_t answered, uint32_t sent, uint32_t *seq_out);

#ifdef __cplusplus
}
#endif

#endif /* RPL_SCHED_PROTO_H */
