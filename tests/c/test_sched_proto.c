/* Wire protocol: every message type round-trips, and the parser refuses truncations, bad
 * lengths, out-of-range ranks and members, and survives random corruption. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bytes.h"
#include "crypto.h"
#include "rpl_sched.h"

#include "check.h"

static size_t enc(rpl_msg *m, const int *members, uint8_t *buf, size_t cap) {
  for (int i = 0; i < RPL_TOKEN_LEN; i++) m->token[i] = (uint8_t)(i * 17 + 1);
  size_t n = rpl_msg_encode(m, members, buf, cap);
  REQUIRE(n == rpl_msg_encoded_size(m) && n >= RPL_PROTO_HEADER, "encode %s",
          rpl_msg_type_name(m->type));
  return n;
}

int main(void) {
  uint8_t buf[1024];
  rpl_msg m, p;
  rpl_error err;
  int members[5] = {0, 3, 4, 9, 15};
  const char *text = "hello";
  size_t lens[RPL_MSG_TYPE_MAX + 1];
  uint8_t bufs[RPL_MSG_TYPE_MAX + 1][256];
  for (int t = 1; t <= RPL_MSG_TYPE_MAX; t++) {
    memset(&m, 0, sizeof m);
    m.type = (uint8_t)t;
    m.rank = t == RPL_MSG_STATUS || t == RPL_MSG_STATUS_REPLY ? -1 : 7;
    m.seq = 1000u + (uint32_t)t;
    m.nworkers = 16;
    m.host_label = -5;
    m.policy = RPL_POLICY_SMART;
    m.heartbeat_ms = 250;
    m.dead_ms = 2500;
    m.round = 0x123456789abcull;
    m.group_id = 77;
    m.period = 4;
    m.nmembers = 5;
    m.culprit = 3;
    m.reason = RPL_REASON_DEAD;
    m.status = 2;
    m.code = RPL_PERR_BAD_TOKEN;
    m.text = text;
    m.text_len = 5;
    for (int i = 0; i < RPL_NONCE_LEN; i++) {
      m.nonce_w[i] = (uint8_t)(0xa0 + i);
      m.nonce_c[i] = (uint8_t)(0x30 + i);
    }
    size_t n = enc(&m, members, bufs[t], sizeof bufs[t]);
    lens[t] = n;
    REQUIRE(rpl_msg_parse(bufs[t], n, 16, &p, &err) == RPL_OK, "%s: %s", rpl_msg_type_name(t),
            err.msg);
    REQUIRE(p.type == t && p.rank == m.rank && p.seq == m.seq && !p.echo,
            "header round trip %d", t);
    /* Since version 5: the frame is MACed with the token and never carries the token itself; a
     * change of any bit, or another token, fails the MAC. */
    REQUIRE(rpl_msg_authentic(bufs[t], n, m.token), "%s authentic", rpl_msg_type_name(t));
    for (size_t k = 0; k + RPL_TOKEN_LEN <= n; k++)
      REQUIRE(memcmp(bufs[t] + k, m.token, RPL_TOKEN_LEN) != 0, "token on the wire at %zu", k);
    for (size_t k = 0; k < n; k++)
      for (int bit = 0; bit < 8; bit += 3) {
        bufs[t][k] ^= (uint8_t)(1u << bit);
        REQUIRE(!rpl_msg_authentic(bufs[t], n, m.token), "%s: bit %d of byte %zu unchecked",
                rpl_msg_type_name(t), bit, k);
        bufs[t][k] ^= (uint8_t)(1u << bit);
      }
    uint8_t other[RPL_TOKEN_LEN];
    memcpy(other, m.token, RPL_TOKEN_LEN);
    other[3] ^= 0x40;
    REQUIRE(!rpl_msg_authentic(bufs[t], n, other), "another token");
    switch (t) {
      case RPL_MSG_HELLO:
        REQUIRE(p.nworkers == 16 && p.host_label == -5, "hello");
        REQUIRE(memcmp(p.nonce_w, m.nonce_w, RPL_NONCE_LEN) == 0 &&
                    memcmp(p.nonce_c, m.nonce_c, RPL_NONCE_LEN) == 0 && !rpl_msg_opening(&p),
                "hello nonces");
        break;
      case RPL_MSG_STATUS:
      case RPL_MSG_CHALLENGE:
        REQUIRE(memcmp(p.nonce_w, m.nonce_w, RPL_NONCE_LEN) == 0 &&
                    memcmp(p.nonce_c, m.nonce_c, RPL_NONCE_LEN) == 0 && !rpl_msg_opening(&p),
                "%s nonces", rpl_msg_type_name(t));
        break;
      case RPL_MSG_HELLO_ACK:
        REQUIRE(p.policy == RPL_POLICY_SMART && p.nworkers == 16 && p.heartbeat_ms == 250 &&
                    p.dead_ms == 2500, "hello_ack");
        break;
      case RPL_MSG_REQUEST: REQUIRE(p.round == m.round, "request"); break;
      case RPL_MSG_GROUP:
        REQUIRE(p.group_id == 77 && p.round == m.round && p.period == 4 && p.nmembers == 5,
                "group");
        for (int i = 0; i < 5; i++)
          REQUIRE(rpl_msg_member(&p, (uint32_t)i) == members[i], "member");
        REQUIRE(rpl_msg_member(&p, 5) == -1, "member out of range");
        break;
      case RPL_MSG_CANCEL:
        REQUIRE(p.group_id == 77 && p.culprit == 3 && p.reason == RPL_REASON_DEAD, "cancel");
        break;
      case RPL_MSG_DONE: REQUIRE(p.group_id == 77 && p.status == 2, "done"); break;
      case RPL_MSG_PASS: REQUIRE(p.round == m.round && p.period == 4, "pass"); break;
      case RPL_MSG_ERROR:
      case RPL_MSG_STATUS_REPLY:
        REQUIRE(p.text_len == 5 && memcmp(p.text, "hello", 5) == 0, "text");
        if (t == RPL_MSG_ERROR) REQUIRE(p.code == RPL_PERR_BAD_TOKEN, "code");
        break;
      default: break;
    }
    /* Every truncation and every extension fails. */
    for (size_t k = 0; k < n; k++)
      REQUIRE(rpl_msg_parse(bufs[t], k, 16, &p, &err) == RPL_ERR_INVALID, "%s truncated to %zu",
              rpl_msg_type_name(t), k);
    memcpy(buf, bufs[t], n);
    buf[n] = 0;
    REQUIRE(rpl_msg_parse(buf, n + 1, 16, &p, &err) == RPL_ERR_INVALID, "trailing byte");
  }
  /* Version 6 only: a peer of an earlier version (the token in clear, or no sessions) is
   * refused, whatever the message. */
  REQUIRE(RPL_PROTO_VERSION == 6 && bufs[RPL_MSG_HELLO][4] == 6, "version byte 6");
  size_t n;
  for (uint8_t v = 1; v < 6; v++) {
    memcpy(buf, bufs[RPL_MSG_HELLO], lens[RPL_MSG_HELLO]);
    buf[4] = v;
    REQUIRE(rpl_msg_parse(buf, lens[RPL_MSG_HELLO], 16, &p, &err) == RPL_ERR_INVALID &&
                strstr(err.msg, "version"), "version %u refused", v);
  }
  /* The echo flag: only on ERROR(BAD_TOKEN), which then carries the given MAC field as is
   * and is never authentic; on anything else it is malformed, and cannot be encoded. */
  memset(&m, 0, sizeof m);
  m.type = RPL_MSG_ERROR;
  m.code = RPL_PERR_BAD_TOKEN;
  m.seq = 5;
  m.echo = 1;
  memset(m.mac, 0xab, RPL_MAC_LEN);
  n = rpl_msg_encode(&m, NULL, buf, sizeof buf);
  REQUIRE(n == RPL_PROTO_HEADER + 4 && rpl_msg_parse(buf, n, 16, &p, &err) == RPL_OK && p.echo &&
              p.code == RPL_PERR_BAD_TOKEN && memcmp(p.mac, m.mac, RPL_MAC_LEN) == 0,
          "echoed BAD_TOKEN");
  REQUIRE(!rpl_msg_authentic(buf, n, m.token), "an echo is never authentic");
  m.code = RPL_PERR_BAD_RANK;
  REQUIRE(rpl_msg_encode(&m, NULL, buf, sizeof buf) == 0, "echo of another error refused");
  rpl_put32(buf + RPL_PROTO_HEADER, RPL_PERR_BAD_RANK);
  REQUIRE(rpl_msg_parse(buf, n, 16, &p, &err) == RPL_ERR_INVALID, "echoed BAD_RANK malformed");
  memcpy(buf, bufs[RPL_MSG_GROUP], lens[RPL_MSG_GROUP]);
  buf[6] = RPL_PROTO_FLAG_ECHO;
  REQUIRE(rpl_msg_parse(buf, lens[RPL_MSG_GROUP], 16, &p, &err) == RPL_ERR_INVALID,
          "echo flag on a GROUP");
  /* Ranks and members out of range for the job. */
  REQUIRE(rpl_msg_parse(bufs[RPL_MSG_REQUEST], lens[RPL_MSG_REQUEST], 7, &p, &err) ==
              RPL_ERR_INVALID, "rank 7 with 7 workers");
  REQUIRE(rpl_msg_parse(bufs[RPL_MSG_GROUP], lens[RPL_MSG_GROUP], 15, &p, &err) == RPL_ERR_INVALID,
          "member 15 with 15 workers");
  int unsorted[3] = {4, 2, 9};
  memset(&m, 0, sizeof m);
  m.type = RPL_MSG_GROUP;
  m.group_id = 1;
  m.nmembers = 3;
  n = enc(&m, unsorted, buf, sizeof buf);
  REQUIRE(rpl_msg_parse(buf, n, 16, &p, &err) == RPL_ERR_INVALID && strstr(err.msg, "sorted"),
          "unsorted members: %s", err.msg);
  int dup[3] = {2, 2, 9};
  n = enc(&m, dup, buf, sizeof buf);
  REQUIRE(rpl_msg_parse(buf, n, 16, &p, &err) == RPL_ERR_INVALID, "duplicate members");
  /* A worker message with rank -1, a huge claimed member count. */
  memcpy(buf, bufs[RPL_MSG_REQUEST], lens[RPL_MSG_REQUEST]);
  memset(buf + 12, 0xff, 4);
  REQUIRE(rpl_msg_parse(buf, lens[RPL_MSG_REQUEST], 16, &p, &err) == RPL_ERR_INVALID, "rank -1");
  memcpy(buf, bufs[RPL_MSG_GROUP], lens[RPL_MSG_GROUP]);
  memset(buf + RPL_PROTO_HEADER + 20, 0xff, 4);
  REQUIRE(rpl_msg_parse(buf, lens[RPL_MSG_GROUP], 16, &p, &err) == RPL_ERR_INVALID, "nmembers");
  /* A period below what the message means: GROUP needs 1 or more, PASS 2 or more (a pass at
   * period 1 would be a round nobody meant to skip). */
  memcpy(buf, bufs[RPL_MSG_GROUP], lens[RPL_MSG_GROUP]);
  memset(buf + RPL_PROTO_HEADER + 16, 0, 4);
  REQUIRE(rpl_msg_parse(buf, lens[RPL_MSG_GROUP], 16, &p, &err) == RPL_ERR_INVALID, "group period");
  memcpy(buf, bufs[RPL_MSG_PASS], lens[RPL_MSG_PASS]);
  buf[RPL_PROTO_HEADER + 8] = 1;
  memset(buf + RPL_PROTO_HEADER + 9, 0, 3);
  REQUIRE(rpl_msg_parse(buf, lens[RPL_MSG_PASS], 16, &p, &err) == RPL_ERR_INVALID, "pass period 1");
  /* Sessions: an opening has no coordinator nonce (a CHALLENGE without one is malformed); a
   * session's key is its own for every type, rank and nonce, and is not the token. */
  memset(&m, 0, sizeof m);
  m.type = RPL_MSG_CHALLENGE;
  m.rank = 2;
  n = rpl_msg_encode(&m, NULL, buf, sizeof buf);
  REQUIRE(n && rpl_msg_parse(buf, n, 16, &p, &err) == RPL_ERR_INVALID, "challenge without nonce");
  m.type = RPL_MSG_HELLO;
  m.nworkers = 4;
  n = rpl_msg_encode(&m, NULL, buf, sizeof buf);
  REQUIRE(rpl_msg_parse(buf, n, 16, &p, &err) == RPL_OK && rpl_msg_opening(&p), "opening");
  {
    uint8_t tk[RPL_TOKEN_LEN] = {1, 2, 3}, nw[RPL_NONCE_LEN] = {4}, nc[RPL_NONCE_LEN] = {5};
    uint8_t keys[6][RPL_TOKEN_LEN];
    rpl_session_key(tk, RPL_MSG_HELLO, 1, nw, nc, keys[0]);
    rpl_session_key(tk, RPL_MSG_STATUS, 1, nw, nc, keys[1]);
    rpl_session_key(tk, RPL_MSG_HELLO, 2, nw, nc, keys[2]);
    nw[15] = 1;
    rpl_session_key(tk, RPL_MSG_HELLO, 1, nw, nc, keys[3]);
    nc[15] = 1;
    rpl_session_key(tk, RPL_MSG_HELLO, 1, nw, nc, keys[4]);
    memcpy(keys[5], tk, RPL_TOKEN_LEN);
    for (int i = 0; i < 6; i++)
      for (int j = i + 1; j < 6; j++)
        REQUIRE(memcmp(keys[i], keys[j], RPL_TOKEN_LEN) != 0, "session keys %d and %d", i, j);
  }
  /* Direction: the MAC covers a label for the direction ('W' from workers and tools, 'C' from
   * the coordinator) before the header and body, so it is not the plain HMAC of the bytes. */
  for (int t = 1; t <= RPL_MSG_TYPE_MAX; t++) {
    const uint8_t *b = bufs[t];
    uint8_t dir = t == RPL_MSG_HELLO || t == RPL_MSG_REQUEST || t == RPL_MSG_DONE ||
                          t == RPL_MSG_HEARTBEAT || t == RPL_MSG_FENCE ||
                          t == RPL_MSG_UNFENCE || t == RPL_MSG_LEAVE || t == RPL_MSG_STATUS
                      ? 'W'
                      : 'C';
    unsigned char full[RPL_SHA256_LEN];
    const void *parts[3] = {&dir, b, b + RPL_PROTO_HEADER};
    size_t plens[3] = {1, 20, lens[t] - RPL_PROTO_HEADER};
    uint8_t tk[RPL_TOKEN_LEN];
    for (int i = 0; i < RPL_TOKEN_LEN; i++) tk[i] = (uint8_t)(i * 17 + 1); /* enc()'s token */
    rpl_hmac_sha256(tk, RPL_TOKEN_LEN, parts, plens, 3, full);
    REQUIRE(memcmp(full, b + 20, RPL_MAC_LEN) == 0, "%s: MAC with its direction",
            rpl_msg_type_name(t));
    rpl_hmac_sha256(tk, RPL_TOKEN_LEN, parts + 1, plens + 1, 2, full);
    REQUIRE(memcmp(full, b + 20, RPL_MAC_LEN) != 0, "%s: MAC without a direction",
            rpl_msg_type_name(t));
  }
  /* Random corruption of valid messages never crashes (ASan/UBSan watch the reads). */
  uint64_t s = 99;
  int accepted = 0;
  for (int iter = 0; iter < 200000; iter++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    int t = 1 + (int)((s >> 40) % RPL_MSG_TYPE_MAX);
    size_t len = lens[t];
    memcpy(buf, bufs[t], len);
    int flips = 1 + (int)((s >> 20) % 4);
    for (int f = 0; f < flips; f++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      buf[(s >> 33) % len] ^= (uint8_t)(1u << ((s >> 13) % 8));
    }
    if ((s >> 7) % 5 == 0) len = (size_t)((s >> 50) % (len + 1));
    /* Copy into an exact-size heap block so any overread is caught. */
    uint8_t *h = malloc(len ? len : 1);
    memcpy(h, buf, len);
    if (rpl_msg_parse(h, len, 16, &p, &err) == RPL_OK) {
      accepted++;
      for (uint32_t i = 0; i < p.nmembers; i++) REQUIRE(rpl_msg_member(&p, i) < 16, "member range");
    }
    free(h);
  }
  REQUIRE(accepted > 0, "some corrupted messages (e.g. flipped tokens) are still well-formed");
  /* Tokens. */
  uint8_t tok[RPL_TOKEN_LEN], tok2[RPL_TOKEN_LEN];
  char hex[2 * RPL_TOKEN_LEN + 1];
  REQUIRE(rpl_token_generate(tok, &err) == RPL_OK, "%s", err.msg);
  rpl_token_to_hex(tok, hex);
  REQUIRE(rpl_token_from_hex(hex, tok2, &err) == RPL_OK && rpl_token_equal(tok, tok2), "hex");
  tok2[15] ^= 1;
  REQUIRE(!rpl_token_equal(tok, tok2), "token compare");
  REQUIRE(rpl_token_from_hex("abc", tok2, &err) == RPL_ERR_INVALID, "short hex");
  REQUIRE(rpl_token_from_hex("zz112233445566778899aabbccddeeff", tok2, &err) == RPL_ERR_INVALID,
          "bad hex");
  return report("test_sched_proto");
}
