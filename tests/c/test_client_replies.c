/* The worker-side client's reading of heartbeat replies (issue 51, finding 5): a reply keeps a
 * worker attached to its coordinator only if it is MACed with its session's key, addressed to
 * this worker and answers a heartbeat still in flight. An old HEARTBEAT_ACK replayed (by a
 * listener on a dead primary's freed port, say), another worker's, one of another session, or
 * the coordinator's seq-0 probe counts for nothing, nor does an old "not registered" error. A
 * request's reply must be addressed to the rank that waits for it (finding 6). Only "not
 * registered" may come MACed with the token (from an instance that holds no session of ours). */
#include <string.h>

#include "rpl_sched.h"

#include "check.h"

static uint8_t key[RPL_TOKEN_LEN], token[RPL_TOKEN_LEN];

static size_t reply_with(const uint8_t *k, uint8_t *buf, size_t cap, int type, int rank,
                         uint32_t seq, uint32_t code) {
  rpl_msg m;
  memset(&m, 0, sizeof m);
  memcpy(m.token, k, RPL_TOKEN_LEN);
  m.type = (uint8_t)type;
  m.rank = rank;
  m.seq = seq;
  m.code = code;
  size_t n = rpl_msg_encode(&m, NULL, buf, cap);
  REQUIRE(n >= RPL_PROTO_HEADER, "encode %s", rpl_msg_type_name(m.type));
  return n;
}

static size_t reply(uint8_t *buf, size_t cap, int type, int rank, uint32_t seq, uint32_t code) {
  return reply_with(key, buf, cap, type, rank, seq, code);
}

static int beat(const uint8_t *buf, size_t n, int rank, uint32_t answered, uint32_t sent,
                uint32_t *got) {
  return rpl_client_beat_reply(buf, n, key, token, 16, rank, answered, sent, got);
}

int main(void) {
  for (int i = 0; i < RPL_TOKEN_LEN; i++) token[i] = (uint8_t)(i * 29 + 3);
  uint8_t nonce_w[RPL_NONCE_LEN] = {1, 2, 3}, nonce_c[RPL_NONCE_LEN] = {4, 5, 6};
  rpl_session_key(token, RPL_MSG_HELLO, 3, nonce_w, nonce_c, key);
  uint8_t buf[512];
  uint32_t got = 0;

  /* heartbeats 40..42 in flight: answered up to 39, sent up to 42 */
  size_t n = reply(buf, sizeof buf, RPL_MSG_HEARTBEAT_ACK, 3, 41, 0);
  REQUIRE(beat(buf, n, 3, 39, 42, &got) == RPL_BEAT_ACK && got == 41, "a fresh ACK counts");
  /* the same ACK once it (or a later one) was answered: a replay */
  REQUIRE(beat(buf, n, 3, 41, 50, &got) == RPL_BEAT_IGNORE, "an ACK replayed counts");
  REQUIRE(beat(buf, n, 3, 45, 50, &got) == RPL_BEAT_IGNORE, "an old ACK counts");
  REQUIRE(beat(buf, n, 3, 30, 40, &got) == RPL_BEAT_IGNORE, "an ACK of an unsent beat");
  REQUIRE(beat(buf, n, 4, 39, 42, &got) == RPL_BEAT_IGNORE, "another worker's ACK counts");
  uint8_t forged[512];
  memcpy(forged, buf, n);
  forged[n - 1] ^= 1;
  REQUIRE(beat(forged, n, 3, 39, 42, &got) == RPL_BEAT_IGNORE, "an ACK without its MAC");
  /* serial arithmetic: the counter wrapped between the last answered beat and this one */
  n = reply(buf, sizeof buf, RPL_MSG_HEARTBEAT_ACK, 3, 2, 0);
  REQUIRE(beat(buf, n, 3, 0xfffffff0u, 5, &got) == RPL_BEAT_ACK && got == 2, "wrap-around");

  /* The coordinator's liveness probe of a bound connection (seq 0) answers no heartbeat. */
  n = reply(buf, sizeof buf, RPL_MSG_HEARTBEAT_ACK, 3, 0, 0);
  REQUIRE(beat(buf, n, 3, 0, 5, &got) == RPL_BEAT_IGNORE, "a seq-0 probe counts");

  /* "Not registered" (a new instance) is news only for a heartbeat in flight. */
  n = reply(buf, sizeof buf, RPL_MSG_ERROR, 3, 42, RPL_PERR_NOT_REGISTERED);
  REQUIRE(beat(buf, n, 3, 39, 42, &got) == RPL_BEAT_LOST && got == 42, "a fresh LOST");
  REQUIRE(beat(buf, n, 3, 44, 50, &got) == RPL_BEAT_IGNORE, "an old LOST replayed counts");
  /* ... and may come MACed with the token (a restarted instance knows no session of ours),
   * which makes nothing else count */
  n = reply_with(token, buf, sizeof buf, RPL_MSG_ERROR, 3, 42, RPL_PERR_NOT_REGISTERED);
  REQUIRE(beat(buf, n, 3, 39, 42, &got) == RPL_BEAT_LOST, "LOST under the token");
  n = reply_with(token, buf, sizeof buf, RPL_MSG_HEARTBEAT_ACK, 3, 41, 0);
  REQUIRE(beat(buf, n, 3, 39, 42, &got) == RPL_BEAT_IGNORE, "an ACK under the token counts");
  /* another session's key (an earlier session of this rank, replayed): nothing counts */
  uint8_t other[RPL_TOKEN_LEN];
  nonce_c[0] ^= 1;
  rpl_session_key(token, RPL_MSG_HELLO, 3, nonce_w, nonce_c, other);
  n = reply_with(other, buf, sizeof buf, RPL_MSG_HEARTBEAT_ACK, 3, 41, 0);
  REQUIRE(beat(buf, n, 3, 39, 42, &got) == RPL_BEAT_IGNORE, "another session's ACK counts");

  /* Request replies: only the one addressed to this rank under the seq awaited. */
  rpl_msg m;
  n = reply(buf, sizeof buf, RPL_MSG_ACK, 3, 9, 0);
  REQUIRE(rpl_client_accept(buf, n, key, token, 16, 3, 9, &m) && m.type == RPL_MSG_ACK,
          "ACK taken");
  REQUIRE(!rpl_client_accept(buf, n, key, token, 16, 5, 9, &m), "another rank's reply taken");
  REQUIRE(!rpl_client_accept(buf, n, key, token, 16, 3, 10, &m), "another seq's reply taken");
  n = reply_with(token, buf, sizeof buf, RPL_MSG_ACK, 3, 9, 0);
  REQUIRE(!rpl_client_accept(buf, n, key, token, 16, 3, 9, &m), "an ACK under the token taken");
  n = reply_with(token, buf, sizeof buf, RPL_MSG_ERROR, 3, 9, RPL_PERR_NOT_REGISTERED);
  REQUIRE(rpl_client_accept(buf, n, key, token, 16, 3, 9, &m), "NOT_REGISTERED refused");
  n = reply_with(token, buf, sizeof buf, RPL_MSG_ERROR, 3, 9, RPL_PERR_LEFT);
  REQUIRE(!rpl_client_accept(buf, n, key, token, 16, 3, 9, &m), "LEFT under the token taken");
  return report("test_client_replies");
}
