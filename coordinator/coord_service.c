/* The Group Generator service's ZeroMQ loop: one ROUTER socket, one thread, messages handled
 * one at a time by coord_core (so the policy needs no locks). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "common.h"
#include "coord_core.h"

/* Largest message a worker may send; anything bigger is cut off by zmq (ZMQ_MAXMSGSIZE). */
#define COORD_MAX_IN 4096
/* Messages queued per incoming connection (zmq's default is 1000), and how long a connection
 * may take to finish its ZMTP handshake (zmq's default is 30 s). */
#define COORD_RCVHWM 256
/* Replies queued per connection at most (a worker has a handful outstanding): a connection
 * that never reads -- replaying STATUS queries, say -- stops being answered instead of
 * growing the coordinator's memory without bound. */
#define COORD_SNDHWM 32
#define COORD_HANDSHAKE_MS 5000

struct rpl_coord {
  coord_core core;
  void *ctx;
  void *sock;
  char endpoint[256];
  atomic_int stop;
  int running;
  pthread_t thread;
  int thread_started;
  rpl_error thread_err;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int zsend(void *ctx, const uint8_t *route, size_t route_len, const void *msg,
                 size_t len) {
  rpl_coord *c = ctx;
  /* ROUTER_MANDATORY: a route with no connected peer fails at once with EHOSTUNREACH. */
  if (zmq_send(c->sock, route, route_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
    return zmq_errno() == EHOSTUNREACH ? COORD_SEND_GONE : -1;
  if (zmq_send(c->sock, msg, len, ZMQ_DONTWAIT) < 0) return -1;
  return 0;
}

rpl_status rpl_coord_create(const rpl_coord_config *cfg, rpl_coord **out, rpl_error *err) {
  *out = NULL;
  rpl_coord *c = calloc(1, sizeof *c);
  if (!c) return rpl_fail(err, RPL_ERR_NOMEM, "coordinator: out of memory");
  rpl_status st = coord_core_init(&c->core, cfg, err);
  if (st != RPL_OK) {
    free(c);
    return st;
  }
  c->core.send = zsend;
  c->core.send_ctx = c;
  c->core.start = now_s();
  const char *bind = cfg->bind ? cfg->bind : "tcp://127.0.0.1:*";
  c->ctx = zmq_ctx_new();
  c->sock = c->ctx ? zmq_socket(c->ctx, ZMQ_ROUTER) : NULL;
  if (!c->sock) {
    st = rpl_fail(err, RPL_ERR_SYSTEM, "coordinator: zmq socket: %s",
                  zmq_strerror(zmq_errno()));
    rpl_coord_destroy(c);
    return st;
  }
  int one = 1, zero = 0, hwm = COORD_RCVHWM, sndhwm = COORD_SNDHWM,
      handshake_ms = COORD_HANDSHAKE_MS;
  int64_t maxmsg = COORD_MAX_IN;
  /* Replies to a vanished peer fail instead of blocking; oversized input is refused by zmq
   * (it closes that connection). What one stranger's connection may cost is bounded: at most
   * COORD_RCVHWM queued messages of at most COORD_MAX_IN bytes, and a connection that has not
   * finished the ZMTP handshake within COORD_HANDSHAKE_MS is dropped. HANDOVER stays off (the
   * default, set anyway): a second connection claiming a routing id in use is refused, so no
   * one can steal a worker's route. */
  zmq_setsockopt(c->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
  zmq_setsockopt(c->sock, ZMQ_ROUTER_HANDOVER, &zero, sizeof zero);
  zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof zero);
  zmq_setsockopt(c->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
  zmq_setsockopt(c->sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
  zmq_setsockopt(c->sock, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm);
  zmq_setsockopt(c->sock, ZMQ_HANDSHAKE_IVL, &handshake_ms, sizeof handshake_ms);
  if (zmq_bind(c->sock, bind) != 0) {
    st = rpl_fail(err, RPL_ERR_SYSTEM, "coordinator: cannot bind '%s': %s", bind,
                  zmq_strerror(zmq_errno()));
    rpl_coord_destroy(c);
    return st;
  }
  size_t elen = sizeof c->endpoint;
  if (zmq_getsockopt(c->sock, ZMQ_LAST_ENDPOINT, c->endpoint, &elen) != 0) {
    strncpy(c->endpoint, bind, sizeof c->endpoint - 1);
  }
  *out = c;
  return RPL_OK;
}

rpl_status rpl_coord_run(rpl_coord *c, rpl_error *err) {
  uint8_t route[RPL_ROUTE_MAX + 1];
  uint8_t *msg = malloc(COORD_MAX_IN);
  if (!msg) return rpl_fail(err, RPL_ERR_NOMEM, "coordinator: out of memory");
  double tick_every = c->core.heartbeat_ms / 4000.0, next_tick = now_s() + tick_every;
  double next_wait = -1; /* when a request waiting for partners must be served */
  rpl_status st = RPL_OK;
  while (!atomic_load(&c->stop)) {
    zmq_pollitem_t it = {c->sock, 0, ZMQ_POLLIN, 0};
    long ms = 50;
    if (next_wait >= 0) {
      double left = (next_wait - now_s()) * 1000.0;
      ms = left <= 0 ? 0 : left < 50 ? (long)left + 1 : 50;
    }
    int rc = zmq_poll(&it, 1, ms);
    if (rc < 0 && zmq_errno() != EINTR) {
      st = rpl_fail(err, RPL_ERR_SYSTEM, "coordinator: poll: %s", zmq_strerror(zmq_errno()));
      break;
    }
    /* Drain what is there, bounded so liveness ticks still run under load. */
    for (int k = 0; rc > 0 && k < 10000; k++) {
      int rl = zmq_recv(c->sock, route, sizeof route, ZMQ_DONTWAIT);
      if (rl < 0) break;
      int more = 0;
      size_t ml = sizeof more;
      zmq_getsockopt(c->sock, ZMQ_RCVMORE, &more, &ml);
      if (!more) { /* a routing id with no payload: cannot happen on ROUTER, count it */
        atomic_fetch_add(&c->core.malformed, 1);
        continue;
      }
      int n = zmq_recv(c->sock, msg, COORD_MAX_IN, 0);
      zmq_getsockopt(c->sock, ZMQ_RCVMORE, &more, &ml);
      int extra = 0;
      while (more) { /* the protocol is one frame per message: drop the rest */
        zmq_msg_t part;
        zmq_msg_init(&part);
        zmq_msg_recv(&part, c->sock, 0);
        zmq_msg_close(&part);
        zmq_getsockopt(c->sock, ZMQ_RCVMORE, &more, &ml);
        extra = 1;
      }
      if (n < 0) continue;
      if (extra || n > COORD_MAX_IN || rl > RPL_ROUTE_MAX) {
        atomic_fetch_add(&c->core.messages, 1);
        atomic_fetch_add(&c->core.malformed, 1);
        continue;
      }
      coord_core_handle(&c->core, route, (size_t)rl, msg, (size_t)n, now_s());
    }
    double t = now_s();
    next_wait = coord_core_advance(&c->core, t);
    if (t >= next_tick) {
      coord_core_tick(&c->core, t);
      next_tick = t + tick_every;
    }
  }
  free(msg);
  return st;
}

static void *coord_main(void *arg) {
  rpl_coord *c = arg;
  pthread_setname_np(pthread_self(), "rpl-gg-coord");
  rpl_coord_run(c, &c->thread_err);
  return NULL;
}

rpl_status rpl_coord_start(rpl_coord *c, rpl_error *err) {
  if (c->thread_started)
    return rpl_fail(err, RPL_ERR_INVALID, "coordinator: already started");
  atomic_store(&c->stop, 0);
  if (pthread_create(&c->thread, NULL, coord_main, c) != 0)
    return rpl_fail(err, RPL_ERR_SYSTEM, "coordinator: pthread_create failed");
  c->thread_started = 1;
  return RPL_OK;
}

void rpl_coord_stop(rpl_coord *c) {
  if (!c) return;
  atomic_store(&c->stop, 1);
  if (c->thread_started) {
    pthread_join(c->thread, NULL);
    c->thread_started = 0;
  }
}

void rpl_coord_destroy(rpl_coord *c) {
  if (!c) return;
  rpl_coord_stop(c);
  if (c->sock) zmq_close(c->sock);
  if (c->ctx) zmq_ctx_term(c->ctx);
  coord_core_free(&c->core);
  free(c);
}

const char *rpl_coord_endpoint(const rpl_coord *c) { return c->endpoint; }
const char *rpl_coord_token(const rpl_coord *c) { return c->core.token_hex; }

int rpl_coord_active_workers(const rpl_coord *c, int except_rank) {
  return coord_core_active(&c->core, except_rank);
}

void rpl_coord_get_counters(const rpl_coord *c, rpl_coord_counters *out) {
  coord_core *k = (coord_core *)&c->core;
  out->messages = atomic_load(&k->messages);
  out->malformed = atomic_load(&k->malformed);
  out->bad_token = atomic_load(&k->bad_token);
  out->errors_sent = atomic_load(&k->errors_sent);
  out->dead_declared = atomic_load(&k->dead_declared);
  out->send_failures = atomic_load(&k->send_failures);
  out->wrong_route = atomic_load(&k->wrong_route);
  out->replayed = atomic_load(&k->replayed);
  out->rebinds = atomic_load(&k->rebinds);
  out->probes_withheld = atomic_load(&k->probes_withheld);
  out->bad_token_quiet = atomic_load(&k->bad_token_quiet);
  out->challenges = atomic_load(&k->challenges);
  out->bad_session = atomic_load(&k->bad_session);
}
