/* Worker-side client of the Group Generator service: one DEALER socket for requests (used by
 * the caller's thread) and a heartbeat thread with its own socket (zmq sockets are not
 * thread-safe). Replies carry the sequence number of what they answer, so a reply that
 * arrives after its request timed out is recognised and dropped.
 *
 * Failover. The endpoint may be a list: the primary, then standby coordinators. When the
 * current one is lost (heartbeats unanswered for dead_ms, or a restarted instance answering
 * NOT_REGISTERED) the request that was waiting fails -- its group died with the coordinator --
 * and the client registers with the next endpoint of the list (wrapping around: a lone
 * endpoint is a standalone coordinator that may come back), so the following rounds are
 * served. Attempts are short and spaced out, so that a worker keeps training (its rounds
 * failing fast) while no coordinator answers. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "sched_internal.h"

#define MAX_MSG (RPL_PROTO_HEADER + 20 + 4 * (size_t)RPL_SCHED_MAX_WORKERS)

/* A failover attempt tries each endpoint this long for a HELLO_ACK, and after a failed
 * round of attempts the next waits this long (rounds fail fast meanwhile). */
#define FAILOVER_HELLO_MS 1500
#define FAILOVER_SPACING_S 2.0

struct rpl_gg_client {
  char *endpoint;              /* the current one: eps[cur] */
  char **eps;
  int neps, cur;
  double next_failover;        /* clock before which no new attempt is made */
  uint8_t token[RPL_TOKEN_LEN];
  uint8_t key[RPL_TOKEN_LEN];  /* the MAC key: the session's, or the token while one opens;
                                  set only with the heartbeat thread stopped */
  int rank, nworkers, host_label;
  int timeout_ms, request_timeout_ms, heartbeat_ms;
  /* Atomics, like every field stats read: stats never take `lock`, which a request holds
   * while it waits for its group (up to the round timeout). */
  atomic_uint dead_ms;         /* from the coordinator's HELLO_ACK, bounded */
  atomic_uint beat_ms;         /* the period in use: the coordinator's, or ours if shorter */
  void *ctx;
  int own_ctx;
  void *sock;
  atomic_uint seq;             /* one counter for every message of this client, both sockets
                                  and every registration: it never goes back (PROTOCOL.md) */
  uint8_t rid[RPL_ROUTE_ID_LEN];/* routing id of the request socket of this registration */
  uint8_t *buf;                /* receive buffer, MAX_MSG bytes */
  pthread_mutex_t lock;        /* serialises use of sock */
  atomic_int asking;           /* requests holding or queued for `lock` (one may wait for its
                                  group until the round timeout): fences do not wait for them */
  pthread_t beat;
  int beat_started;
  int wake[2];                 /* a byte written to wake[1] ends the heartbeat thread's wait:
                                  it sleeps until its next beat, not in short polls (each
                                  wake-up takes a core from training where cores are few) */
  int refused_unauth;          /* the last HELLO's refusal was an unauthenticated echo */
  atomic_int stop;
  atomic_int lost;             /* heartbeats unanswered for longer than dead_ms */
  atomic_ullong hb_sent, hb_acked, requests, cancels, failovers, passes;
  atomic_uint period;              /* in the last GROUP or PASS; 0 before */
  atomic_ullong wait_ns;       /* total time blocked in rpl_gg_client_request */
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static rpl_status zfail(rpl_error *err, const char *what, const char *endpoint) {
  return rpl_fail(err, RPL_ERR_SYSTEM, "group generator client: %s (%s): %s", what,
                  endpoint ? endpoint : "", zmq_strerror(zmq_errno()));
}

static rpl_status send_msg(void *sock, rpl_msg *m, const int *members, rpl_error *err,
                           const char *endpoint) {
  if (!sock) /* between a lost coordinator and a successful failover */
    return rpl_fail(err, RPL_ERR_PEER, "no group generator connected (last: %s)",
                    endpoint ? endpoint : "");
  uint8_t small[128];
  size_t need = rpl_msg_encoded_size(m);
  uint8_t *b = need <= sizeof small ? small : malloc(need);
  if (!b) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory");
  size_t len = rpl_msg_encode(m, members, b, need);
  int rc = len ? zmq_send(sock, b, len, ZMQ_DONTWAIT) : -1;
  if (b != small) free(b);
  if (!len) return rpl_fail(err, RPL_ERR_INVALID, "cannot encode %s", rpl_msg_type_name(m->type));
  if (rc < 0) return zfail(err, "send", endpoint);
  return RPL_OK;
}

static void fill_header(const rpl_gg_client *c, rpl_msg *m, int type, uint32_t seq) {
  memset(m, 0, sizeof *m);
  m->type = (uint8_t)type;
  memcpy(m->token, c->key, RPL_TOKEN_LEN);
  m->rank = c->rank;
  m->seq = seq;
}

static uint32_t next_seq(rpl_gg_client *c) { return atomic_fetch_add(&c->seq, 1) + 1; }

/* Error text carried by an ERROR reply, as a status for the caller. */
static rpl_status from_error_reply(const rpl_msg *m, const char *endpoint, rpl_error *err) {
  rpl_status code = m->code == RPL_PERR_LEFT ? RPL_ERR_CLOSED : RPL_ERR_INVALID;
  return rpl_fail(err, code, "group generator at %s refused: %.*s", endpoint,
                  (int)(m->text_len > 400 ? 400 : m->text_len), m->text ? m->text : "");
}

/* ---- reply handling without sockets (fuzzed: fuzz/fuzz_client.c) ------------- */

/* MACed with the key, or a "not registered" from an instance that holds no session of ours
 * (it can only MAC with the token). */
static int authentic_reply(const void *buf, size_t n, const rpl_msg *m,
                           const uint8_t key[RPL_TOKEN_LEN], const uint8_t token[RPL_TOKEN_LEN]) {
  if (rpl_msg_authentic(buf, n, key)) return 1;
  return m->type == RPL_MSG_ERROR && m->code == RPL_PERR_NOT_REGISTERED &&
         rpl_msg_authentic(buf, n, token);
}

int rpl_client_accept(const void *buf, size_t n, const uint8_t key[RPL_TOKEN_LEN],
                      const uint8_t token[RPL_TOKEN_LEN], int nworkers, int rank, uint32_t seq,
                      rpl_msg *m) {
  rpl_error perr;
  if (n > MAX_MSG || rpl_msg_parse(buf, n, nworkers, m, &perr) != RPL_OK) return 0;
  if (m->seq != seq || m->rank != rank) return 0;
  /* Every reply is MACed, but the refusal of a token the coordinator does not share (it
   * cannot MAC that): anyone on the path could forge one, which costs us no more than a
   * dropped reply would. */
  if (m->echo) return 1; /* the parser allows the echo on ERROR(BAD_TOKEN) only */
  return authentic_reply(buf, n, m, key, token);
}

rpl_reply_kind rpl_client_request_reply(const rpl_msg *m, uint64_t round, int rank,
                                        int *members, int cap, int *n, uint64_t *group_id,
                                        const char *endpoint, rpl_error *err) {
  switch (m->type) {
    case RPL_MSG_CANCEL:
      return RPL_REPLY_RETRY; /* a member fenced, left or died before the group started */
    case RPL_MSG_ERROR:
      if (m->code == RPL_PERR_NOT_REGISTERED) {
        rpl_fail(err, RPL_ERR_PEER, "group generator at %s does not know this worker "
                 "(it restarted)", endpoint);
        return RPL_REPLY_LOST;
      }
      from_error_reply(m, endpoint, err);
      return RPL_REPLY_FAIL;
    case RPL_MSG_PASS:
      if (m->round != round) break;
      if (cap < 1) {
        rpl_fail(err, RPL_ERR_INVALID, "group of 1 member, buffer holds %d", cap);
        *n = 1;
        return RPL_REPLY_FAIL;
      }
      members[0] = rank;
      *n = 1;
      *group_id = 0;
      return RPL_REPLY_PASS;
    case RPL_MSG_GROUP: {
      if (m->round != round) break;
      if ((int)m->nmembers > cap) {
        *n = (int)m->nmembers;
        rpl_fail(err, RPL_ERR_INVALID, "group of %u members, buffer holds %d",
                 m->nmembers, cap);
        return RPL_REPLY_FAIL;
      }
      int self = 0;
      for (uint32_t i = 0; i < m->nmembers; i++) {
        members[i] = rpl_msg_member(m, i);
        self |= members[i] == rank;
      }
      if (!self) {
        rpl_fail(err, RPL_ERR_PEER, "group generator sent a group without rank %d", rank);
        return RPL_REPLY_FAIL;
      }
      *n = (int)m->nmembers;
      *group_id = m->group_id;
      return RPL_REPLY_GROUP;
    }
    default:
      break;
  }
  rpl_fail(err, RPL_ERR_PEER, "group generator answered a request with %s",
           rpl_msg_type_name(m->type));
  return RPL_REPLY_FAIL;
}

int rpl_client_beat_reply(const void *buf, size_t n, const uint8_t key[RPL_TOKEN_LEN],
                          const uint8_t token[RPL_TOKEN_LEN], int nworkers, int rank,
                          uint32_t answered, uint32_t sent, uint32_t *seq_out) {
  rpl_msg m;
  rpl_error e;
  if (n > MAX_MSG || rpl_msg_parse(buf, n, nworkers, &m, &e) != RPL_OK || m.echo ||
      !authentic_reply(buf, n, &m, key, token) || m.rank != rank)
    return RPL_BEAT_IGNORE;
  /* in (answered, sent]: sent after the last answered one, and sent at all */
  if ((int32_t)(m.seq - answered) <= 0 || (int32_t)(sent - m.seq) < 0) return RPL_BEAT_IGNORE;
  int kind = RPL_BEAT_IGNORE;
  if (m.type == RPL_MSG_HEARTBEAT_ACK) kind = RPL_BEAT_ACK;
  /* A new instance: what we wait for died with the old one. */
  if (m.type == RPL_MSG_ERROR && m.code == RPL_PERR_NOT_REGISTERED) kind = RPL_BEAT_LOST;
  if (kind != RPL_BEAT_IGNORE && seq_out) *seq_out = m.seq;
  return kind;
}

/* Waits until `deadline` for a reply on the request socket answering `seq`; drops stale or
 * foreign ones. Returns RPL_OK with *m filled, RPL_ERR_TIMEOUT, or another error. `lost` may
 * be NULL. A timeout says whether replies to `seq` came that failed their MAC: an endpoint
 * that does not hold the job's token (another job's coordinator, or one the store was made to
 * name). */
static rpl_status wait_reply(rpl_gg_client *c, uint32_t seq, double deadline, atomic_int *lost,
                             rpl_msg *m, rpl_error *err) {
  void *sock = c->sock;
  uint8_t *buf = c->buf;
  const char *endpoint = c->endpoint;
  int forged = 0;
  for (;;) {
    double left = deadline - now_s();
    if (left <= 0)
      return forged ? rpl_fail(err, RPL_ERR_TIMEOUT, "timed out: %d answers from %s failed "
                               "their MAC (that endpoint does not hold this job's coordinator "
                               "token)", forged, endpoint)
                    : rpl_fail(err, RPL_ERR_TIMEOUT, "timed out");
    if (lost && atomic_load(lost))
      return rpl_fail(err, RPL_ERR_PEER,
                      "group generator at %s stopped answering heartbeats", endpoint);
    long ms = (long)(left * 1000.0) + 1;
    if (ms > 100) ms = 100; /* wake up to notice a lost coordinator */
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(&it, 1, ms);
    if (rc < 0) {
      if (zmq_errno() == EINTR) continue;
      return zfail(err, "poll", endpoint);
    }
    if (rc == 0) continue;
    int n = zmq_recv(sock, buf, MAX_MSG, ZMQ_DONTWAIT);
    if (n < 0) {
      if (zmq_errno() == EAGAIN || zmq_errno() == EINTR) continue;
      return zfail(err, "recv", endpoint);
    }
    if (rpl_client_accept(buf, (size_t)n, c->key, c->token, c->nworkers, c->rank, seq, m))
      return RPL_OK;
    rpl_error perr; /* well-formed and answering seq, but not MACed with our token? */
    forged += rpl_msg_parse(buf, (size_t)n, c->nworkers, m, &perr) == RPL_OK && m->seq == seq;
  }
}

/* libzmq allocates a whole inbound message before zmq_recv sees it: a (fake) coordinator's
 * frame larger than any reply of the protocol disconnects it instead. */
_Static_assert(MAX_MSG >= RPL_PROTO_HEADER + 8 + RPL_PROTO_MAX_TEXT, "an ERROR reply fits");
static void limit_inbound(void *s) {
  int64_t maxmsg = (int64_t)MAX_MSG;
  zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
}

/* The heartbeat socket: a routing id of its own (random: nothing on the wire tells it before
 * its own handshake does), connected to the current endpoint. NULL on failure. */
static void *beat_socket(rpl_gg_client *c) {
  uint8_t rid[RPL_ROUTE_ID_LEN];
  rpl_error e;
  if (rpl_token_generate(rid + 1, &e) != RPL_OK) return NULL;
  rid[0] = RPL_ROUTE_HEARTBEAT;
  void *s = zmq_socket(c->ctx, ZMQ_DEALER);
  if (!s) return NULL;
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(s, ZMQ_ROUTING_ID, rid, sizeof rid);
  limit_inbound(s);
  if (zmq_connect(s, c->endpoint) != 0) {
    zmq_close(s);
    return NULL;
  }
  return s;
}

static void *beat_main(void *arg) {
  rpl_gg_client *c = arg;
  pthread_setname_np(pthread_self(), "rpl-gg-beat");
  void *s = beat_socket(c);
  if (!s) return NULL;
  uint8_t *buf = malloc(MAX_MSG);
  double last_ack = now_s(), next_send = 0, opened = last_ack;
  /* Replies count for heartbeats in (answered, sent]: none before the first one goes out. */
  uint32_t sent = atomic_load(&c->seq), answered = sent;
  while (buf && !atomic_load(&c->stop)) {
    double t = now_s();
    /* Unanswered for a third of dead_ms (two beats at least): a fresh connection under a new
     * routing id, in case another peer took this one's (the coordinator takes heartbeats
     * from any route; a connection whose id is in use is refused). */
    double beat_s = atomic_load(&c->beat_ms) / 1000.0, dead_s = atomic_load(&c->dead_ms) / 1000.0;
    double reopen_s = dead_s / 3 > 2 * beat_s ? dead_s / 3 : 2 * beat_s;
    if (t - last_ack > reopen_s && t - opened > reopen_s) {
      void *fresh = beat_socket(c);
      if (fresh) {
        zmq_close(s);
        s = fresh;
      }
      opened = t;
    }
    if (t >= next_send) {
      rpl_msg m;
      uint32_t seq = next_seq(c);
      fill_header(c, &m, RPL_MSG_HEARTBEAT, seq);
      rpl_error e;
      if (send_msg(s, &m, NULL, &e, c->endpoint) == RPL_OK) {
        atomic_fetch_add(&c->hb_sent, 1);
        sent = seq;
      }
      next_send = t + atomic_load(&c->beat_ms) / 1000.0;
    }
    /* Until the next beat is due (a reply or a stop wakes it sooner): the checks above run
     * at least once a beat, and the lost one needs RPL_DEAD_MIN_BEATS of them. */
    long ms = (long)((next_send - now_s()) * 1000.0) + 1;
    long beat_ms = (long)atomic_load(&c->beat_ms);
    ms = ms < 1 ? 1 : ms > beat_ms ? beat_ms : ms;
    zmq_pollitem_t it[2] = {{s, 0, ZMQ_POLLIN, 0}, {NULL, c->wake[0], ZMQ_POLLIN, 0}};
    if (zmq_poll(it, 2, ms) > 0 && (it[0].revents & ZMQ_POLLIN)) {
      int n;
      while ((n = zmq_recv(s, buf, MAX_MSG, ZMQ_DONTWAIT)) >= 0) {
        int kind = rpl_client_beat_reply(buf, (size_t)n, c->key, c->token, c->nworkers,
                                         c->rank, answered, sent, &answered);
        if (kind == RPL_BEAT_ACK) {
          atomic_fetch_add(&c->hb_acked, 1);
          last_ack = now_s();
          atomic_store(&c->lost, 0);
        } else if (kind == RPL_BEAT_LOST) {
          atomic_store(&c->lost, 1);
        }
      }
    }
    if (now_s() - last_ack > atomic_load(&c->dead_ms) / 1000.0) atomic_store(&c->lost, 1);
  }
  free(buf);
  zmq_close(s);
  return NULL;
}

/* A fresh routing id for each registration: the coordinator binds our rank to it. Fresh,
 * because the coordinator may not have noticed the previous connection close yet, and
 * ZeroMQ refuses a second connection with a routing id in use. Then connects. */
static rpl_status connect_fresh(rpl_gg_client *c, rpl_error *err) {
  rpl_status st = rpl_token_generate(c->rid + 1, err);
  c->rid[0] = RPL_ROUTE_REQUEST;
  if (st != RPL_OK) return st; /* err says why */
  if (zmq_setsockopt(c->sock, ZMQ_ROUTING_ID, c->rid, sizeof c->rid) != 0)
    return zfail(err, "routing id", c->endpoint);
  if (zmq_connect(c->sock, c->endpoint) != 0)
    return rpl_fail(err, RPL_ERR_INVALID, "group generator client: cannot connect to '%s': %s",
                    c->endpoint, zmq_strerror(zmq_errno()));
  return RPL_OK;
}

/* Sends HELLO with our nonce and the coordinator's (all zero: an opening), MACed with c->key,
 * and waits for its reply. */
static rpl_status say_hello(rpl_gg_client *c, const uint8_t *nonce_w, const uint8_t *nonce_c,
                            double deadline, rpl_msg *m, rpl_error *err) {
  uint32_t seq = next_seq(c);
  fill_header(c, m, RPL_MSG_HELLO, seq);
  m->nworkers = c->nworkers;
  m->host_label = c->host_label;
  memcpy(m->nonce_w, nonce_w, RPL_NONCE_LEN);
  memcpy(m->nonce_c, nonce_c, RPL_NONCE_LEN);
  rpl_status st = send_msg(c->sock, m, NULL, err, c->endpoint);
  return st == RPL_OK ? wait_reply(c, seq, deadline, NULL, m, err) : st;
}

/* Opens a session (PROTOCOL.md, "Sessions"): HELLO with a fresh nonce under the token, the
 * coordinator's CHALLENGE, and HELLO answering it under the session's key (then c->key),
 * whose reply is in *m. A refusal of the opening is returned in *m as well. */
static rpl_status open_session(rpl_gg_client *c, double deadline, rpl_msg *m, rpl_error *err) {
  uint8_t nonce_w[RPL_NONCE_LEN], nonce_c[RPL_NONCE_LEN] = {0};
  rpl_status st = rpl_token_generate(nonce_w, err);
  if (st != RPL_OK) return st;
  memcpy(c->key, c->token, RPL_TOKEN_LEN);
  st = say_hello(c, nonce_w, nonce_c, deadline, m, err);
  if (st != RPL_OK || m->type != RPL_MSG_CHALLENGE) return st;
  if (memcmp(m->nonce_w, nonce_w, RPL_NONCE_LEN) != 0)
    return rpl_fail(err, RPL_ERR_PEER, "group generator at %s answered HELLO with a "
                    "challenge for another HELLO", c->endpoint);
  memcpy(nonce_c, m->nonce_c, RPL_NONCE_LEN);
  uint8_t key[RPL_TOKEN_LEN];
  rpl_session_key(c->token, RPL_MSG_HELLO, c->rank, nonce_w, nonce_c, key);
  memcpy(c->key, key, RPL_TOKEN_LEN);
  return say_hello(c, nonce_w, nonce_c, deadline, m, err);
}

/* Opens a session until HELLO_ACK (in *m), an error, or hello_ms; a failure named for the
 * user. */
static rpl_status hello(rpl_gg_client *c, int hello_ms, rpl_msg *m, rpl_error *err) {
  rpl_status st;
  double deadline = now_s() + hello_ms / 1000.0;
  for (;;) {
    st = open_session(c, deadline, m, err);
    /* Our rank is still bound to the connection we closed a moment ago (the coordinator
     * lets it go once it sees it gone or silent): ask again while time remains. */
    if (st != RPL_OK || m->type != RPL_MSG_ERROR || m->code != RPL_PERR_BAD_RANK ||
        now_s() + 0.1 >= deadline)
      break;
    struct timespec pause = {0, 100 * 1000 * 1000};
    nanosleep(&pause, NULL);
  }
  if (st == RPL_ERR_TIMEOUT && strstr(err->msg, "MAC"))
    return rpl_fail(err, RPL_ERR_PEER,
                    "group generator at %s answered without this job's token (its replies "
                    "fail their MAC): another job's coordinator, or an endpoint that is not "
                    "the job's", c->endpoint);
  if (st == RPL_ERR_TIMEOUT)
    return rpl_fail(err, RPL_ERR_PEER,
                    "group generator at %s did not answer within %d ms (not running, wrong "
                    "endpoint, or unreachable)", c->endpoint, hello_ms);
  c->refused_unauth = st == RPL_OK && m->echo;
  if (c->refused_unauth) /* anyone on the path can forge it: its text is not shown */
    return rpl_fail(err, RPL_ERR_INVALID,
                    "group generator at %s refused this job's token (wrong job token: it "
                    "serves another job, or the job's workers disagree about "
                    "RIPPLES_JOB_SECRET). The refusal is unauthenticated, so it may also be "
                    "forged by someone on the path", c->endpoint);
  if (st == RPL_OK && m->type == RPL_MSG_ERROR) return from_error_reply(m, c->endpoint, err);
  if (st == RPL_OK && m->type != RPL_MSG_HELLO_ACK)
    return rpl_fail(err, RPL_ERR_PEER, "group generator at %s answered HELLO with %s",
                    c->endpoint, rpl_msg_type_name(m->type));
  return st;
}

/* Takes the heartbeat and dead intervals from HELLO_ACK and starts the heartbeat thread. */
static rpl_status start_beats(rpl_gg_client *c, const rpl_msg *m, rpl_error *err) {
  /* Beat at least as often as the coordinator asks (it may take a binding silent for two of
   * its intervals over), bounded: a coordinator's numbers are never trusted blindly. */
  uint32_t hb = m->heartbeat_ms ? m->heartbeat_ms : 1000;
  hb = hb < RPL_HEARTBEAT_MIN_MS ? RPL_HEARTBEAT_MIN_MS
                                 : hb > RPL_HEARTBEAT_MAX_MS ? RPL_HEARTBEAT_MAX_MS : hb;
  atomic_store(&c->beat_ms, c->heartbeat_ms > 0 && (uint32_t)c->heartbeat_ms < hb
                                ? (uint32_t)c->heartbeat_ms
                                : hb);
  uint32_t dead = m->dead_ms ? m->dead_ms : 10 * hb, dead_min = RPL_DEAD_MIN_BEATS * hb;
  atomic_store(&c->dead_ms,
               dead < dead_min ? dead_min : dead > RPL_DEAD_MAX_MS ? RPL_DEAD_MAX_MS : dead);
  atomic_store(&c->lost, 0);
  if (c->heartbeat_ms > 0) {
    if (pipe2(c->wake, O_CLOEXEC | O_NONBLOCK) != 0)
      return rpl_fail(err, RPL_ERR_SYSTEM, "group generator client: pipe: %s", strerror(errno));
    if (pthread_create(&c->beat, NULL, beat_main, c) != 0) {
      close(c->wake[0]);
      close(c->wake[1]);
      return rpl_fail(err, RPL_ERR_SYSTEM, "group generator client: pthread_create failed");
    }
    c->beat_started = 1;
  }
  return RPL_OK;
}

/* Connects a new request socket to eps[cur], registers (HELLO, waiting up to hello_ms) and
 * starts the heartbeat thread. On failure the socket is closed again. */
static rpl_status attach(rpl_gg_client *c, int hello_ms, rpl_error *err) {
  c->endpoint = c->eps[c->cur];
  c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
  if (!c->sock) return zfail(err, "socket", c->endpoint);
  int linger = 1000; /* let a final DONE/LEAVE go out on close */
  zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
  limit_inbound(c->sock);
  rpl_msg m;
  rpl_status st = connect_fresh(c, err);
  if (st == RPL_OK) st = hello(c, hello_ms, &m, err);
  if (st == RPL_OK) st = start_beats(c, &m, err);
  if (st != RPL_OK) {
    int zero = 0;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(c->sock);
    c->sock = NULL;
  }
  return st;
}

/* Stops the heartbeat thread and closes the request socket (what was queued is dropped). */
static void detach(rpl_gg_client *c, int linger_ms) {
  if (c->beat_started) {
    atomic_store(&c->stop, 1);
    if (write(c->wake[1], "", 1) < 0) { /* cannot fail on a fresh pipe; else within a beat */
    }
    pthread_join(c->beat, NULL);
    close(c->wake[0]);
    close(c->wake[1]);
    c->beat_started = 0;
    atomic_store(&c->stop, 0);
  }
  if (c->sock) {
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
    zmq_close(c->sock);
    c->sock = NULL;
  }
}

/* The current coordinator is lost: register with the next endpoint that answers (see the top).
 * Called with c->lock held. */
static rpl_status failover(rpl_gg_client *c, rpl_error *err) {
  double t = now_s();
  if (t < c->next_failover)
    return rpl_fail(err, RPL_ERR_PEER,
                    "no group generator answered at %s (the last one tried); the next "
                    "attempt is in %.1f s", c->endpoint, c->next_failover - t);
  detach(c, 0);
  int hello_ms = c->timeout_ms < FAILOVER_HELLO_MS ? c->timeout_ms : FAILOVER_HELLO_MS;
  rpl_error e;
  rpl_status st = RPL_ERR_PEER;
  for (int k = 0; k < c->neps; k++) {
    c->cur = (c->cur + 1) % c->neps;
    st = attach(c, hello_ms, &e);
    if (st == RPL_OK) {
      atomic_fetch_add(&c->failovers, 1);
      return RPL_OK;
    }
    /* Refused us: say why -- unless the refusal was unauthenticated, which must not stop
     * failover to the endpoints after it. */
    if ((st == RPL_ERR_INVALID || st == RPL_ERR_CLOSED) && !c->refused_unauth) break;
  }
  c->next_failover = now_s() + FAILOVER_SPACING_S;
  if (st == RPL_ERR_INVALID || st == RPL_ERR_CLOSED) {
    *err = e;
    return st;
  }
  return rpl_fail(err, RPL_ERR_PEER,
                  "lost the group generator, and none of its %d endpoint(s) answered "
                  "within %d ms (last: %s)", c->neps, hello_ms, c->endpoint);
}

/* Splits "a,b,c" into c->eps. */
static int parse_endpoints(rpl_gg_client *c, const char *list) {
  int cap = 1;
  for (const char *p = list; *p; p++) cap += *p == ',';
  c->eps = calloc((size_t)cap, sizeof *c->eps);
  if (!c->eps) return -1;
  const char *p = list;
  while (*p) {
    while (*p == ' ' || *p == ',') p++;
    const char *q = p;
    while (*q && *q != ',') q++;
    const char *e = q;
    while (e > p && e[-1] == ' ') e--;
    if (e > p) {
      c->eps[c->neps] = strndup(p, (size_t)(e - p));
      if (!c->eps[c->neps]) return -1;
      c->neps++;
    }
    p = q;
  }
  return 0;
}

rpl_status rpl_gg_client_create(const rpl_gg_client_config *cfg, rpl_gg_client **out,
                                rpl_error *err) {
  *out = NULL;
  if (!cfg || !cfg->endpoint || !*cfg->endpoint)
    return rpl_fail(err, RPL_ERR_INVALID, "group generator client: no endpoint");
  if (cfg->nworkers < 1 || cfg->nworkers > RPL_SCHED_MAX_WORKERS || cfg->rank < 0 ||
      cfg->rank >= cfg->nworkers)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "group generator client: rank %d / nworkers %d out of range",
                    cfg->rank, cfg->nworkers);
  rpl_gg_client *c = calloc(1, sizeof *c);
  if (!c) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory");
  rpl_status st = rpl_token_from_hex(cfg->token_hex, c->token, err);
  if (st != RPL_OK) {
    free(c);
    return st;
  }
  pthread_mutex_init(&c->lock, NULL);
  c->buf = malloc(MAX_MSG);
  c->rank = cfg->rank;
  c->nworkers = cfg->nworkers;
  c->host_label = cfg->host_label;
  c->timeout_ms = cfg->timeout_ms > 0 ? cfg->timeout_ms : 10000;
  c->request_timeout_ms = cfg->request_timeout_ms > 0 ? cfg->request_timeout_ms : 300000;
  c->heartbeat_ms = cfg->heartbeat_ms == 0 ? 1000 : cfg->heartbeat_ms;
  if (!c->buf || parse_endpoints(c, cfg->endpoint) != 0) {
    rpl_gg_client_destroy(c);
    return rpl_fail(err, RPL_ERR_NOMEM, "out of memory");
  }
  if (c->neps == 0) {
    rpl_gg_client_destroy(c);
    return rpl_fail(err, RPL_ERR_INVALID, "group generator client: no endpoint in '%s'",
                    cfg->endpoint);
  }
  c->endpoint = c->eps[0];
  c->ctx = cfg->zmq_context;
  if (!c->ctx) {
    c->ctx = zmq_ctx_new();
    c->own_ctx = 1;
  }
  if (!c->ctx) {
    st = zfail(err, "context", c->endpoint);
    rpl_gg_client_destroy(c);
    return st;
  }
  /* Registration at start goes to the primary only: the standbys are for later. */
  st = attach(c, c->timeout_ms, err);
  if (st != RPL_OK) {
    rpl_gg_client_destroy(c);
    return st;
  }
  *out = c;
  return RPL_OK;
}

static rpl_status send_simple(rpl_gg_client *c, int type, uint32_t *seq, rpl_error *err) {
  rpl_msg m;
  uint32_t s = next_seq(c);
  if (seq) *seq = s;
  fill_header(c, &m, type, s);
  return send_msg(c->sock, &m, NULL, err, c->endpoint);
}

rpl_status rpl_gg_client_request(rpl_gg_client *c, uint64_t round, int *members, int cap,
                                 int *n, uint64_t *group_id, rpl_error *err) {
  atomic_fetch_add(&c->asking, 1); /* before the lock: a fence never queues behind a request */
  pthread_mutex_lock(&c->lock);
  double t0 = now_s(), deadline = t0 + c->request_timeout_ms / 1000.0;
  rpl_status st;
  atomic_fetch_add(&c->requests, 1);
  /* Lost while this worker computed: register elsewhere before asking. */
  st = atomic_load(&c->lost) || !c->sock ? failover(c, err) : RPL_OK;
  for (; st == RPL_OK;) {
    rpl_msg m;
    uint32_t seq = next_seq(c);
    fill_header(c, &m, RPL_MSG_REQUEST, seq);
    m.round = round;
    st = send_msg(c->sock, &m, NULL, err, c->endpoint);
    if (st != RPL_OK) break;
    st = wait_reply(c, seq, deadline, &c->lost, &m, err);
    rpl_reply_kind kind = RPL_REPLY_FAIL;
    if (st == RPL_OK) {
      kind = rpl_client_request_reply(&m, round, c->rank, members, cap, n, group_id,
                                      c->endpoint, err);
      if (kind == RPL_REPLY_LOST) { /* a restarted coordinator: register again, below */
        atomic_store(&c->lost, 1);
        st = RPL_ERR_PEER;
      }
    }
    if (st == RPL_ERR_PEER && atomic_load(&c->lost)) {
      /* This round's group, if any, died with the coordinator: the round fails, and the
       * client moves on at once so that the next one is served. */
      char was[256];
      snprintf(was, sizeof was, "%s", c->endpoint);
      rpl_error e2;
      if (failover(c, &e2) == RPL_OK)
        st = rpl_fail(err, RPL_ERR_PEER,
                      "the group generator at %s was lost (no answer to heartbeats, or "
                      "it restarted): round %llu not served; the next rounds go to %s",
                      was, (unsigned long long)round, c->endpoint);
      else
        st = rpl_fail(err, RPL_ERR_PEER,
                      "the group generator at %s stopped answering heartbeats: round "
                      "%llu not served (%s)", was, (unsigned long long)round, e2.msg);
      break;
    }
    if (st == RPL_ERR_TIMEOUT) {
      /* Nobody must wait for a group we will not run: drop our place in every group. */
      rpl_error e2;
      send_simple(c, RPL_MSG_FENCE, NULL, &e2);
      send_simple(c, RPL_MSG_UNFENCE, NULL, &e2);
      st = rpl_fail(err, RPL_ERR_TIMEOUT,
                    "no group from the group generator at %s for round %llu within %d ms",
                    c->endpoint, (unsigned long long)round, c->request_timeout_ms);
      break;
    }
    if (st != RPL_OK) break;
    if (kind == RPL_REPLY_RETRY) {
      atomic_fetch_add(&c->cancels, 1);
      continue; /* a member fenced, left or died before the group started: ask again */
    }
    if (kind == RPL_REPLY_FAIL) {
      st = err->code;
      break;
    }
    if (kind == RPL_REPLY_PASS) atomic_fetch_add(&c->passes, 1);
    atomic_store(&c->period, m.period); /* the adaptive period: PASS = no averaging */
    break;
  }
  atomic_fetch_add(&c->wait_ns, (unsigned long long)((now_s() - t0) * 1e9));
  pthread_mutex_unlock(&c->lock);
  atomic_fetch_sub(&c->asking, 1);
  return st;
}

int rpl_gg_client_lost(rpl_gg_client *c) { return atomic_load(&c->lost) != 0; }

rpl_status rpl_gg_client_done(rpl_gg_client *c, uint64_t group_id, uint32_t status,
                              rpl_error *err) {
  pthread_mutex_lock(&c->lock);
  rpl_msg m;
  fill_header(c, &m, RPL_MSG_DONE, next_seq(c));
  m.group_id = group_id;
  m.status = status;
  rpl_status st = send_msg(c->sock, &m, NULL, err, c->endpoint);
  pthread_mutex_unlock(&c->lock);
  return st;
}

/* FENCE or UNFENCE, unless a request of this client is waiting for its group. Waiting for it
 * would tie an exact collective to the coordinator: with overlapped rounds the request's group
 * may need a partner that is itself inside that collective, waiting for this worker -- a cycle
 * that only the request's timeout broke. Skipping is also what the coordinator should see: a
 * worker whose round thread is asking is available for a group now (its request unfenced it),
 * and any FENCE went out before that request. Other holders of the lock (DONE, a fence, LEAVE)
 * hold it briefly. */
static rpl_status send_fence(rpl_gg_client *c, int type, rpl_error *err) {
  for (;;) {
    if (atomic_load(&c->asking)) return RPL_OK;
    if (pthread_mutex_trylock(&c->lock) == 0) break;
    struct timespec ts = {0, 200000}; /* 0.2 ms */
    nanosleep(&ts, NULL);
  }
  rpl_status st = send_simple(c, type, NULL, err);
  pthread_mutex_unlock(&c->lock);
  return st;
}

rpl_status rpl_gg_client_fence(rpl_gg_client *c, rpl_error *err) {
  return send_fence(c, RPL_MSG_FENCE, err);
}

rpl_status rpl_gg_client_unfence(rpl_gg_client *c, rpl_error *err) {
  return send_fence(c, RPL_MSG_UNFENCE, err);
}

rpl_status rpl_gg_client_leave(rpl_gg_client *c, rpl_error *err) {
  pthread_mutex_lock(&c->lock);
  uint32_t seq = 0;
  rpl_status st = send_simple(c, RPL_MSG_LEAVE, &seq, err);
  rpl_msg m;
  /* Leaving runs at shutdown, often at process exit, when the coordinator (on rank 0) may be
   * gone already; its ACK is a courtesy (silence is noticed through heartbeats anyway), so do
   * not hold the exit up for long. */
  int wait_ms = c->timeout_ms < 2000 ? c->timeout_ms : 2000;
  if (st == RPL_OK)
    st = wait_reply(c, seq, now_s() + wait_ms / 1000.0, NULL, &m, err);
  if (st == RPL_ERR_TIMEOUT)
    st = rpl_fail(err, RPL_ERR_PEER, "group generator at %s did not acknowledge LEAVE "
                  "within %d ms", c->endpoint, wait_ms);
  else if (st == RPL_OK && m.type == RPL_MSG_ERROR && m.code == RPL_PERR_NOT_REGISTERED)
    st = RPL_OK; /* a restarted coordinator never knew us: nothing to leave */
  else if (st == RPL_OK && m.type == RPL_MSG_ERROR)
    st = from_error_reply(&m, c->endpoint, err);
  else if (st == RPL_OK && m.type != RPL_MSG_ACK)
    st = rpl_fail(err, RPL_ERR_PEER, "group generator at %s answered LEAVE with %s",
                  c->endpoint, rpl_msg_type_name(m.type));
  pthread_mutex_unlock(&c->lock);
  return st;
}

void rpl_gg_client_destroy(rpl_gg_client *c) {
  if (!c) return;
  detach(c, 1000); /* a final DONE/LEAVE may still be on its way */
  if (c->own_ctx && c->ctx) zmq_ctx_term(c->ctx);
  pthread_mutex_destroy(&c->lock);
  for (int i = 0; i < c->neps; i++) free(c->eps[i]);
  free(c->eps);
  free(c->buf);
  free(c);
}

void rpl_gg_client_get_stats(rpl_gg_client *c, rpl_gg_client_stats *out) {
  out->requests = atomic_load(&c->requests);
  out->cancels = atomic_load(&c->cancels);
  out->heartbeats_sent = atomic_load(&c->hb_sent);
  out->heartbeats_acked = atomic_load(&c->hb_acked);
  out->heartbeat_ms = atomic_load(&c->beat_ms);
  out->dead_ms = atomic_load(&c->dead_ms);
  out->failovers = atomic_load(&c->failovers);
  out->passes = atomic_load(&c->passes);
  out->period = atomic_load(&c->period);
  out->wait_s = (double)atomic_load(&c->wait_ns) / 1e9;
}

/* Waits up to timeout_ms on s for the reply to STATUS `seq` (addressed to `rank`): MACed with
 * `key`, or an echoed refusal of the token. Received as it comes (up to the protocol's bound),
 * so a small answer costs no large buffer. RPL_OK with *m pointing into *in. */
static rpl_status status_reply(void *s, const char *endpoint, const uint8_t key[RPL_TOKEN_LEN],
                               int rank, uint32_t seq, int timeout_ms, zmq_msg_t *in, rpl_msg *m,
                               rpl_error *err) {
  double deadline = now_s() + timeout_ms / 1000.0;
  for (;;) {
    long ms = (long)((deadline - now_s()) * 1000.0);
    zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
    if (ms <= 0 || zmq_poll(&it, 1, ms) <= 0)
      return rpl_fail(err, RPL_ERR_PEER, "group generator at %s did not answer within %d ms",
                      endpoint, timeout_ms);
    if (zmq_msg_recv(in, s, 0) < 0) continue;
    rpl_error perr;
    const void *b = zmq_msg_data(in);
    size_t n = zmq_msg_size(in);
    if (rpl_msg_parse(b, n, 0, m, &perr) != RPL_OK || m->seq != seq || m->rank != rank)
      continue;
    if (m->echo || rpl_msg_authentic(b, n, key)) return RPL_OK;
  }
}

/* One STATUS query (rank -1: the whole document; else that rank's summary) to one endpoint
 * on a socket of its own: an opening under the token, the coordinator's CHALLENGE, and the
 * query answering it under the query's own key, which the reply carries (PROTOCOL.md). */
static rpl_status query_one(const char *endpoint, const uint8_t token[RPL_TOKEN_LEN], int rank,
                            int timeout_ms, char **json, rpl_error *err) {
  rpl_status st;
  void *ctx = zmq_ctx_new();
  void *s = ctx ? zmq_socket(ctx, ZMQ_DEALER) : NULL;
  zmq_msg_t in;
  zmq_msg_init(&in);
  if (!s) {
    st = zfail(err, "socket", endpoint);
    goto out;
  }
  int linger = 0;
  int64_t maxmsg = RPL_PROTO_HEADER + (int64_t)RPL_PROTO_MAX_BODY;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
  if (zmq_connect(s, endpoint) != 0) {
    st = rpl_fail(err, RPL_ERR_INVALID, "cannot connect to '%s': %s", endpoint,
                  zmq_strerror(zmq_errno()));
    goto out;
  }
  rpl_msg m;
  uint8_t key[RPL_TOKEN_LEN], nonce_w[RPL_NONCE_LEN], nonce_c[RPL_NONCE_LEN] = {0};
  st = rpl_token_generate(nonce_w, err);
  memcpy(key, token, RPL_TOKEN_LEN);
  for (uint32_t seq = 1; st == RPL_OK && seq <= 2; seq++) {
    memset(&m, 0, sizeof m);
    m.type = RPL_MSG_STATUS;
    m.rank = rank;
    m.seq = seq;
    memcpy(m.token, key, RPL_TOKEN_LEN);
    memcpy(m.nonce_w, nonce_w, RPL_NONCE_LEN);
    memcpy(m.nonce_c, nonce_c, RPL_NONCE_LEN); /* zero: the opening */
    st = send_msg(s, &m, NULL, err, endpoint);
    if (st == RPL_OK) st = status_reply(s, endpoint, key, rank, seq, timeout_ms, &in, &m, err);
    if (st != RPL_OK) break;
    if (m.type == RPL_MSG_ERROR) {
      st = from_error_reply(&m, endpoint, err);
      break;
    }
    if (seq == 1 && (m.type != RPL_MSG_CHALLENGE ||
                     memcmp(m.nonce_w, nonce_w, RPL_NONCE_LEN) != 0)) {
      st = rpl_fail(err, RPL_ERR_PEER, "group generator at %s answered STATUS with %s",
                    endpoint, rpl_msg_type_name(m.type));
      break;
    }
    if (seq == 1) {
      memcpy(nonce_c, m.nonce_c, RPL_NONCE_LEN);
      rpl_session_key(token, RPL_MSG_STATUS, rank, nonce_w, nonce_c, key);
    }
  }
  if (st != RPL_OK) goto out;
  if (m.type != RPL_MSG_STATUS_REPLY) {
    st = rpl_fail(err, RPL_ERR_PEER, "group generator at %s answered STATUS with %s", endpoint,
                  rpl_msg_type_name(m.type));
    goto out;
  }
  *json = malloc((size_t)m.text_len + 1);
  if (!*json) {
    st = rpl_fail(err, RPL_ERR_NOMEM, "out of memory");
    goto out;
  }
  memcpy(*json, m.text, m.text_len);
  (*json)[m.text_len] = '\0';
out:
  zmq_msg_close(&in);
  if (s) zmq_close(s);
  if (ctx) zmq_ctx_term(ctx);
  return st;
}

rpl_status rpl_gg_query_status(const char *endpoint, const char *token_hex, int timeout_ms,
                               char **json, rpl_error *err) {
  *json = NULL;
  uint8_t token[RPL_TOKEN_LEN];
  rpl_status st = rpl_token_from_hex(token_hex, token, err);
  if (st != RPL_OK) return st;
  return query_one(endpoint, token, -1, timeout_ms > 0 ? timeout_ms : 5000, json, err);
}

rpl_status rpl_gg_query_rank_status(const char *endpoints, const char *token_hex, int rank,
                                    int timeout_ms, char **json, rpl_error *err) {
  *json = NULL;
  uint8_t token[RPL_TOKEN_LEN];
  rpl_status st = rpl_token_from_hex(token_hex, token, err);
  if (st != RPL_OK) return st;
  if (rank < 0)
    return rpl_fail(err, RPL_ERR_INVALID, "rank %d: a rank's summary needs a rank", rank);
  if (!endpoints || !*endpoints)
    return rpl_fail(err, RPL_ERR_INVALID, "no coordinator endpoint");
  if (timeout_ms <= 0) timeout_ms = 5000;
  int tried = 0;
  char one[512];
  for (const char *p = endpoints; *p;) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    if (n > 0 && n < sizeof one) {
      memcpy(one, p, n);
      one[n] = '\0';
      tried = 1;
      st = query_one(one, token, rank, timeout_ms, json, err);
      if (st == RPL_OK) return st; /* else not this one (down, or a standby not serving us) */
    }
    p = e ? e + 1 : p + n;
  }
  if (!tried) return rpl_fail(err, RPL_ERR_INVALID, "no usable endpoint in '%s'", endpoints);
  return st; /* err: why the last one did not answer */
}
