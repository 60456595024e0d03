/* The Group Generator service's ZeroMQ loop: one ROUTER socket, one thread, messages handled
 * one at a time by coord_core (so the policy needs no locks). */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common.h"
#include "coord_conns.h"
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
/* Connections at most: each worker's two, their reconnections and tools' queries, with room
 * to spare. Past it the oldest connection that never proved the token is closed, so a
 * stranger holding connections open cannot use up the coordinator's descriptors while the
 * job's own connections stay. */
#define COORD_CONNS_PER_WORKER 4
#define COORD_CONNS_SPARE 64

struct rpl_coord {
  coord_core core;
  void *ctx;
  void *sock;
  void *mon;                /* PAIR socket receiving the ROUTER's connection events */
  coord_conns conns;        /* for the cap on connections */
  int port;                 /* the TCP port bound (0: not TCP) */
  char endpoint[256];
  atomic_int stop;
  int running;
  pthread_t thread;
  int thread_started;
  int wake[2];              /* a byte written to wake[1] ends the thread's wait: it sleeps
                             * until its next tick or deadline, not in short polls (each
                             * wake-up takes a core from training where cores are few) */
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
  if (pipe2(c->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
    free(c);
    return rpl_fail(err, RPL_ERR_SYSTEM, "coordinator: pipe: %s", strerror(errno));
  }
  rpl_status st = coord_core_init(&c->core, cfg, err);
  if (st != RPL_OK) {
    close(c->wake[0]);
    close(c->wake[1]);
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
  const char *colon = strrchr(c->endpoint, ':');
  c->port = strncmp(c->endpoint, "tcp://", 6) == 0 && colon ? atoi(colon + 1) : 0;
  /* The connection cap learns of connections from the ROUTER's monitor. */
  char mon[64];
  snprintf(mon, sizeof mon, "inproc://rpl-coord-monitor-%p", (void *)c);
  coord_conns_init(&c->conns, COORD_CONNS_PER_WORKER * c->core.nworkers + COORD_CONNS_SPARE);
  if (zmq_socket_monitor(c->sock, mon, ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED) != 0 ||
      !(c->mon = zmq_socket(c->ctx, ZMQ_PAIR)) || zmq_connect(c->mon, mon) != 0) {
    st = rpl_fail(err, RPL_ERR_SYSTEM, "coordinator: zmq socket monitor: %s",
                  zmq_strerror(zmq_errno()));
    rpl_coord_destroy(c);
    return st;
  }
  *out = c;
  return RPL_OK;
}

/* Whether fd is still a connection accepted on our port: ZeroMQ may have closed it and the
 * process (rank 0 embeds the coordinator) reused the number for a socket of its own before
 * the close event was read; such a socket must never be shut down. */
static int accepted_here(const rpl_coord *c, int fd) {
  struct sockaddr_storage a, peer;
  socklen_t n = sizeof a, pn = sizeof peer;
  if (c->port <= 0 || getsockname(fd, (struct sockaddr *)&a, &n) != 0 ||
      getpeername(fd, (struct sockaddr *)&peer, &pn) != 0) /* a listener has no peer */
    return 0;
  int port = a.ss_family == AF_INET    ? ntohs(((struct sockaddr_in *)&a)->sin_port)
             : a.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&a)->sin6_port)
                                       : -1;
  return port == c->port;
}

/* Past the cap: closes the oldest connections that never proved the token (shutdown: the
 * ZeroMQ I/O thread that owns the descriptor sees it end and closes it). */
static void enforce_cap(rpl_coord *c) {
  for (int fd; (fd = coord_conns_victim(&c->conns)) >= 0;) {
    if (!accepted_here(c, fd)) continue; /* closed already, its number reused */
    shutdown(fd, SHUT_RDWR);
    atomic_fetch_add(&c->core.connections_dropped, 1);
  }
}

/* Connection events from the monitor: each is a frame of u16 event and u32 value (the
 * descriptor), then a frame with the endpoint. */
static void read_conn_events(rpl_coord *c) {
  for (;;) {
    zmq_msg_t ev;
    zmq_msg_init(&ev);
    if (zmq_msg_recv(&ev, c->mon, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&ev);
      return;
    }
    uint16_t event = 0;
    int32_t fd = -1;
    if (zmq_msg_size(&ev) >= 6) {
      memcpy(&event, zmq_msg_data(&ev), 2);
      memcpy(&fd, (const char *)zmq_msg_data(&ev) + 2, 4);
    }
    int more = zmq_msg_more(&ev);
    zmq_msg_close(&ev);
    while (more) {
      zmq_msg_t part;
      zmq_msg_init(&part);
      if (zmq_msg_recv(&part, c->mon, 0) < 0) more = 0;
      else more = zmq_msg_more(&part);
      zmq_msg_close(&part);
    }
    if (event == ZMQ_EVENT_ACCEPTED) coord_conns_accepted(&c->conns, fd);
    else if (event == ZMQ_EVENT_DISCONNECTED) coord_conns_closed(&c->conns, fd);
  }
}

rpl_status rpl_coord_run(rpl_coord *c, rpl_error *err) {
  uint8_t route[RPL_ROUTE_MAX + 1];
  double tick_every = c->core.heartbeat_ms / 4000.0, next_tick = now_s() + tick_every;
  double next_wait = -1; /* when a request waiting for partners must be served */
  rpl_status st = RPL_OK;
  zmq_msg_t in;
  zmq_msg_init(&in);
  while (!atomic_load(&c->stop)) {
    /* Until the next liveness tick or a request's deadline, whichever is first (a message,
     * a connection event or a stop wakes it sooner). */
    double due = next_wait >= 0 && next_wait < next_tick ? next_wait : next_tick;
    double left = (due - now_s()) * 1000.0;
    long ms = left <= 0 ? 0 : (long)left + 1;
    zmq_pollitem_t it[3] = {{c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0},
                            {NULL, c->wake[0], ZMQ_POLLIN, 0}};
    int rc = zmq_poll(it, 3, ms);
    if (rc < 0 && zmq_errno() != EINTR) {
      st = rpl_fail(err, RPL_ERR_SYSTEM, "coordinator: poll: %s", zmq_strerror(zmq_errno()));
      break;
    }
    if (rc > 0 && (it[2].revents & ZMQ_POLLIN)) { /* a stop (the loop's test) or a stale one */
      char drain[16];
      while (read(c->wake[0], drain, sizeof drain) > 0) {
      }
    }
    if (rc > 0) read_conn_events(c); /* first: messages name their connection */
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
      int n = zmq_msg_recv(&in, c->sock, 0);
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
      double t = now_s();
      if (coord_core_handle(&c->core, route, (size_t)rl, zmq_msg_data(&in), (size_t)n, t))
        coord_conns_authed(&c->conns, zmq_msg_get(&in, ZMQ_SRCFD));
    }
    enforce_cap(c);
    double t = now_s();
    next_wait = coord_core_advance(&c->core, t);
    if (t >= next_tick) {
      coord_core_tick(&c->core, t);
      next_tick = t + tick_every;
    }
  }
  zmq_msg_close(&in);
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
  /* async-signal-safe (the CLI stops from a signal handler); a full pipe has a byte already */
  if (write(c->wake[1], "", 1) < 0) {
  }
  if (c->thread_started) {
    pthread_join(c->thread, NULL);
    c->thread_started = 0;
  }
}

void rpl_coord_destroy(rpl_coord *c) {
  if (!c) return;
  rpl_coord_stop(c);
  if (c->sock) zmq_socket_monitor(c->sock, NULL, 0);
  if (c->mon) zmq_close(c->mon);
  if (c->sock) zmq_close(c->sock);
  if (c->ctx) zmq_ctx_term(c->ctx);
  close(c->wake[0]);
  close(c->wake[1]);
  coord_core_free(&c->core);
  coord_conns_free(&c->conns);
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
  out->connections_dropped = atomic_load(&k->connections_dropped);
}
