/* Fuzz target for the worker-side client's handling of coordinator replies: the exact
 * functions csrc/sched/client.c runs on what its sockets receive (rpl_client_accept,
 * rpl_client_request_reply, rpl_client_beat_reply), without sockets. Input: messages, each
 * prefixed by a 2-byte little-endian length (bit 15: the harness MACs the message with the
 * client's session key after any mutation, as the coordinator would have), as they would
 * arrive on the request socket (waiting for REQUEST(round 2) under seq 7) and on the heartbeat
 * socket. Oracles: nothing is accepted but messages MACed with the session's key under its
 * seq, an ERROR(NOT_REGISTERED) MACed with the token under its seq, or an echoed
 * ERROR(BAD_TOKEN) under its seq; a group handed to the caller fits its buffer, holds the
 * caller, and has sorted, unique members in [0, nworkers).
 *
 * libFuzzer (clang):   fuzz/run_libfuzzer.sh [seconds] [workdir] client
 * Standalone (any cc): fuzz_client_smoke [iterations] | --write-corpus DIR | FILE...
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpl_sched.h"

#define FUZZ_WORKERS 5
#define FUZZ_RANK 2
#define FUZZ_SEQ 7u
#define FUZZ_ROUND 2u
static const char *FUZZ_TOKEN = "c1c2c3c4c5c6c7c8c9cacbcccdcecfd0";

/* The client's session key: the token's, for nonces the harness fixes. */
static void session_key(const uint8_t tok[RPL_TOKEN_LEN], uint8_t key[RPL_TOKEN_LEN]) {
  uint8_t nw[RPL_NONCE_LEN] = {7}, nc[RPL_NONCE_LEN] = {9};
  rpl_session_key(tok, RPL_MSG_HELLO, FUZZ_RANK, nw, nc, key);
}

/* MACed as the client may accept: with the key, or a NOT_REGISTERED with the token. */
static int authentic(const uint8_t *buf, size_t len, const rpl_msg *m, const uint8_t *key,
                     const uint8_t *tok) {
  return rpl_msg_authentic(buf, len, key) ||
         (m->type == RPL_MSG_ERROR && m->code == RPL_PERR_NOT_REGISTERED &&
          rpl_msg_authentic(buf, len, tok));
}

static void fail(const char *why) {
  fprintf(stderr, "fuzz_client: %s\n", why);
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t tok[RPL_TOKEN_LEN], key[RPL_TOKEN_LEN];
  rpl_error err;
  if (rpl_token_from_hex(FUZZ_TOKEN, tok, &err) != RPL_OK) abort();
  session_key(tok, key);
  size_t pos = 0;
  while (pos + 2 <= size) {
    size_t len = ((size_t)data[pos] | (size_t)data[pos + 1] << 8) & 0x7fff;
    int sign = data[pos + 1] & 0x80;
    pos += 2;
    if (len > size - pos) len = size - pos;
    uint8_t *buf = malloc(len ? len : 1); /* exact size: ASan catches reads past it */
    memcpy(buf, data + pos, len);
    pos += len;
    if (sign) rpl_msg_sign(buf, len, key);
    {
      /* heartbeats sent after the last answered (FUZZ_SEQ - 3): a reply counts only for them */
      uint32_t answered = FUZZ_SEQ - 3, got = 0;
      int kind = rpl_client_beat_reply(buf, len, key, tok, FUZZ_WORKERS, FUZZ_RANK, answered,
                                       FUZZ_SEQ, &got);
      if (kind != RPL_BEAT_IGNORE && (got <= answered || got > FUZZ_SEQ))
        fail("a heartbeat reply counted for a heartbeat not in flight");
      rpl_msg hm;
      if (kind == RPL_BEAT_ACK && !rpl_msg_authentic(buf, len, key))
        fail("a heartbeat ACK counted without its session's MAC");
      if (kind == RPL_BEAT_LOST &&
          (rpl_msg_parse(buf, len, FUZZ_WORKERS, &hm, &err) != RPL_OK ||
           !authentic(buf, len, &hm, key, tok)))
        fail("a heartbeat reply counted without its MAC");
    }
    rpl_msg m;
    if (!rpl_client_accept(buf, len, key, tok, FUZZ_WORKERS, FUZZ_RANK, FUZZ_SEQ, &m)) {
      free(buf);
      continue;
    }
    if (m.seq != FUZZ_SEQ) fail("accepted a reply to another seq");
    if (m.rank != FUZZ_RANK) fail("accepted a reply to another rank");
    if (m.echo ? !(m.type == RPL_MSG_ERROR && m.code == RPL_PERR_BAD_TOKEN)
               : !authentic(buf, len, &m, key, tok))
      fail("accepted a foreign reply");
    for (int cap = 1; cap <= FUZZ_WORKERS; cap += 2) {
      int members[FUZZ_WORKERS];
      int n = -1;
      uint64_t gid = 0;
      rpl_reply_kind k = rpl_client_request_reply(&m, FUZZ_ROUND, FUZZ_RANK, members, cap, &n,
                                                  &gid, "tcp://fuzz:1", &err);
      if (k == RPL_REPLY_GROUP) {
        if (n < 1 || n > cap || gid == 0) fail("group size or id out of bounds");
        int self = 0;
        for (int i = 0; i < n; i++) {
          if (members[i] < 0 || members[i] >= FUZZ_WORKERS) fail("member out of range");
          if (i && members[i] <= members[i - 1]) fail("members not sorted and unique");
          self |= members[i] == FUZZ_RANK;
        }
        if (!self) fail("a group without the caller");
        if (m.type != RPL_MSG_GROUP || m.round != FUZZ_ROUND) fail("group from another reply");
      } else if (k == RPL_REPLY_PASS) {
        if (n != 1 || members[0] != FUZZ_RANK || gid != 0) fail("pass is not the caller alone");
      } else if (k == RPL_REPLY_FAIL) {
        if (err.msg[0] == '\0') fail("failure without a reason");
      }
    }
    free(buf);
  }
  return 0;
}

#ifdef FUZZ_STANDALONE
#include "fuzz_standalone.h"

/* Seeds: every reply type a coordinator sends, MACed with the client's session key under its
 * seq (and some with a stale seq, only the token, a wrong token, another round, an echoed
 * refusal). */
static size_t seed_messages(uint8_t *out, size_t cap, uint64_t pick) {
  static const int types[] = {RPL_MSG_GROUP, RPL_MSG_GROUP,         RPL_MSG_PASS,
                              RPL_MSG_CANCEL, RPL_MSG_ERROR,        RPL_MSG_HELLO_ACK,
                              RPL_MSG_ACK,   RPL_MSG_HEARTBEAT_ACK};
  size_t pos = 0;
  uint64_t s = pick | 1;
  for (int i = 0; i < 8; i++) {
    s = fuzz_next(s);
    rpl_msg m = fuzz_msg(types[(s >> 33) % 8], FUZZ_RANK,
                         (s >> 40) % 5 ? FUZZ_SEQ : FUZZ_SEQ - 1, FUZZ_TOKEN);
    int sign = 1;
    if ((s >> 45) % 7 == 0) {
      m.token[0] ^= 0x80; /* another job's coordinator */
      sign = 0;
    } else if ((s >> 45) % 7 == 1) {
      sign = 0; /* the token, not the session's key: only NOT_REGISTERED counts */
    }
    m.round = (s >> 48) % 4 ? FUZZ_ROUND : FUZZ_ROUND + 1;
    m.group_id = 1 + (s >> 20) % 9;
    m.period = 2;
    int members[FUZZ_WORKERS], n = 0;
    for (int r = 0; r < FUZZ_WORKERS; r++)
      if (r == FUZZ_RANK || (s >> (8 + r)) & 1) members[n++] = r;
    m.nmembers = (uint32_t)n;
    m.culprit = 1;
    m.reason = RPL_REASON_DEAD;
    m.code = (s >> 52) % 2 ? RPL_PERR_NOT_REGISTERED : RPL_PERR_BAD_RANK;
    m.text = "refused";
    m.text_len = 7;
    m.policy = 0;
    m.nworkers = FUZZ_WORKERS;
    m.heartbeat_ms = 100;
    m.dead_ms = 1000;
    if (m.type == RPL_MSG_ERROR && (s >> 58) % 3 == 0) { /* the refusal of our token */
      m.code = RPL_PERR_BAD_TOKEN;
      m.echo = 1;
      memset(m.mac, 0x5a, RPL_MAC_LEN);
      sign = 0;
    }
    pos = fuzz_put_msg(out, pos, cap, NULL, 0, &m, members, sign);
  }
  return pos;
}

int main(int argc, char **argv) {
  return fuzz_standalone_main(argc, argv, "fuzz_client", 32, seed_messages, 0x4321);
}
#endif
