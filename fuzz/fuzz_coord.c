/* Fuzz target for the coordinator's input path: the protocol parser and the message handler
 * (policy included) behind it. Input: a policy byte, then messages, each prefixed by a 2-byte
 * little-endian length and a route byte (bits 0-2: which client, bit 3: its heartbeat socket,
 * bits 4-7: time since the previous message in 50 ms steps; length bit 15: the harness MACs
 * the message after mutation, as a client holding the token would). The harness plays the
 * client's half of sessions: a signed answer to a challenge gets the coordinator's last
 * challenge for its rank put in and is MACed with the session's key, and a signed worker
 * message with its rank's session key, so mutations reach registered workers, groups and
 * rebinding. Oracles: every reply parses; a reply is the echo of a stranger's MAC, or is
 * MACed with the token (only CHALLENGE and ERROR) or with a key of a session the harness
 * opened; no reply carries the token's bytes; every log line is one line of printable text
 * without the token; and the status document (with host names full of quotes and control
 * bytes) renders as the --status table.
 *
 * libFuzzer (clang):   fuzz/run_libfuzzer.sh [seconds]
 * Standalone (any cc): fuzz_coord_smoke [iterations] | --write-corpus DIR | FILE...
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_core.h"

#define FUZZ_WORKERS 6
static const char *FUZZ_TOKEN = "f00dfeedc0ffee11deadbeef42a5c3e7";
static uint8_t g_token[RPL_TOKEN_LEN];
static const uint8_t *g_msg; /* the message being handled */
static size_t g_msg_len;
/* The client's half of sessions, per rank (index rank + 1: -1 is a tool's status query): the
 * last challenge the coordinator sent (type: HELLO 0, STATUS 1), the key of the last answer
 * the harness MACed, and the keys of sessions opened (HELLO_ACK seen). */
typedef struct {
  uint8_t nonce_w[RPL_NONCE_LEN], nonce_c[RPL_NONCE_LEN];
  int set;
} challenge_t;
static challenge_t g_challenge[FUZZ_WORKERS + 1][2];
static uint8_t g_answer_key[FUZZ_WORKERS + 1][2][RPL_TOKEN_LEN];
static uint8_t g_key[FUZZ_WORKERS + 1][RPL_TOKEN_LEN];
static int g_open[FUZZ_WORKERS + 1];

static int keyed(const void *msg, size_t len, int32_t rank) {
  if (rank < -1 || rank >= FUZZ_WORKERS) return 0;
  int i = rank + 1;
  return (g_open[i] && rpl_msg_authentic(msg, len, g_key[i])) ||
         rpl_msg_authentic(msg, len, g_answer_key[i][0]) ||
         rpl_msg_authentic(msg, len, g_answer_key[i][1]);
}

static int contains(const uint8_t *hay, size_t n, const uint8_t *needle, size_t k) {
  for (size_t i = 0; i + k <= n; i++)
    if (memcmp(hay + i, needle, k) == 0) return 1;
  return 0;
}

static int check_reply(void *ctx, const uint8_t *route, size_t route_len, const void *msg,
                       size_t len) {
  (void)ctx;
  (void)route;
  (void)route_len;
  rpl_msg m;
  rpl_error err;
  if (rpl_msg_parse(msg, len, FUZZ_WORKERS, &m, &err) != RPL_OK) {
    fprintf(stderr, "coordinator produced an unparsable reply: %s\n", err.msg);
    abort();
  }
  if (m.echo) { /* the refusal of a stranger: the echo of its MAC field, unauthenticated */
    if (m.type != RPL_MSG_ERROR || m.code != RPL_PERR_BAD_TOKEN || !g_msg ||
        g_msg_len < RPL_PROTO_HEADER || memcmp(m.mac, g_msg + 20, RPL_MAC_LEN) != 0 ||
        rpl_msg_authentic(g_msg, g_msg_len, g_token)) {
      fprintf(stderr, "coordinator's echo is not the refusal of a stranger's MAC\n");
      abort();
    }
  } else if (rpl_msg_authentic(msg, len, g_token)) {
    if (m.type != RPL_MSG_CHALLENGE && m.type != RPL_MSG_ERROR) {
      fprintf(stderr, "coordinator sent a %s MACed with the token\n", rpl_msg_type_name(m.type));
      abort();
    }
  } else if (!keyed(msg, len, m.rank)) {
    fprintf(stderr, "coordinator sent a %s without a valid MAC\n", rpl_msg_type_name(m.type));
    abort();
  }
  if (m.type == RPL_MSG_CHALLENGE && m.rank >= -1 && m.rank < FUZZ_WORKERS && g_msg &&
      g_msg_len > 5) {
    challenge_t *c = &g_challenge[m.rank + 1][g_msg[5] == RPL_MSG_STATUS];
    memcpy(c->nonce_w, m.nonce_w, RPL_NONCE_LEN);
    memcpy(c->nonce_c, m.nonce_c, RPL_NONCE_LEN);
    c->set = 1;
  }
  if (m.type == RPL_MSG_HELLO_ACK && m.rank >= 0 && m.rank < FUZZ_WORKERS &&
      rpl_msg_authentic(msg, len, g_answer_key[m.rank + 1][0])) {
    memcpy(g_key[m.rank + 1], g_answer_key[m.rank + 1][0], RPL_TOKEN_LEN);
    g_open[m.rank + 1] = 1;
  }
  if (contains(msg, len, g_token, RPL_TOKEN_LEN) &&
      !(g_msg && contains(g_msg, g_msg_len, g_token, RPL_TOKEN_LEN))) {
    fprintf(stderr, "coordinator sent its job token\n");
    abort();
  }
  return 0;
}

/* The slow/recovered lines (coord_straggler.c): one printable line each, never the token. */
static void check_log(void *ctx, const char *line) {
  (void)ctx;
  size_t n = strlen(line);
  if (n == 0 || line[n - 1] != '\n') {
    fprintf(stderr, "coordinator log line not ended by a newline: %s\n", line);
    abort();
  }
  for (size_t i = 0; i + 1 < n; i++)
    if ((unsigned char)line[i] < 0x20 || (unsigned char)line[i] > 0x7e) {
      fprintf(stderr, "coordinator log line with byte 0x%02x\n", (unsigned char)line[i]);
      abort();
    }
  if (strstr(line, FUZZ_TOKEN)) {
    fprintf(stderr, "coordinator logged its token\n");
    abort();
  }
}

/* MACs msg as a client holding the token would: an opening with the token; an answer to a
 * challenge with the coordinator's last challenge for its rank put in, with the key it
 * derives; a worker message with its rank's session key (the token before one is open). */
static void client_sign(uint8_t *msg, size_t len) {
  rpl_msg m;
  rpl_error err;
  if (rpl_msg_parse(msg, len, FUZZ_WORKERS, &m, &err) != RPL_OK || m.rank < -1 ||
      m.rank >= FUZZ_WORKERS) {
    rpl_msg_sign(msg, len, g_token);
    return;
  }
  int i = m.rank + 1, status = m.type == RPL_MSG_STATUS;
  if ((m.type == RPL_MSG_HELLO || status) && !rpl_msg_opening(&m)) {
    challenge_t *c = &g_challenge[i][status];
    if (c->set) { /* the nonces sit at the end of the body */
      memcpy(msg + len - 2 * RPL_NONCE_LEN, c->nonce_w, RPL_NONCE_LEN);
      memcpy(msg + len - RPL_NONCE_LEN, c->nonce_c, RPL_NONCE_LEN);
    }
    const uint8_t *nw = msg + len - 2 * RPL_NONCE_LEN, *nc = msg + len - RPL_NONCE_LEN;
    rpl_session_key(g_token, m.type, m.rank, nw, nc, g_answer_key[i][status]);
    rpl_msg_sign(msg, len, g_answer_key[i][status]);
  } else if (m.type == RPL_MSG_HELLO || status || !g_open[i]) {
    rpl_msg_sign(msg, len, g_token);
  } else {
    rpl_msg_sign(msg, len, g_key[i]);
  }
}

/* Client k's routes as the real client names them ('R'/'H' + 16 bytes), or a short one. */
static size_t make_route(uint8_t sel, uint8_t *out) {
  int k = sel & 7;
  if (k == 7) {
    out[0] = 0;
    out[1] = 7;
    return 2;
  }
  out[0] = (sel & 8) ? RPL_ROUTE_HEARTBEAT : RPL_ROUTE_REQUEST;
  memset(out + 1, 0x10 + k, RPL_ROUTE_ID_LEN - 1);
  return RPL_ROUTE_ID_LEN;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* Parser alone, with several job sizes. */
  rpl_msg m;
  rpl_error err;
  for (int mw = 0; mw <= FUZZ_WORKERS; mw += 3) rpl_msg_parse(data, size, mw, &m, &err);
  if (size < 1) return 0;
  /* A fresh coordinator core per input; the first byte picks the policy and knobs. */
  rpl_coord_config cfg;
  memset(&cfg, 0, sizeof cfg);
  int host_of[FUZZ_WORKERS] = {0, 0, 0, 1, 1, 2};
  cfg.token_hex = FUZZ_TOKEN;
  cfg.gg.policy = (rpl_policy)(data[0] % RPL_POLICY_COUNT);
  cfg.gg.nworkers = FUZZ_WORKERS;
  cfg.gg.host_of = host_of;
  cfg.gg.group_size = 1 + (data[0] >> 2) % 4;
  cfg.gg.inter_intra = (data[0] >> 4) & 1;
  cfg.gg.c_thres = ((data[0] >> 5) & 1) ? -1 : 0;
  cfg.standby = (data[0] >> 6) & 1; /* a failover coordinator: every worker starts out dead */
  cfg.heartbeat_ms = 100;
  cfg.dead_ms = 1000;
  cfg.join_ms = -1;
  cfg.log = check_log;
  static const char *const names[FUZZ_WORKERS] = {"a", "b\"}", "\x01\xff\\u0000", "", NULL,
                                                  "a-very-long-host-name-that-goes-on-and-on-"
                                                  "and-on-beyond-sixty-four-bytes-of-text"};
  if (size > 1 && (data[1] & 1)) cfg.host_names = names; /* NULL entries: the label */
  coord_core core;
  if (coord_core_init(&core, &cfg, &err) != RPL_OK) abort();
  memset(g_challenge, 0, sizeof g_challenge);
  memset(g_answer_key, 0, sizeof g_answer_key);
  memset(g_open, 0, sizeof g_open);
  memcpy(g_token, core.token, RPL_TOKEN_LEN);
  core.send = check_reply;
  double now = 0;
  size_t pos = 1;
  while (pos + 3 <= size) {
    size_t len = ((size_t)data[pos] | (size_t)data[pos + 1] << 8) & 0x7fff;
    int sign = data[pos + 1] & 0x80;
    uint8_t sel = data[pos + 2];
    pos += 3;
    if (len > size - pos) len = size - pos;
    /* Copy so reads past the message are caught by ASan. */
    uint8_t *msg = malloc(len ? len : 1);
    memcpy(msg, data + pos, len);
    if (sign) client_sign(msg, len);
    uint8_t route[RPL_ROUTE_ID_LEN];
    size_t rl = make_route(sel, route);
    now += 0.05 * (sel >> 4);
    /* Whatever the clock alone decides goes out first (to bound workers, with the token);
     * then only the message's own replies are sent while it is handled. */
    coord_core_advance(&core, now);
    g_msg = msg;
    g_msg_len = len;
    coord_core_handle(&core, route, rl, msg, len, now);
    g_msg = NULL;
    free(msg);
    pos += len;
    coord_core_tick(&core, now);
  }
  size_t jl;
  char *json = coord_core_status_json(&core, now, &jl);
  char *table = NULL;
  if (json && rpl_coord_status_table(json, jl, &table, &err) != RPL_OK) {
    fprintf(stderr, "the status document does not render as a table: %s\n%s\n", err.msg, json);
    abort();
  }
  free(table);
  free(json);
  free(coord_core_rank_json(&core, 0, now, &jl));
  coord_core_free(&core);
  return 0;
}

#ifdef FUZZ_STANDALONE
#include "fuzz_standalone.h"

/* Seeds: every rank opens a session from its own route (an opening, then the answer to the
 * challenge), then a mix of what workers send (heartbeats from their own socket), rising
 * seqs; now and then a message with a wrong token (not re-MACed), a replayed seq or from
 * another rank's route. A status query is an opening or an answer. */
static size_t seed_messages(uint8_t *out, size_t cap, uint64_t pick) {
  static const int types[] = {RPL_MSG_REQUEST, RPL_MSG_REQUEST, RPL_MSG_DONE,
                              RPL_MSG_HEARTBEAT, RPL_MSG_FENCE, RPL_MSG_UNFENCE,
                              RPL_MSG_LEAVE, RPL_MSG_STATUS};
  size_t pos = 0;
  out[pos++] = (uint8_t)pick;
  uint32_t seq[FUZZ_WORKERS] = {0};
  for (int r = 0; r < FUZZ_WORKERS; r++)
    for (int answer = 0; answer < 2; answer++) {
      rpl_msg m = fuzz_msg(RPL_MSG_HELLO, r, ++seq[r], FUZZ_TOKEN);
      m.nworkers = FUZZ_WORKERS;
      m.nonce_w[0] = (uint8_t)(r + 1);
      m.nonce_c[0] = (uint8_t)answer; /* the harness puts the challenge in */
      uint8_t sel = (uint8_t)(r | 0x10);
      pos = fuzz_put_msg(out, pos, cap, &sel, 1, &m, NULL, 1);
    }
  uint64_t s = pick | 1;
  for (int i = 0; i < 24; i++) {
    s = fuzz_next(s);
    int type = types[(s >> 33) % 8], r = (int)((s >> 40) % FUZZ_WORKERS);
    int32_t rank = type == RPL_MSG_STATUS && (s >> 12) % 2 ? -1 : r; /* a rank's summary too */
    rpl_msg m = fuzz_msg(type, rank, ++seq[r], FUZZ_TOKEN);
    m.nonce_w[0] = 1;
    m.nonce_c[0] = (uint8_t)((s >> 14) % 2); /* a status query's opening or answer */
    m.round = (s >> 20) % 4;
    m.group_id = 1 + (s >> 24) % 6;
    uint8_t sel = (uint8_t)(r | ((s >> 50) % 3) << 4);
    if (m.type == RPL_MSG_HEARTBEAT) sel |= 8;
    int sign = 1;
    switch ((s >> 56) % 16) {
      case 0: m.token[(s >> 10) % RPL_TOKEN_LEN] ^= 1; sign = 0; break; /* a stranger's guess */
      case 4: sign = 0; break; /* a token holder's message, mutated on the way: MAC fails */
      case 1: m.seq = 1; break;                              /* a replay */
      case 2: sel = (uint8_t)((sel & ~7) | ((r + 1) % FUZZ_WORKERS)); break; /* another route */
      case 3: sel |= 0xf0; break;                            /* a long silence */
      default: break;
    }
    pos = fuzz_put_msg(out, pos, cap, &sel, 1, &m, NULL, sign);
  }
  return pos;
}

int main(int argc, char **argv) {
  return fuzz_standalone_main(argc, argv, "fuzz_coord", 64, seed_messages, 0x1234);
}
#endif
