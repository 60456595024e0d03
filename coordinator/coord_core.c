/* The coordinator's message handling, independent of ZeroMQ (see coord_core.h). Every input
 * is parsed by rpl_msg_parse (bounds-checked) before anything else looks at it; a message
 * that fails is counted and dropped without a reply. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bytes.h"
#include "common.h"
#include "coord_core.h"
#include "crypto.h"
#include "coord_text.h"

rpl_status coord_core_init(coord_core *core, const rpl_coord_config *cfg, rpl_error *err) {
  memset(core, 0, sizeof *core);
  rpl_status st;
  if (cfg->token_hex) st = rpl_token_from_hex(cfg->token_hex, core->token, err);
  else st = rpl_token_generate(core->token, err);
  if (st != RPL_OK) return st;
  rpl_token_to_hex(core->token, core->token_hex);
  st = rpl_random_bytes(core->secret, sizeof core->secret, err);
  if (st != RPL_OK) return st;
  if (cfg->heartbeat_ms < 0 || (cfg->heartbeat_ms > 0 &&
                                (cfg->heartbeat_ms < RPL_HEARTBEAT_MIN_MS ||
                                 cfg->heartbeat_ms > RPL_HEARTBEAT_MAX_MS)))
    return rpl_fail(err, RPL_ERR_INVALID,
                    "coordinator: heartbeat interval %d ms is outside [%d, %d] ms", cfg->heartbeat_ms,
                    RPL_HEARTBEAT_MIN_MS, RPL_HEARTBEAT_MAX_MS);
  int hb = cfg->heartbeat_ms > 0 ? cfg->heartbeat_ms : 1000;
  if (cfg->dead_ms < 0 || (cfg->dead_ms > 0 && ((long)cfg->dead_ms < (long)RPL_DEAD_MIN_BEATS * hb ||
                                                cfg->dead_ms > RPL_DEAD_MAX_MS)))
    return rpl_fail(err, RPL_ERR_INVALID,
                    "coordinator: dead_ms %d must lie in [%d, %d] ms: at least %d heartbeat "
                    "intervals of %d ms, or one late heartbeat declares a live worker dead",
                    cfg->dead_ms, RPL_DEAD_MIN_BEATS * hb, RPL_DEAD_MAX_MS, RPL_DEAD_MIN_BEATS, hb);
  rpl_gg_config g = cfg->gg;
  g.trace = NULL;
  g.trace_ctx = NULL;
  st = rpl_gg_create(&g, &core->gg, err);
  if (st != RPL_OK) return st;
  core->nworkers = g.nworkers;
  core->heartbeat_ms = cfg->heartbeat_ms > 0 ? (uint32_t)cfg->heartbeat_ms : 1000;
  core->dead_ms = cfg->dead_ms > 0 ? (uint32_t)cfg->dead_ms : 10 * core->heartbeat_ms;
  core->join_ms = cfg->join_ms == 0 ? 120000 : cfg->join_ms;
  core->w = calloc((size_t)core->nworkers, sizeof *core->w);
  core->members = malloc(sizeof(int) * (size_t)core->nworkers);
  core->gone = calloc((size_t)core->nworkers, sizeof *core->gone);
  core->out_cap = RPL_PROTO_HEADER + 20 + 4 * (size_t)core->nworkers + RPL_PROTO_MAX_TEXT + 4;
  core->out = malloc(core->out_cap);
  int attr_oom = coord_straggler_init(&core->attr, core->nworkers, cfg->host_names, cfg->log,
                                      cfg->log_ctx) != 0;
  if (!core->w || !core->members || !core->out || !core->gone || attr_oom) {
    coord_core_free(core);
    return rpl_fail(err, RPL_ERR_NOMEM, "coordinator: out of memory");
  }
  for (int i = 0; i < core->nworkers; i++) core->w[i].host_label = -1;
  if (cfg->standby) {
    /* Nobody has failed over to us yet: nobody may be drawn into a group or waited for. A
     * worker's first request takes it back (as for any dead worker). */
    for (int i = 0; i < core->nworkers; i++) {
      rpl_gg_dead(core->gg, i, err);
      core->gone[i] = 1;
    }
    core->standby = 1;
  }
  return RPL_OK;
}

static void drop_unsent(coord_worker *w) {
  free(w->unsent);
  w->unsent = NULL;
  w->unsent_len = 0;
}

void coord_core_free(coord_core *core) {
  for (int i = 0; core->w && i < core->nworkers; i++) drop_unsent(&core->w[i]);
  rpl_gg_destroy(core->gg);
  coord_straggler_free(&core->attr);
  free(core->w);
  free(core->members);
  free(core->out);
  free((void *)core->gone);
  core->gone = NULL;
  core->gg = NULL;
  core->w = NULL;
  core->members = NULL;
  core->out = NULL;
}

/* The only place replies are encoded: MACed with `key` (the session's, or the token for what
 * answers a session's opening), except the refusal of a message that failed its MAC (`echo`
 * non-NULL: that message's MAC field, sent back as is in an unauthenticated ERROR(BAD_TOKEN);
 * we cannot MAC for a token we do not know, and a MAC of ours over a stranger's chosen text
 * would hand it a MAC oracle). Returns the send result. */
static int reply(coord_core *core, const uint8_t *route, size_t route_len, rpl_msg *m,
                 const int *members, const uint8_t *key, const uint8_t *echo) {
  m->echo = echo != NULL;
  if (echo) memcpy(m->mac, echo, RPL_MAC_LEN);
  else memcpy(m->token, key, RPL_TOKEN_LEN);
  size_t len = rpl_msg_encode(m, members, core->out, core->out_cap);
  int rc = len == 0 ? -1 : core->send(core->send_ctx, route, route_len, core->out, len);
  if (rc != 0) atomic_fetch_add(&core->send_failures, 1);
  return rc;
}

/* A reply to `req`, zeroed but for its type and req's rank and seq: how the sender matches the
 * reply to what it sent. */
static rpl_msg answer_to(const rpl_msg *req, uint8_t type) {
  rpl_msg r;
  memset(&r, 0, sizeof r);
  r.type = type;
  r.rank = req->rank;
  r.seq = req->seq;
  return r;
}

/* Answers `req` with ERROR(code): MACed with `key`, but for BAD_TOKEN, which echoes req's
 * MAC (reply). */
static RPL_PRINTF(7, 8) void reply_error(coord_core *core, const uint8_t *route,
                                         size_t route_len, const rpl_msg *req,
                                         const uint8_t *key, uint32_t code, const char *fmt,
                                         ...) {
  char text[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof text) n = sizeof text - 1;
  rpl_msg m = answer_to(req, RPL_MSG_ERROR);
  m.code = code;
  m.text = text;
  m.text_len = (uint32_t)n;
  atomic_fetch_add(&core->errors_sent, 1);
  reply(core, route, route_len, &m, NULL, key, code == RPL_PERR_BAD_TOKEN ? req->mac : NULL);
}

/* A reply to worker w's bound route; a peer that is no longer connected (ZeroMQ knows) frees
 * the binding for a new registration at once. The answer to a request (GROUP, PASS, CANCEL)
 * that the worker's full queue refused is kept and sent again at each tick (resend_unsent):
 * dropped, it would leave the worker waiting out its whole request timeout. Its partners do
 * not wait that long: a GROUP that arrives late fails on every member alike. */
static void reply_worker(coord_core *core, coord_worker *w, rpl_msg *m, const int *members) {
  int rc = reply(core, w->route, w->route_len, m, members, w->key, NULL);
  int answer = m->type == RPL_MSG_GROUP || m->type == RPL_MSG_PASS || m->type == RPL_MSG_CANCEL;
  if (rc == COORD_SEND_GONE) w->unreachable = 1;
  if (rc != 0 && answer) {
    size_t len = rpl_msg_encode(m, members, core->out, core->out_cap);
    uint8_t *copy = len ? malloc(len) : NULL;
    if (copy) memcpy(copy, core->out, len);
    drop_unsent(w); /* only the latest answer matters: one request at a time */
    w->unsent = copy;
    w->unsent_len = copy ? len : 0;
  } else if (answer) {
    drop_unsent(w);
  }
}

static void resend_unsent(coord_core *core, coord_worker *w) {
  if (!w->unsent || !w->route_len) return;
  int rc = core->send(core->send_ctx, w->route, w->route_len, w->unsent, w->unsent_len);
  if (rc == 0 || rc == COORD_SEND_GONE) drop_unsent(w);
  if (rc == COORD_SEND_GONE) w->unreachable = 1;
}

/* Sends what the policy decided: groups to their members, cancellations to waiting ones. */
static void flush_events(coord_core *core, double now) {
  rpl_gg_event ev;
  while (rpl_gg_poll(core->gg, &ev, core->members, core->nworkers)) {
    coord_worker *w = &core->w[ev.worker];
    rpl_msg m;
    memset(&m, 0, sizeof m);
    m.rank = ev.worker;
    m.seq = w->req_seq;
    m.round = ev.round;
    m.group_id = ev.group_id;
    m.period = (uint32_t)ev.period;
    if (ev.kind == RPL_EV_GROUP) {
      m.type = RPL_MSG_GROUP;
      m.nmembers = (uint32_t)ev.nmembers;
    } else if (ev.kind == RPL_EV_PASS) {
      m.type = RPL_MSG_PASS;
      coord_straggler_computing(&core->attr, ev.worker, now); /* no group: back to its step */
    } else {
      m.type = RPL_MSG_CANCEL;
      m.culprit = ev.culprit;
      m.reason = (uint32_t)ev.reason;
    }
    if (w->route_len == 0) {
      atomic_fetch_add(&core->send_failures, 1);
      continue;
    }
    reply_worker(core, w, &m, core->members);
  }
}

/* Publishes whether worker w has left or died, for coord_core_active. */
static void note_state(coord_core *core, int w) {
  rpl_gg_worker_info info;
  rpl_error err;
  if (rpl_gg_worker(core->gg, w, &info, &err) != RPL_OK) return;
  int gone = info.state == RPL_WORKER_LEFT || info.state == RPL_WORKER_DEAD;
  atomic_store_explicit(&core->gone[w], (unsigned char)gone, memory_order_release);
}

/* Which sequence of worker w's session message m belongs to: 1 a heartbeat (from any route:
 * the session's MAC and its rising seq say it is w's, so knowing or taking a heartbeat route
 * gains nothing), 0 anything else from the bound route, -1 anything else. */
static int route_slot(const coord_worker *w, const uint8_t *route, size_t len, int type) {
  if (type == RPL_MSG_HEARTBEAT) return 1;
  if (w->route_len == 0 || len != w->route_len || memcmp(route, w->route, len) != 0) return -1;
  return 0;
}

/* May a HELLO from a new route take rank w over? Only from a binding that is surely over:
 * never bound, dead or left, its peer disconnected, or silent for COORD_REBIND_BEATS
 * heartbeat intervals (a live client heartbeats every interval). A live worker's connection
 * is never taken over. */
static int may_rebind(coord_core *core, coord_worker *w, const rpl_gg_worker_info *info,
                      double now) {
  if (w->route_len == 0 || w->unreachable) return 1;
  if (info->state == RPL_WORKER_DEAD || info->state == RPL_WORKER_LEFT) return 1;
  if ((now - w->last_seen) * 1000.0 > (double)COORD_REBIND_BEATS * core->heartbeat_ms) return 1;
  /* A client closes its old connection before it registers anew (failover, or back to a
   * coordinator that only stalled). If ZeroMQ already knows that connection is gone, a
   * probe to it fails at once; a live one receives a HEARTBEAT_ACK with seq 0, which no
   * request of a client waits for (its seqs start at 1), and ignores it. */
  if (w->probes >= COORD_MAX_PROBES) { /* it proved alive since it last spoke: no more */
    atomic_fetch_add(&core->probes_withheld, 1);
    return 0;
  }
  rpl_msg probe;
  memset(&probe, 0, sizeof probe);
  probe.type = RPL_MSG_HEARTBEAT_ACK;
  probe.rank = (int32_t)(w - core->w);
  reply_worker(core, w, &probe, NULL);
  w->probes++;
  return w->unreachable;
}

/* Wrong MAC (another token): counted, and answered (echoing the sender's MAC) at most
 * COORD_BAD_TOKEN_REPLIES_PER_S times a second so an honest misconfigured client learns why,
 * while a flood costs us nothing but the count. */
static void refuse_token(coord_core *core, const uint8_t *route, size_t route_len,
                         const rpl_msg *m, double now) {
  atomic_fetch_add(&core->bad_token, 1);
  if (now - core->bad_token_window >= 1.0 || now < core->bad_token_window) {
    core->bad_token_window = now;
    core->bad_token_replies = 0;
  }
  if (core->bad_token_replies >= COORD_BAD_TOKEN_REPLIES_PER_S) {
    atomic_fetch_add(&core->bad_token_quiet, 1);
    return;
  }
  core->bad_token_replies++;
  reply_error(core, route, route_len, m, NULL, RPL_PERR_BAD_TOKEN,
              "wrong job token: this coordinator serves another job");
}

/* Answers a STATUS query; returns the bytes answered. */
static size_t reply_status(coord_core *core, const uint8_t *route, size_t route_len,
                           const rpl_msg *m, const uint8_t *key, double now) {
  size_t jlen = 0;
  char *json = m->rank >= 0 ? coord_core_rank_json(core, m->rank, now, &jlen)
                            : coord_core_status_json(core, now, &jlen);
  if (!json || jlen > RPL_PROTO_MAX_BODY) {
    free(json);
    reply_error(core, route, route_len, m, key, RPL_PERR_INTERNAL, "status unavailable");
    return 0;
  }
  rpl_msg r = answer_to(m, RPL_MSG_STATUS_REPLY);
  r.text = json;
  r.text_len = (uint32_t)jlen;
  memcpy(r.token, key, RPL_TOKEN_LEN); /* the query's key: the sender proved it */
  size_t need = rpl_msg_encoded_size(&r);
  uint8_t *b = malloc(need);
  size_t n = b ? rpl_msg_encode(&r, NULL, b, need) : 0;
  if (n == 0 || core->send(core->send_ctx, route, route_len, b, n) != 0)
    atomic_fetch_add(&core->send_failures, 1);
  free(b);
  free(json);
  return jlen;
}

/* One connection delivers in order, so its seq only grows (serial arithmetic: wraps). Returns
 * 0 for a replay (counted, to be dropped), else records seq and returns 1. */
static int accept_seq(coord_core *core, coord_worker *w, int slot, uint32_t seq) {
  if (w->seq_valid[slot] && (int32_t)(seq - w->last_seq[slot]) <= 0) {
    atomic_fetch_add(&core->replayed, 1);
    return 0;
  }
  w->last_seq[slot] = seq;
  w->seq_valid[slot] = 1;
  if (slot == 0) w->probes = 0; /* it reads that connection again before it waits */
  return 1;
}

/* Types a worker or a tool sends; anything else sent to us is malformed. */
static int to_coordinator(int type) {
  return type == RPL_MSG_HELLO || type == RPL_MSG_REQUEST || type == RPL_MSG_DONE ||
         type == RPL_MSG_HEARTBEAT || type == RPL_MSG_FENCE || type == RPL_MSG_UNFENCE ||
         type == RPL_MSG_LEAVE || type == RPL_MSG_STATUS;
}

/* The MAC half of a challenge's cookie (COORD_CHALLENGE_MS): what it answers (type, rank, the
 * opener's nonce) and when it was issued, under this instance's secret. */
static void cookie_mac(const coord_core *core, const rpl_msg *m, uint64_t tick,
                       uint8_t out[RPL_NONCE_LEN / 2]) {
  uint8_t type = m->type, rank[4], t[8];
  rpl_put32(rank, (uint32_t)m->rank);
  rpl_put64(t, tick);
  const void *parts[4] = {&type, rank, m->nonce_w, t};
  size_t lens[4] = {1, 4, RPL_NONCE_LEN, 8};
  unsigned char full[RPL_SHA256_LEN];
  rpl_hmac_sha256(core->secret, sizeof core->secret, parts, lens, 4, full);
  memcpy(out, full, RPL_NONCE_LEN / 2);
}

static uint64_t tick_of(const coord_core *core, double now) {
  double ms = (now - core->start) * 1000.0;
  return ms > 0 ? (uint64_t)ms : 0;
}

/* The issue tick of the challenge that m (an answer: HELLO or STATUS with a coordinator
 * nonce) answers, or 0 when that nonce is not a cookie of ours for m, or is too old. */
static uint64_t challenge_tick(const coord_core *core, const rpl_msg *m, double now) {
  uint64_t tick = rpl_get64(m->nonce_c);
  uint8_t mac[RPL_NONCE_LEN / 2];
  cookie_mac(core, m, tick, mac);
  if (!rpl_ct_equal(mac, m->nonce_c + 8, sizeof mac) || tick == 0 || tick > core->last_tick)
    return 0;
  uint64_t at = tick_of(core, now);
  return at > tick && at - tick > COORD_CHALLENGE_MS ? 0 : tick;
}

/* Answers a session's opening (HELLO or STATUS without a coordinator nonce, MACed with the
 * token) with a CHALLENGE: the opener's nonce and a fresh cookie (MACed with the token). Keeps
 * no state: a replayed opening costs one small reply. */
static void challenge(coord_core *core, const uint8_t *route, size_t route_len,
                      const rpl_msg *m, double now) {
  uint64_t tick = tick_of(core, now);
  if (tick <= core->last_tick) tick = core->last_tick + 1; /* unique, and never 0 */
  core->last_tick = tick;
  rpl_msg r = answer_to(m, RPL_MSG_CHALLENGE);
  memcpy(r.nonce_w, m->nonce_w, RPL_NONCE_LEN);
  rpl_put64(r.nonce_c, tick);
  cookie_mac(core, m, tick, r.nonce_c + 8);
  atomic_fetch_add(&core->challenges, 1);
  reply(core, route, route_len, &r, NULL, core->token, NULL);
}

/* A message for a rank that holds no session here (we restarted, or are a standby it has not
 * opened one with): its MAC cannot be checked, so it gets only ERROR(NOT_REGISTERED), MACed
 * with the token, at most once every COORD_NOT_REGISTERED_MS per rank: it tells a worker of
 * an earlier instance to open a session, and a stranger nothing it could not learn by asking. */
static void not_registered(coord_core *core, const uint8_t *route, size_t route_len,
                           const rpl_msg *m, double now) {
  coord_worker *w = &core->w[m->rank];
  if (w->not_registered_at > 0 && now >= w->not_registered_at &&
      (now - w->not_registered_at) * 1000.0 < COORD_NOT_REGISTERED_MS)
    return;
  w->not_registered_at = now;
  reply_error(core, route, route_len, m, core->token, RPL_PERR_NOT_REGISTERED,
              "rank %d is not registered with this coordinator (it restarted, or this is a "
              "standby): say HELLO again", (int)m->rank);
}

/* Parses msg and checks its MAC under the key it must carry (PROTOCOL.md, "Sessions"): the
 * token for an opening, the key derived from a valid challenge's answer, or the rank's session
 * key. Returns 1, *m and key filled, when the sender proved it; anything else is counted and
 * dropped (a wrong token answered by refuse_token, a rank without a session by
 * not_registered). */
static int authenticate(coord_core *core, const uint8_t *route, size_t route_len,
                        const void *msg, size_t len, double now, rpl_msg *m,
                        uint8_t key[RPL_TOKEN_LEN]) {
  rpl_error err;
  if (route_len == 0 || route_len > RPL_ROUTE_MAX ||
      rpl_msg_parse(msg, len, core->nworkers, m, &err) != RPL_OK || m->echo ||
      !to_coordinator(m->type) || (m->rank < 0 && m->type != RPL_MSG_STATUS)) {
    atomic_fetch_add(&core->malformed, 1);
    return 0;
  }
  if (rpl_msg_opening(m)) {
    if (rpl_msg_authentic(msg, len, core->token)) {
      memcpy(key, core->token, RPL_TOKEN_LEN);
      return 1;
    }
    refuse_token(core, route, route_len, m, now);
    return 0;
  }
  if (m->type == RPL_MSG_HELLO || m->type == RPL_MSG_STATUS) {
    if (!challenge_tick(core, m, now)) {
      atomic_fetch_add(&core->bad_session, 1);
      return 0;
    }
    rpl_session_key(core->token, m->type, m->rank, m->nonce_w, m->nonce_c, key);
  } else if (core->w[m->rank].route_len) {
    memcpy(key, core->w[m->rank].key, RPL_TOKEN_LEN);
  } else {
    not_registered(core, route, route_len, m, now);
    return 0;
  }
  if (rpl_msg_authentic(msg, len, key)) return 1;
  atomic_fetch_add(&core->bad_session, 1);
  return 0;
}

/* Has a status query's answer to the challenge issued at `tick` been taken before? Records it
 * if not. -1 when the last COORD_STATUS_USED answers all came within COORD_CHALLENGE_MS:
 * forgetting one could let it be replayed, so the query is told to ask again. */
static int status_replayed(coord_core *core, uint64_t tick, double now) {
  for (int i = 0; i < COORD_STATUS_USED; i++)
    if (core->status_used[i] == tick) return 1;
  uint64_t oldest = core->status_used[core->status_used_next];
  if (oldest && tick_of(core, now) <= oldest + COORD_CHALLENGE_MS) return -1;
  core->status_used[core->status_used_next] = tick;
  core->status_used_next = (core->status_used_next + 1) % COORD_STATUS_USED;
  return 0;
}

/* STATUS: read-only, from any connection (tools); answered once per challenge. */
static void answer_status(coord_core *core, const uint8_t *route, size_t route_len,
                          const rpl_msg *m, const uint8_t *key, double now) {
  if (rpl_msg_opening(m)) {
    challenge(core, route, route_len, m, now);
    return;
  }
  int used = status_replayed(core, rpl_get64(m->nonce_c), now);
  if (used > 0) {
    atomic_fetch_add(&core->replayed, 1);
    return;
  }
  if (now - core->status_window >= 1.0 || now < core->status_window) {
    core->status_window = now;
    core->status_bytes = 0;
    core->status_answers = 0;
  }
  if (used < 0)
    reply_error(core, route, route_len, m, key, RPL_PERR_INTERNAL,
                "status: %d queries answered in %d s; ask again in a second",
                COORD_STATUS_USED, COORD_CHALLENGE_MS / 1000);
  else if (m->rank >= 0 && core->w[m->rank].route_len == 0) /* not served here: try another */
    reply_error(core, route, route_len, m, key, RPL_PERR_NOT_REGISTERED,
                "rank %d is not registered with this coordinator", (int)m->rank);
  else if (core->status_answers > 0 && core->status_bytes >= COORD_STATUS_BYTES_PER_S)
    reply_error(core, route, route_len, m, key, RPL_PERR_INTERNAL,
                "status: %u MB answered this second already; ask again in a second",
                COORD_STATUS_BYTES_PER_S >> 20);
  else
    core->status_bytes += reply_status(core, route, route_len, m, key, now);
  core->status_answers++;
}

/* Refuses (answers with the error, MACed with `key`) a HELLO this coordinator cannot take:
 * another world size, or a rank that left. Refused registrations bind nothing. Returns 1 when
 * refused. */
static int refuse_hello(coord_core *core, const uint8_t *route, size_t route_len,
                        const rpl_msg *m, const uint8_t *key, const rpl_gg_worker_info *info) {
  if (m->nworkers != core->nworkers) {
    reply_error(core, route, route_len, m, key, RPL_PERR_WORLD_MISMATCH,
                "world size %d, but this coordinator serves %d workers", (int)m->nworkers,
                core->nworkers);
    return 1;
  }
  if (info->state == RPL_WORKER_LEFT) {
    reply_error(core, route, route_len, m, key, RPL_PERR_LEFT, "rank %d has left this job",
                (int)m->rank);
    return 1;
  }
  return 0;
}

/* A HELLO: an opening is answered with a CHALLENGE; an answer to a challenge newer than the
 * last this rank answered opens a session -- binds the route it came from and the session's
 * key to rank w -- when may_rebind allows it. Returns 1 when the session is open (the caller
 * answers HELLO_ACK), else 0, the refusal answered. */
static int open_session(coord_core *core, coord_worker *w, const uint8_t *route,
                        size_t route_len, const rpl_msg *m, const uint8_t *key,
                        const rpl_gg_worker_info *info, double now) {
  if (rpl_msg_opening(m)) {
    if (!refuse_hello(core, route, route_len, m, key, info)) challenge(core, route, route_len, m, now);
    return 0;
  }
  uint64_t tick = rpl_get64(m->nonce_c);
  if (tick <= w->opened_tick) { /* an answer replayed, or one older than the last taken */
    atomic_fetch_add(&core->replayed, 1);
    return 0;
  }
  w->opened_tick = tick;
  if (refuse_hello(core, route, route_len, m, key, info)) return 0;
  int same = w->route_len == route_len && memcmp(w->route, route, route_len) == 0;
  if (!same && !may_rebind(core, w, info, now)) {
    atomic_fetch_add(&core->wrong_route, 1);
    reply_error(core, route, route_len, m, key, RPL_PERR_BAD_RANK,
                "rank %d is registered from another connection that is still alive",
                (int)m->rank);
    return 0;
  }
  if (w->route_len && !same) atomic_fetch_add(&core->rebinds, 1);
  memcpy(w->route, route, route_len);
  w->route_len = (uint8_t)route_len;
  memcpy(w->key, key, RPL_TOKEN_LEN);
  w->unreachable = 0;
  w->probes = 0;
  drop_unsent(w); /* it answered a request of the old session */
  w->seq_valid[0] = w->seq_valid[1] = 0; /* a new session: its own history */
  accept_seq(core, w, 0, m->seq);
  return 1;
}

/* Does what worker w's message m asks (it passed every check) and answers it. Returns 0 for a
 * type that no worker sends (counted as malformed). */
static int dispatch(coord_core *core, coord_worker *w, const uint8_t *route, size_t route_len,
                    const rpl_msg *m, double now) {
  rpl_error err;
  rpl_msg r = answer_to(m, 0); /* its type set by the case that answers */
  rpl_status st = RPL_OK;
  switch (m->type) {
    case RPL_MSG_HELLO:
      w->host_label = m->host_label;
      w->hello = 1;
      r.type = RPL_MSG_HELLO_ACK;
      r.policy = (uint8_t)rpl_gg_policy(core->gg);
      r.nworkers = core->nworkers;
      r.heartbeat_ms = core->heartbeat_ms;
      r.dead_ms = core->dead_ms;
      reply_worker(core, w, &r, NULL);
      break;
    case RPL_MSG_REQUEST:
      w->req_seq = m->seq;
      st = rpl_gg_request(core->gg, m->rank, m->round, &err);
      if (st == RPL_OK) coord_straggler_request(&core->attr, m->rank, m->round, now);
      if (st != RPL_OK) {
        reply_error(core, route, route_len, m, w->key,
                    st == RPL_ERR_CLOSED ? RPL_PERR_LEFT : RPL_PERR_INTERNAL, "%s", err.msg);
      }
      break;
    case RPL_MSG_DONE:
      st = rpl_gg_done(core->gg, m->rank, m->group_id, &err);
      coord_straggler_computing(&core->attr, m->rank, now); /* its next step starts */
      break;
    case RPL_MSG_HEARTBEAT:
      r.type = RPL_MSG_HEARTBEAT_ACK;
      reply(core, route, route_len, &r, NULL, w->key, NULL); /* to the route it came from */
      break;
    case RPL_MSG_FENCE:
      st = rpl_gg_fence(core->gg, m->rank, &err);
      coord_straggler_idle(&core->attr, m->rank); /* an exact collective is no compute step */
      break;
    case RPL_MSG_UNFENCE:
      st = rpl_gg_unfence(core->gg, m->rank, &err);
      break;
    case RPL_MSG_LEAVE:
      st = rpl_gg_leave(core->gg, m->rank, &err);
      coord_straggler_idle(&core->attr, m->rank);
      r.type = RPL_MSG_ACK;
      reply_worker(core, w, &r, NULL);
      break;
    default:
      /* A reply type sent to the coordinator: not something a worker sends. */
      atomic_fetch_add(&core->malformed, 1);
      return 0;
  }
  (void)st; /* fence/unfence after leave: nothing to undo; the worker learns on its request */
  return 1;
}

/* Authentication, then (worker messages) the session's opening or its route and replay
 * checks, and the dispatch; each step answers and drops what it refuses. */
int coord_core_handle(coord_core *core, const uint8_t *route, size_t route_len,
                      const void *msg, size_t len, double now) {
  atomic_fetch_add(&core->messages, 1);
  coord_core_advance(core, now); /* waits for partners are measured from arrival */
  rpl_msg m;
  uint8_t key[RPL_TOKEN_LEN];
  if (!authenticate(core, route, route_len, msg, len, now, &m, key)) return 0;
  /* From here on the sender proved it holds the token (and, past an opening, the key). */
  if (m.type == RPL_MSG_STATUS) {
    answer_status(core, route, route_len, &m, key, now);
    return 1;
  }
  /* Everything else comes from a worker: authenticate checked 0 <= rank < nworkers. */
  coord_worker *w = &core->w[m.rank];
  rpl_gg_worker_info info;
  rpl_error err;
  rpl_gg_worker(core->gg, m.rank, &info, &err);
  if (m.type == RPL_MSG_HELLO) {
    if (!open_session(core, w, route, route_len, &m, key, &info, now)) return 1;
  } else {
    int slot = route_slot(w, route, route_len, m.type);
    if (slot < 0) {
      atomic_fetch_add(&core->wrong_route, 1);
      reply_error(core, route, route_len, &m, key, RPL_PERR_BAD_RANK,
                  "rank %d is registered from another connection", (int)m.rank);
      return 1;
    }
    if (!accept_seq(core, w, slot, m.seq)) return 1;
  }
  if (!dispatch(core, w, route, route_len, &m, now)) return 1;
  w->seen = 1;
  w->last_seen = now;
  w->unreachable = 0;
  note_state(core, m.rank); /* a leave, or a dead worker back */
  flush_events(core, now);
  return 1;
}

int coord_core_active(const coord_core *core, int except_rank) {
  int k = 0;
  for (int i = 0; i < core->nworkers; i++)
    k += i != except_rank && !atomic_load_explicit(&core->gone[i], memory_order_acquire);
  return k;
}

double coord_core_advance(coord_core *core, double now) {
  rpl_error err;
  rpl_gg_advance(core->gg, now - core->start, &err);
  flush_events(core, now);
  double next = rpl_gg_next_deadline(core->gg);
  return next < 0 ? -1.0 : next + core->start;
}

void coord_core_tick(coord_core *core, double now) {
  int changed = 0;
  for (int i = 0; i < core->nworkers; i++) {
    coord_worker *w = &core->w[i];
    rpl_gg_worker_info info;
    rpl_error err;
    rpl_gg_worker(core->gg, i, &info, &err);
    if (info.state == RPL_WORKER_LEFT || info.state == RPL_WORKER_DEAD) {
      drop_unsent(w);
      continue;
    }
    resend_unsent(core, w);
    int dead = w->seen ? (now - w->last_seen) * 1000.0 > core->dead_ms
                       : core->join_ms > 0 && (now - core->start) * 1000.0 > core->join_ms;
    if (dead) {
      rpl_gg_dead(core->gg, i, &err);
      coord_straggler_idle(&core->attr, i);
      atomic_fetch_add(&core->dead_declared, 1);
      note_state(core, i);
      changed = 1;
    }
  }
  if (changed) flush_events(core, now);
  coord_straggler_refresh(core, now, 0);
}

/* ---- status JSON ------------------------------------------------------------------------- */

typedef struct {
  coord_text *b;
  int count;
} pend_ctx;

static int pend_json(void *ctx, uint64_t id, const int *members, int n, int arrived) {
  pend_ctx *pc = ctx;
  if (pc->count >= 1000 || pc->b->len > COORD_STATUS_LIMIT) return 1; /* keep it bounded */
  coord_printf(pc->b, "%s{\"id\":%llu,\"arrived\":%d,\"members\":[", pc->count ? "," : "",
               (unsigned long long)id, arrived);
  for (int i = 0; i < n; i++) coord_printf(pc->b, "%s%d", i ? "," : "", members[i]);
  coord_printf(pc->b, "]}");
  pc->count++;
  return 0;
}

/* A non-negative finite number with fmt, else null. */
static void sb_num(coord_text *b, const char *fmt, double v) {
  if (isfinite(v) && v >= 0) coord_printf(b, fmt, v);
  else coord_printf(b, "null");
}

/* The step in progress of worker i: since it left the coordinator, while computing. */
static double busy_s(const coord_core *core, int i, const rpl_gg_worker_info *wi, double now) {
  double at = core->attr.w[i].free_at;
  return at >= 0 && wi->state == RPL_WORKER_LIVE && !wi->waiting && now > at ? now - at : 0;
}

/* Worker i's attribution fields (coord_straggler.h), shared by every document that names it. */
static void attr_fields(coord_core *core, coord_text *b, int i, const rpl_gg_worker_info *wi,
                        double now) {
  const coord_straggler_worker *x = &core->attr.w[i];
  char hb[32];
  coord_printf(b, "\"host_name\":\"%s\",\"steps_per_s\":",
               coord_straggler_host(core, i, hb, sizeof hb));
  sb_num(b, "%.3f", x->rate > 0 ? x->rate : -1);
  coord_printf(b, ",\"busy_s\":");
  sb_num(b, "%.3f", busy_s(core, i, wi, now));
  coord_printf(b, ",\"slowdown\":");
  sb_num(b, "%.3f", x->slowdown > 0 ? x->slowdown : -1);
  coord_printf(b, ",\"slow\":%s,\"slow_since_step\":", x->slow ? "true" : "false");
  if (x->slow) coord_printf(b, "%llu", (unsigned long long)x->slow_since);
  else coord_printf(b, "null");
  rpl_whatif_worker_info ww = {0};
  rpl_error err;
  rpl_whatif_worker(rpl_gg_whatif(core->gg), i, &ww, &err);
  coord_printf(b, ",\"cost_s\":%.6f", ww.cost_s);
}

/* "whatif":{...}: what the stragglers would cost under all-reduce, and what was saved
 * (rpl_whatif_get over the compute steps the policy measured; 0 = not known yet). */
static void whatif_json(coord_core *core, coord_text *b) {
  rpl_whatif_summary s;
  rpl_whatif_get(rpl_gg_whatif(core->gg), &s);
  coord_printf(b,
               "\"whatif\":{\"steps\":%llu,\"job_steps\":%llu,\"allreduce_step_s\":%.6f,"
               "\"free_step_s\":%.6f,\"gain\":%.4f,\"waste\":%.4f,\"allreduce_s\":%.3f,"
               "\"free_s\":%.3f,\"elapsed_s\":%.3f,\"saved\":%.4f,\"cost_s\":%.6f}",
               (unsigned long long)s.steps, (unsigned long long)s.job_steps, s.allreduce_step,
               s.free_step, s.gain, s.waste, s.allreduce_s, s.free_s, s.elapsed_s, s.saved,
               s.cost_s);
}

/* A rank as the summaries name it: who, its step, its slowdown, groups of one, last seen. */
static void rank_entry(coord_core *core, coord_text *b, int i, double now) {
  rpl_gg_worker_info wi;
  rpl_error err;
  rpl_gg_worker(core->gg, i, &wi, &err);
  const coord_worker *w = &core->w[i];
  coord_printf(b, "{\"rank\":%d,\"state\":\"%s\",\"requests\":%llu,\"step_s\":", i,
               rpl_worker_state_name(wi.state), (unsigned long long)wi.requests);
  sb_num(b, "%.6f", wi.step);
  coord_printf(b, ",\"handed\":%llu,\"singletons\":%llu,\"seen\":%s,\"silent_s\":%.3f,",
               (unsigned long long)wi.handed, (unsigned long long)wi.singletons,
               w->seen ? "true" : "false", w->seen ? now - w->last_seen : now - core->start);
  attr_fields(core, b, i, &wi, now);
  coord_printf(b, "}");
}

/* "attribution":{...}: the median step and the slowest ranks (coord_straggler_refresh). */
static void attribution_json(coord_core *core, coord_text *b, double now) {
  const coord_straggler *a = &core->attr;
  coord_printf(b, "\"attribution\":{\"median_step_s\":");
  sb_num(b, "%.6f", a->median > 0 ? a->median : -1);
  coord_printf(b, ",\"known\":%d,\"slow\":%d,\"slow_at\":%.1f,\"slowest\":[", a->known, a->nslow,
               COORD_SLOW_AT);
  for (int k = 0; k < a->ntop; k++) {
    if (k) coord_printf(b, ",");
    rank_entry(core, b, a->top[k], now);
  }
  coord_printf(b, "]}");
}

/* The finished document in b (malloc'd, *len its length), or NULL if it ran out of memory. */
static char *text_done(coord_text *b, size_t *len) {
  if (b->oom) {
    free(b->p);
    return NULL;
  }
  *len = b->len;
  return b->p;
}

char *coord_core_rank_json(coord_core *core, int rank, double now, size_t *len) {
  coord_text b;
  if (coord_text_init(&b, 4096) != 0) return NULL;
  coord_straggler_refresh(core, now, 0);
  coord_printf(&b,
               "{\"version\":%d,\"policy\":\"%s\",\"nworkers\":%d,\"uptime_s\":%.3f,\"rank\":%d,",
               RPL_PROTO_VERSION, rpl_policy_name(rpl_gg_policy(core->gg)), core->nworkers,
               now - core->start, rank);
  attribution_json(core, &b, now);
  coord_printf(&b, ",");
  whatif_json(core, &b);
  coord_printf(&b, ",\"self\":");
  rank_entry(core, &b, rank, now);
  coord_printf(&b, "}");
  return text_done(&b, len);
}

/* The status document's scalars: the service's configuration and the policy's. */
static void config_json(coord_core *core, coord_text *b, const rpl_gg_stats *st, double now) {
  coord_printf(b,
               "{\"version\":%d,\"policy\":\"%s\",\"nworkers\":%d,\"group_size\":%d,"
               "\"c_thres\":%d,\"inter_intra\":%s,\"heartbeat_ms\":%u,\"dead_ms\":%u,"
               "\"standby\":%s,\"uptime_s\":%.3f,\"period_max\":%d,\"period\":%u,",
               RPL_PROTO_VERSION, rpl_policy_name(rpl_gg_policy(core->gg)), core->nworkers,
               rpl_gg_group_size(core->gg), rpl_gg_c_thres(core->gg),
               rpl_gg_inter_intra(core->gg) ? "true" : "false", core->heartbeat_ms, core->dead_ms,
               core->standby ? "true" : "false", now - core->start, rpl_gg_period_max(core->gg),
               st->period);
}

/* "counters":{...}: the service's (coord_core) and the policy's (rpl_gg_stats). */
static void counters_json(coord_core *core, coord_text *b, const rpl_gg_stats *st) {
  coord_printf(b,
               "\"counters\":{\"messages\":%llu,\"malformed\":%llu,\"bad_token\":%llu,"
               "\"errors_sent\":%llu,\"dead_declared\":%llu,\"send_failures\":%llu,"
               "\"requests\":%llu,\"groups_created\":%llu,\"groups_handed\":%llu,"
               "\"groups_cancelled\":%llu,\"singletons_handed\":%llu,\"divisions\":%llu,"
               "\"filtered\":%llu,\"conflicts\":%llu,\"implicit_dones\":%llu,"
               "\"stale_dones\":%llu,\"pending\":%llu,\"deferred\":%llu,\"wait_expired\":%llu,"
               "\"isolation_holds\":%llu,\"joins\":%llu,\"late\":%llu,\"passes\":%llu,"
               "\"period_drops\":%llu,\"wrong_route\":%llu,\"replayed\":%llu,\"rebinds\":%llu,"
               "\"bad_token_quiet\":%llu,\"late_dropped\":%llu,\"probes_withheld\":%llu,"
               "\"challenges\":%llu,\"bad_session\":%llu,\"connections_dropped\":%llu},",
               (unsigned long long)atomic_load(&core->messages),
               (unsigned long long)atomic_load(&core->malformed),
               (unsigned long long)atomic_load(&core->bad_token),
               (unsigned long long)atomic_load(&core->errors_sent),
               (unsigned long long)atomic_load(&core->dead_declared),
               (unsigned long long)atomic_load(&core->send_failures),
               (unsigned long long)st->requests, (unsigned long long)st->groups_created,
               (unsigned long long)st->groups_handed, (unsigned long long)st->groups_cancelled,
               (unsigned long long)st->singletons_handed, (unsigned long long)st->divisions,
               (unsigned long long)st->filtered, (unsigned long long)st->conflicts,
               (unsigned long long)st->implicit_dones, (unsigned long long)st->stale_dones,
               (unsigned long long)st->pending, (unsigned long long)st->deferred,
               (unsigned long long)st->wait_expired, (unsigned long long)st->isolation_holds,
               (unsigned long long)st->joins, (unsigned long long)st->late,
               (unsigned long long)st->passes, (unsigned long long)st->period_drops,
               (unsigned long long)atomic_load(&core->wrong_route),
               (unsigned long long)atomic_load(&core->replayed),
               (unsigned long long)atomic_load(&core->rebinds),
               (unsigned long long)atomic_load(&core->bad_token_quiet),
               (unsigned long long)st->late_dropped,
               (unsigned long long)atomic_load(&core->probes_withheld),
               (unsigned long long)atomic_load(&core->challenges),
               (unsigned long long)atomic_load(&core->bad_session),
               (unsigned long long)atomic_load(&core->connections_dropped));
}

/* Worker i's entry in "workers" (every field the policy and the service keep of it). */
static void worker_json(coord_core *core, coord_text *b, int i, double now) {
  rpl_gg_worker_info wi;
  rpl_error err;
  rpl_gg_worker(core->gg, i, &wi, &err);
  const coord_worker *w = &core->w[i];
  coord_printf(b,
               "%s{\"rank\":%d,\"state\":\"%s\",\"host\":%d,\"host_label\":%d,\"requests\":%llu,"
               "\"waiting\":%s,\"buffered\":%d,\"head_group\":%llu,\"locked_group\":%llu,"
               "\"handed\":%llu,\"cancels\":%llu,\"singletons\":%llu,\"lonely\":%u,"
               "\"lonely_max\":%u,\"deferred\":%s,\"passes\":%llu,\"step_s\":%.6f,\"seen\":%s,"
               "\"silent_s\":%.3f,\"bound\":%s,",
               i ? "," : "", i, rpl_worker_state_name(wi.state), wi.host, (int)w->host_label,
               (unsigned long long)wi.requests, wi.waiting ? "true" : "false", wi.buffered,
               (unsigned long long)wi.head_group, (unsigned long long)wi.locked_group,
               (unsigned long long)wi.handed, (unsigned long long)wi.cancels,
               (unsigned long long)wi.singletons, wi.lonely, wi.lonely_max,
               wi.deferred ? "true" : "false", (unsigned long long)wi.passes, wi.step,
               w->seen ? "true" : "false", w->seen ? now - w->last_seen : now - core->start,
               w->route_len ? "true" : "false");
  attr_fields(core, b, i, &wi, now);
  coord_printf(b, "}");
}

char *coord_core_status_json(coord_core *core, double now, size_t *len) {
  coord_text b;
  if (coord_text_init(&b, 4096) != 0) return NULL;
  coord_straggler_refresh(core, now, 0);
  rpl_gg_stats st;
  rpl_gg_get_stats(core->gg, &st);
  config_json(core, &b, &st, now);
  counters_json(core, &b, &st);
  attribution_json(core, &b, now);
  coord_printf(&b, ",");
  whatif_json(core, &b);
  coord_printf(&b, ",\"workers\":[");
  int listed = 0;
  for (int i = 0; i < core->nworkers && b.len <= COORD_STATUS_LIMIT; i++, listed++)
    worker_json(core, &b, i, now);
  coord_printf(&b, "],\"workers_omitted\":%d,\"pending\":[", core->nworkers - listed);
  pend_ctx pc = {&b, 0};
  rpl_gg_foreach_pending(core->gg, pend_json, &pc);
  coord_printf(&b, "],\"pending_omitted\":%llu}",
               (unsigned long long)(st.pending > (uint64_t)pc.count ? st.pending - pc.count : 0));
  return text_done(&b, len);
}
