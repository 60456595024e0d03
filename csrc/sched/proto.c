/* The coordinator's wire protocol: fixed little-endian layouts, parsed with explicit bounds
 * checks (fuzzed by fuzz/). The layout is documented in coordinator/PROTOCOL.md. */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "bytes.h"
#include "crypto.h"
#include "sched_internal.h"

const char *rpl_msg_type_name(int t) {
  static const char *names[] = {"?",         "HELLO",  "HELLO_ACK", "REQUEST",      "GROUP",
                                "CANCEL",    "DONE",   "HEARTBEAT", "HEARTBEAT_ACK", "FENCE",
                                "UNFENCE",   "LEAVE",  "ACK",       "STATUS",       "STATUS_REPLY",
                                "ERROR",     "PASS",   "CHALLENGE"};
  return (t >= 1 && t <= RPL_MSG_TYPE_MAX) ? names[t] : "?";
}

/* Fixed body size per type; -1 = variable (checked by the type's own rule). */
static long fixed_body(int type) {
  switch (type) {
    case RPL_MSG_HELLO: return 8 + 2 * RPL_NONCE_LEN;
    case RPL_MSG_HELLO_ACK: return 16;
    case RPL_MSG_STATUS:
    case RPL_MSG_CHALLENGE: return 2 * RPL_NONCE_LEN;
    case RPL_MSG_REQUEST: return 8;
    case RPL_MSG_CANCEL: return 24;
    case RPL_MSG_PASS: return 16;
    case RPL_MSG_DONE: return 12;
    case RPL_MSG_HEARTBEAT:
    case RPL_MSG_HEARTBEAT_ACK:
    case RPL_MSG_FENCE:
    case RPL_MSG_UNFENCE:
    case RPL_MSG_LEAVE:
    case RPL_MSG_ACK: return 0;
    default: return -1;
  }
}

static int from_worker(int type) {
  return type == RPL_MSG_HELLO || type == RPL_MSG_REQUEST || type == RPL_MSG_DONE ||
         type == RPL_MSG_HEARTBEAT || type == RPL_MSG_FENCE || type == RPL_MSG_UNFENCE ||
         type == RPL_MSG_LEAVE;
}

static int nonce_zero(const uint8_t nonce[RPL_NONCE_LEN]) {
  uint8_t any = 0;
  for (int i = 0; i < RPL_NONCE_LEN; i++) any |= nonce[i];
  return any == 0;
}

/* The direction label in every MAC: what workers and tools send, or what the coordinator
 * sends. A message's MAC is valid for one direction only. */
static uint8_t direction(int type) {
  return from_worker(type) || type == RPL_MSG_STATUS ? 'W' : 'C';
}

/* The header: magic, version, type, flags, body length, rank, sequence number and MAC. Sets
 * m's header fields and *body (the body's length) on RPL_OK. */
static rpl_status parse_header(const uint8_t *p, size_t len, int maxw, rpl_msg *m,
                               uint32_t *body_len, rpl_error *err) {
  if (!p || len < RPL_PROTO_HEADER)
    return rpl_fail(err, RPL_ERR_INVALID, "message of %zu bytes, shorter than the %d-byte "
                    "header", len, RPL_PROTO_HEADER);
  if (rpl_get32(p) != RPL_PROTO_MAGIC)
    return rpl_fail(err, RPL_ERR_INVALID, "bad magic 0x%08x", rpl_get32(p));
  if (p[4] != RPL_PROTO_VERSION)
    return rpl_fail(err, RPL_ERR_INVALID, "protocol version %u, this side speaks %d",
                    p[4], RPL_PROTO_VERSION);
  int type = p[5];
  if (type < 1 || type > RPL_MSG_TYPE_MAX)
    return rpl_fail(err, RPL_ERR_INVALID, "unknown message type %d", type);
  uint16_t flags = rpl_get16(p + 6);
  if (flags != 0 && !(flags == RPL_PROTO_FLAG_ECHO && type == RPL_MSG_ERROR))
    return rpl_fail(err, RPL_ERR_INVALID, "%s: flags 0x%04x", rpl_msg_type_name(type), flags);
  uint32_t body = rpl_get32(p + 8);
  if (body > RPL_PROTO_MAX_BODY || (size_t)body != len - RPL_PROTO_HEADER)
    return rpl_fail(err, RPL_ERR_INVALID, "%s: body length %u, message carries %zu",
                    rpl_msg_type_name(type), body, len - RPL_PROTO_HEADER);
  m->type = (uint8_t)type;
  m->rank = (int32_t)rpl_get32(p + 12);
  m->seq = rpl_get32(p + 16);
  memcpy(m->mac, p + 20, RPL_MAC_LEN);
  m->echo = flags == RPL_PROTO_FLAG_ECHO;
  if (m->rank < -1 || m->rank >= maxw || (from_worker(type) && m->rank < 0))
    return rpl_fail(err, RPL_ERR_INVALID, "%s: rank %d out of range [0, %d)",
                    rpl_msg_type_name(type), (int)m->rank, maxw);
  long fixed = fixed_body(type);
  if (fixed >= 0 && body != (uint32_t)fixed)
    return rpl_fail(err, RPL_ERR_INVALID, "%s: body of %u bytes, expected %ld",
                    rpl_msg_type_name(type), body, fixed);
  *body_len = body;
  return RPL_OK;
}

static rpl_status parse_hello_ack(const uint8_t *b, rpl_msg *m, rpl_error *err) {
  m->policy = b[0];
  if (b[1] || b[2] || b[3])
    return rpl_fail(err, RPL_ERR_INVALID, "HELLO_ACK: non-zero padding");
  if (m->policy >= RPL_POLICY_COUNT)
    return rpl_fail(err, RPL_ERR_INVALID, "HELLO_ACK: unknown policy %u", m->policy);
  m->nworkers = (int32_t)rpl_get32(b + 4);
  m->heartbeat_ms = rpl_get32(b + 8);
  m->dead_ms = rpl_get32(b + 12);
  if (m->nworkers < 1 || m->nworkers > RPL_SCHED_MAX_WORKERS)
    return rpl_fail(err, RPL_ERR_INVALID, "HELLO_ACK: nworkers %d out of range",
                    (int)m->nworkers);
  return RPL_OK;
}

/* GROUP's body: ids, period, and its members (sorted, unique, in range; read in place). */
static rpl_status parse_group(const uint8_t *b, uint32_t body, int maxw, rpl_msg *m,
                              rpl_error *err) {
  if (body < 24)
    return rpl_fail(err, RPL_ERR_INVALID, "GROUP: body of %u bytes, at least 24", body);
  m->group_id = rpl_get64(b);
  m->round = rpl_get64(b + 8);
  m->period = rpl_get32(b + 16);
  m->nmembers = rpl_get32(b + 20);
  if (m->nmembers < 1 || m->nmembers > (uint32_t)maxw ||
      (uint64_t)body != 24 + 4 * (uint64_t)m->nmembers)
    return rpl_fail(err, RPL_ERR_INVALID, "GROUP: %u members in a %u-byte body",
                    m->nmembers, body);
  if (m->period < 1)
    return rpl_fail(err, RPL_ERR_INVALID, "GROUP: period 0");
  m->members_le = b + 24;
  int32_t prev = -1;
  for (uint32_t i = 0; i < m->nmembers; i++) {
    int32_t r = rpl_msg_member(m, i);
    if (r <= prev || r >= maxw)
      return rpl_fail(err, RPL_ERR_INVALID,
                      "GROUP: member %u is %d: members must be sorted, unique and in "
                      "[0, %d)", i, (int)r, maxw);
    prev = r;
  }
  if (m->group_id == 0)
    return rpl_fail(err, RPL_ERR_INVALID, "GROUP: group id 0");
  return RPL_OK;
}

static rpl_status parse_error_body(const uint8_t *b, uint32_t body, rpl_msg *m,
                                   rpl_error *err) {
  if (body < 4 || body - 4 > RPL_PROTO_MAX_TEXT)
    return rpl_fail(err, RPL_ERR_INVALID, "ERROR: body of %u bytes", body);
  m->code = rpl_get32(b);
  m->text = (const char *)b + 4;
  m->text_len = body - 4;
  if (m->echo && m->code != RPL_PERR_BAD_TOKEN)
    return rpl_fail(err, RPL_ERR_INVALID, "ERROR %u: only BAD_TOKEN may be echoed", m->code);
  return RPL_OK;
}

/* The body of m->type (its length already checked against the type's fixed size). */
static rpl_status parse_body(const uint8_t *b, uint32_t body, int maxw, rpl_msg *m,
                             rpl_error *err) {
  switch (m->type) {
    case RPL_MSG_HELLO:
      m->nworkers = (int32_t)rpl_get32(b);
      m->host_label = (int32_t)rpl_get32(b + 4);
      memcpy(m->nonce_w, b + 8, RPL_NONCE_LEN);
      memcpy(m->nonce_c, b + 8 + RPL_NONCE_LEN, RPL_NONCE_LEN);
      if (m->nworkers < 1 || m->nworkers > RPL_SCHED_MAX_WORKERS)
        return rpl_fail(err, RPL_ERR_INVALID, "HELLO: nworkers %d out of range",
                        (int)m->nworkers);
      break;
    case RPL_MSG_STATUS:
    case RPL_MSG_CHALLENGE:
      memcpy(m->nonce_w, b, RPL_NONCE_LEN);
      memcpy(m->nonce_c, b + RPL_NONCE_LEN, RPL_NONCE_LEN);
      if (m->type == RPL_MSG_CHALLENGE && nonce_zero(m->nonce_c))
        return rpl_fail(err, RPL_ERR_INVALID, "CHALLENGE: no coordinator nonce");
      break;
    case RPL_MSG_HELLO_ACK: return parse_hello_ack(b, m, err);
    case RPL_MSG_REQUEST:
      m->round = rpl_get64(b);
      break;
    case RPL_MSG_GROUP: return parse_group(b, body, maxw, m, err);
    case RPL_MSG_CANCEL:
      m->group_id = rpl_get64(b);
      m->round = rpl_get64(b + 8);
      m->culprit = (int32_t)rpl_get32(b + 16);
      m->reason = rpl_get32(b + 20);
      if (m->culprit < -1 || m->culprit >= maxw || m->reason > RPL_REASON_DEAD)
        return rpl_fail(err, RPL_ERR_INVALID, "CANCEL: culprit %d / reason %u invalid",
                        (int)m->culprit, m->reason);
      break;
    case RPL_MSG_DONE:
      m->group_id = rpl_get64(b);
      m->status = rpl_get32(b + 8);
      break;
    case RPL_MSG_PASS:
      m->round = rpl_get64(b);
      m->period = rpl_get32(b + 8);
      if (m->period < 2 || rpl_get32(b + 12))
        return rpl_fail(err, RPL_ERR_INVALID, "PASS: period %u (at least 2) or padding",
                        m->period);
      break;
    case RPL_MSG_STATUS_REPLY:
      m->text = (const char *)b;
      m->text_len = body;
      break;
    case RPL_MSG_ERROR: return parse_error_body(b, body, m, err);
    default:
      break;
  }
  return RPL_OK;
}

rpl_status rpl_msg_parse(const void *buf, size_t len, int max_workers, rpl_msg *m,
                         rpl_error *err) {
  const uint8_t *p = buf;
  memset(m, 0, sizeof *m);
  int maxw = (max_workers > 0 && max_workers <= RPL_SCHED_MAX_WORKERS) ? max_workers
                                                                      : RPL_SCHED_MAX_WORKERS;
  uint32_t body = 0;
  rpl_status st = parse_header(p, len, maxw, m, &body, err);
  if (st != RPL_OK) return st;
  return parse_body(p + RPL_PROTO_HEADER, body, maxw, m, err);
}

/* The MAC covers everything but itself: the direction, the header's first 20 bytes and the
 * body. */
static void compute_mac(const uint8_t *p, size_t len, const uint8_t key[RPL_TOKEN_LEN],
                        uint8_t mac[RPL_MAC_LEN]) {
  uint8_t dir = direction(p[5]);
  const void *parts[3] = {&dir, p, p + RPL_PROTO_HEADER};
  size_t lens[3] = {1, 20, len - RPL_PROTO_HEADER};
  unsigned char full[RPL_SHA256_LEN];
  rpl_hmac_sha256(key, RPL_TOKEN_LEN, parts, lens, 3, full);
  memcpy(mac, full, RPL_MAC_LEN);
}

void rpl_msg_sign(void *buf, size_t len, const uint8_t key[RPL_TOKEN_LEN]) {
  if (buf && len >= RPL_PROTO_HEADER) compute_mac(buf, len, key, (uint8_t *)buf + 20);
}

int rpl_msg_authentic(const void *buf, size_t len, const uint8_t key[RPL_TOKEN_LEN]) {
  const uint8_t *p = buf;
  if (!buf || len < RPL_PROTO_HEADER || rpl_get16(p + 6) != 0) return 0;
  uint8_t mac[RPL_MAC_LEN];
  compute_mac(p, len, key, mac);
  return rpl_ct_equal(mac, p + 20, RPL_MAC_LEN);
}

int rpl_msg_opening(const rpl_msg *m) {
  return (m->type == RPL_MSG_HELLO || m->type == RPL_MSG_STATUS) && nonce_zero(m->nonce_c);
}

void rpl_session_key(const uint8_t token[RPL_TOKEN_LEN], int type, int32_t rank,
                     const uint8_t nonce_w[RPL_NONCE_LEN], const uint8_t nonce_c[RPL_NONCE_LEN],
                     uint8_t key[RPL_TOKEN_LEN]) {
  static const char worker[] = "ripples session v6", status[] = "ripples status v6";
  const char *label = type == RPL_MSG_HELLO ? worker : status;
  uint8_t r[4];
  rpl_put32(r, (uint32_t)rank);
  const void *parts[4] = {label, r, nonce_w, nonce_c};
  size_t lens[4] = {strlen(label) + 1, 4, RPL_NONCE_LEN, RPL_NONCE_LEN};
  unsigned char full[RPL_SHA256_LEN];
  rpl_hmac_sha256(token, RPL_TOKEN_LEN, parts, lens, 4, full);
  memcpy(key, full, RPL_TOKEN_LEN);
}

int32_t rpl_msg_member(const rpl_msg *m, uint32_t i) {
  if (!m->members_le || i >= m->nmembers) return -1;
  return (int32_t)rpl_get32(m->members_le + 4 * (size_t)i);
}

size_t rpl_msg_encoded_size(const rpl_msg *m) {
  long fixed = fixed_body(m->type);
  if (fixed >= 0) return RPL_PROTO_HEADER + (size_t)fixed;
  switch (m->type) {
    case RPL_MSG_GROUP: return RPL_PROTO_HEADER + 24 + 4 * (size_t)m->nmembers;
    case RPL_MSG_STATUS_REPLY: return RPL_PROTO_HEADER + (size_t)m->text_len;
    case RPL_MSG_ERROR:
      return RPL_PROTO_HEADER + 4 +
             (size_t)(m->text_len > RPL_PROTO_MAX_TEXT ? RPL_PROTO_MAX_TEXT : m->text_len);
    default: return 0;
  }
}

size_t rpl_msg_encode(const rpl_msg *m, const int *members, void *out, size_t cap) {
  size_t need = rpl_msg_encoded_size(m);
  if (need == 0 || need > cap || need - RPL_PROTO_HEADER > RPL_PROTO_MAX_BODY) return 0;
  if (m->type == RPL_MSG_GROUP && (m->nmembers == 0 || !members)) return 0;
  if (m->echo && !(m->type == RPL_MSG_ERROR && m->code == RPL_PERR_BAD_TOKEN)) return 0;
  uint8_t *p = out;
  memset(p, 0, need);
  rpl_put32(p, RPL_PROTO_MAGIC);
  p[4] = RPL_PROTO_VERSION;
  p[5] = m->type;
  rpl_put16(p + 6, m->echo ? RPL_PROTO_FLAG_ECHO : 0);
  rpl_put32(p + 8, (uint32_t)(need - RPL_PROTO_HEADER));
  rpl_put32(p + 12, (uint32_t)m->rank);
  rpl_put32(p + 16, m->seq);
  uint8_t *b = p + RPL_PROTO_HEADER;
  switch (m->type) {
    case RPL_MSG_HELLO:
      rpl_put32(b, (uint32_t)m->nworkers);
      rpl_put32(b + 4, (uint32_t)m->host_label);
      memcpy(b + 8, m->nonce_w, RPL_NONCE_LEN);
      memcpy(b + 8 + RPL_NONCE_LEN, m->nonce_c, RPL_NONCE_LEN);
      break;
    case RPL_MSG_STATUS:
    case RPL_MSG_CHALLENGE:
      memcpy(b, m->nonce_w, RPL_NONCE_LEN);
      memcpy(b + RPL_NONCE_LEN, m->nonce_c, RPL_NONCE_LEN);
      break;
    case RPL_MSG_HELLO_ACK:
      b[0] = m->policy;
      rpl_put32(b + 4, (uint32_t)m->nworkers);
      rpl_put32(b + 8, m->heartbeat_ms);
      rpl_put32(b + 12, m->dead_ms);
      break;
    case RPL_MSG_REQUEST: rpl_put64(b, m->round); break;
    case RPL_MSG_GROUP:
      rpl_put64(b, m->group_id);
      rpl_put64(b + 8, m->round);
      rpl_put32(b + 16, m->period ? m->period : 1);
      rpl_put32(b + 20, m->nmembers);
      for (uint32_t i = 0; i < m->nmembers; i++)
        rpl_put32(b + 24 + 4 * (size_t)i, (uint32_t)members[i]);
      break;
    case RPL_MSG_PASS:
      rpl_put64(b, m->round);
      rpl_put32(b + 8, m->period);
      break;
    case RPL_MSG_CANCEL:
      rpl_put64(b, m->group_id);
      rpl_put64(b + 8, m->round);
      rpl_put32(b + 16, (uint32_t)m->culprit);
      rpl_put32(b + 20, m->reason);
      break;
    case RPL_MSG_DONE:
      rpl_put64(b, m->group_id);
      rpl_put32(b + 8, m->status);
      break;
    case RPL_MSG_STATUS_REPLY:
      if (m->text_len) memcpy(b, m->text, m->text_len);
      break;
    case RPL_MSG_ERROR:
      rpl_put32(b, m->code);
      if (need > RPL_PROTO_HEADER + 4) memcpy(b + 4, m->text, need - RPL_PROTO_HEADER - 4);
      break;
    default: break;
  }
  if (m->echo) memcpy(p + 20, m->mac, RPL_MAC_LEN);
  else rpl_msg_sign(p, need, m->token);
  return need;
}

void rpl_token_to_hex(const uint8_t token[RPL_TOKEN_LEN], char hex[2 * RPL_TOKEN_LEN + 1]) {
  static const char digits[] = "0123456789abcdef";
  for (int i = 0; i < RPL_TOKEN_LEN; i++) {
    hex[2 * i] = digits[token[i] >> 4];
    hex[2 * i + 1] = digits[token[i] & 15];
  }
  hex[2 * RPL_TOKEN_LEN] = '\0';
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

rpl_status rpl_token_from_hex(const char *hex, uint8_t token[RPL_TOKEN_LEN], rpl_error *err) {
  int ok = hex && strlen(hex) == 2 * RPL_TOKEN_LEN;
  for (int i = 0; ok && i < RPL_TOKEN_LEN; i++) {
    int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
    ok = hi >= 0 && lo >= 0;
    if (ok) token[i] = (uint8_t)(hi << 4 | lo);
  }
  if (!ok)
    return rpl_fail(err, RPL_ERR_INVALID, "job token must be %d hex digits", 2 * RPL_TOKEN_LEN);
  return RPL_OK;
}

rpl_status rpl_token_generate(uint8_t token[RPL_TOKEN_LEN], rpl_error *err) {
  size_t got = 0;
  while (got < RPL_TOKEN_LEN) {
    ssize_t r = getrandom(token + got, RPL_TOKEN_LEN - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return rpl_fail(err, RPL_ERR_SYSTEM, "getrandom: %s", strerror(errno));
    }
    got += (size_t)r;
  }
  return RPL_OK;
}

int rpl_token_equal(const uint8_t a[RPL_TOKEN_LEN], const uint8_t b[RPL_TOKEN_LEN]) {
  uint8_t diff = 0;
  for (int i = 0; i < RPL_TOKEN_LEN; i++) diff |= (uint8_t)(a[i] ^ b[i]);
  return diff == 0;
}
