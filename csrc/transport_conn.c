/* transport_conn.c - the transport's connections: creating it (its listener, its identity),
 * peers' addresses, connecting, the link handshake on both sides (wire.h), connections that
 * have not authenticated yet, and probes of peers that never connected. */
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common.h"
#include "crypto.h"
#include "transport_internal.h"

/* A connection that has not authenticated is dropped once it has been silent this long
 * before its first message (a peer sends HS1 right after connecting), or this long after our
 * challenge (a peer answers it as soon as a run of its own reads it). */
#define HS1_WAIT_S 5.0
#define HS3_WAIT_S 60.0

_Static_assert(RPL_TR_KEY_LEN == RPL_LINK_KEY_LEN, "one key length");

/* ---- setup --------------------------------------------------------------------------- */

static void tune_data_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* The transport and its per-peer tables, nothing opened yet; NULL when out of memory. */
static rpl_tr *tr_alloc(int rank, int size) {
  rpl_tr *tr = calloc(1, sizeof *tr);
  if (!tr) return NULL;
  tr->rank = rank;
  tr->size = size;
  tr->listen_fd = -1;
  tr->wake_fd = -1;
  tr->peer_addr = calloc((size_t)size, sizeof *tr->peer_addr);
  tr->peer_nonce = calloc((size_t)size, sizeof *tr->peer_nonce);
  tr->conns = calloc((size_t)size, sizeof *tr->conns);
  tr->act_send = calloc((size_t)size, sizeof(int));
  tr->act_recv = calloc((size_t)size, sizeof(int));
  tr->any_read = calloc((size_t)size, 1);
  tr->pfds = calloc((size_t)size + 3 + PEND_MAX, sizeof *tr->pfds);
  tr->pfd_peer = calloc((size_t)size + 3 + PEND_MAX, sizeof(int));
  tr->peer_uport = calloc((size_t)size, sizeof *tr->peer_uport);
  if (!tr->peer_addr || !tr->peer_nonce || !tr->conns || !tr->act_send || !tr->act_recv ||
      !tr->any_read || !tr->pfds || !tr->pfd_peer || !tr->peer_uport) {
    rpl_tr_destroy(tr);
    return NULL;
  }
  for (int i = 0; i < size; i++) tr->conns[i].fd = tr->conns[i].probe_fd = -1;
  return tr;
}

/* Draws the transport's identity and opens its wake-up descriptor, its listener on bind_addr
 * and, with use_ucx, its UCX worker. */
static rpl_status tr_open(rpl_tr *tr, const char *bind_addr, int use_ucx, rpl_error *err) {
  /* The transport's identity: a connection naming another one is dropped at its first
   * message. From the kernel's CSPRNG, never from a guessable fallback. */
  rpl_status st = rpl_random_bytes(&tr->nonce, sizeof tr->nonce, err);
  if (st != RPL_OK) return st;

  const char *addr = bind_addr && *bind_addr ? bind_addr : "127.0.0.1";
  memset(&tr->self, 0, sizeof tr->self);
  tr->self.sin_family = AF_INET;
  if (inet_pton(AF_INET, addr, &tr->self.sin_addr) != 1)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "bind address '%s' is not an IPv4 address (set RIPPLES_BIND_ADDR to the IP "
                    "peers should use to reach this process)", addr);
  tr->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  tr->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (tr->wake_fd < 0 || tr->listen_fd < 0)
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, errno, "cannot create sockets");
  socklen_t sl = sizeof tr->self;
  if (bind(tr->listen_fd, (struct sockaddr *)&tr->self, sizeof tr->self) != 0 ||
      listen(tr->listen_fd, 256) != 0 ||
      getsockname(tr->listen_fd, (struct sockaddr *)&tr->self, &sl) != 0)
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, errno, "cannot listen on %s", addr);
  return use_ucx ? rpl_ucx_create(&tr->self.sin_addr, &tr->ucx, err) : RPL_OK;
}

rpl_status rpl_tr_create(int rank, int size, const char *bind_addr, int use_ucx, rpl_tr **out,
                         rpl_error *err) {
  *out = NULL;
  rpl_tr *tr = tr_alloc(rank, size);
  if (!tr) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating the transport");
  rpl_status st = tr_open(tr, bind_addr, use_ucx, err);
  if (st != RPL_OK) {
    rpl_tr_destroy(tr);
    return st;
  }
  *out = tr;
  return RPL_OK;
}

void rpl_tr_destroy(rpl_tr *tr) {
  if (!tr) return;
  rpl_tr_abort(tr);
  explicit_bzero(tr->key, sizeof tr->key); /* no copy of the key outlives the transport */
  rpl_shm_destroy(tr->shm);
  rpl_ucx_destroy(tr->ucx);
  free(tr->peer_uport);
  if (tr->wake_fd >= 0) close(tr->wake_fd);
  free(tr->peer_addr);
  free(tr->peer_nonce);
  free(tr->conns);
  free(tr->act_send);
  free(tr->act_recv);
  free(tr->any_read);
  free(tr->pfds);
  free(tr->pfd_peer);
  free(tr);
}

void rpl_tr_address(const rpl_tr *tr, char *buf, size_t cap) {
  char ip[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &tr->self.sin_addr, ip, sizeof ip);
  snprintf(buf, cap, "%s:%u:%016" PRIx64 ":%u", ip, (unsigned)ntohs(tr->self.sin_port),
           tr->nonce, tr->ucx ? rpl_ucx_port(tr->ucx) : 0u);
}

rpl_status rpl_tr_set_peer(rpl_tr *tr, int peer, const char *address, rpl_error *err) {
  char ip[64];
  unsigned port = 0;
  uint64_t nonce = 0;
  unsigned uport = 0;
  const char *c1 = strchr(address, ':');
  const char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
  const char *c3 = c2 ? strchr(c2 + 1, ':') : NULL;
  if (!c1 || !c2 || !c3 || (size_t)(c1 - address) >= sizeof ip ||
      sscanf(c1 + 1, "%u", &port) != 1 || port == 0 || port > 65535 ||
      sscanf(c2 + 1, "%" SCNx64, &nonce) != 1 || sscanf(c3 + 1, "%u", &uport) != 1 ||
      uport > 65535)
    return rpl_fail(err, RPL_ERR_INVALID, "malformed address '%.80s' published by rank %d",
                    address, peer);
  memcpy(ip, address, (size_t)(c1 - address));
  ip[c1 - address] = '\0';
  struct sockaddr_in *sa = &tr->peer_addr[peer];
  memset(sa, 0, sizeof *sa);
  sa->sin_family = AF_INET;
  sa->sin_port = htons((uint16_t)port);
  if (inet_pton(AF_INET, ip, &sa->sin_addr) != 1)
    return rpl_fail(err, RPL_ERR_INVALID, "rank %d published a bad IPv4 address '%s'", peer, ip);
  tr->peer_nonce[peer] = nonce;
  tr->peer_uport[peer] = uport;
  /* Both ends of a link must agree on its kind: the lower rank connects with its own. */
  if (!tr->ucx != !uport)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "rank %d %s UCX across hosts but this rank %s (every rank of a group must "
                    "pass the same transport option)", peer, uport ? "uses" : "does not use",
                    tr->ucx ? "does" : "does not");
  return RPL_OK;
}

void rpl_tr_set_shm(rpl_tr *tr, rpl_shm *shm) { tr->shm = shm; }

void rpl_tr_set_key(rpl_tr *tr, const unsigned char key[RPL_TR_KEY_LEN]) {
  memcpy(tr->key, key, RPL_TR_KEY_LEN);
}

void rpl_tr_set_frame_macs(rpl_tr *tr, int on) { tr->frame_macs = on != 0; }

/* ---- connection establishment -------------------------------------------------------- */

void rpl_tr_peer_desc(const rpl_tr *tr, int peer, char *buf, size_t cap) {
  char ip[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &tr->peer_addr[peer].sin_addr, ip, sizeof ip);
  snprintf(buf, cap, "rank %d (%s:%u)", peer, ip, (unsigned)ntohs(tr->peer_addr[peer].sin_port));
}

/* A peer connected afresh: its old link (if any) is dead. If this run was still using it, the
 * run fails (see replaced_error). */
static void replace_conn(rpl_tr *tr, int peer) {
  if (tr->conns[peer].state == CONN_NONE) return;
  if (tr->act_send[peer] >= 0 || tr->act_recv[peer] >= 0) tr->replaced = peer;
  rpl_tr_close_conn(&tr->conns[peer]);
}

/* 1 while the socket link to `peer` is up and its peer has not shut its end: an authenticated
 * newcomer for that peer is then refused rather than allowed to take the link over. (A peer
 * that gave up on a link closes it before connecting again, and its FIN arrives before the
 * new connection has finished authenticating.) UCX links are replaced as before: their
 * failure is reported by UCX's error handler, which may come later than the new endpoint. */
static int link_healthy(const rpl_tr *tr, int peer) {
  const conn *c = &tr->conns[peer];
  if (c->state != CONN_READY || c->fd < 0) return 0;
  struct pollfd p = {.fd = c->fd, .events = POLLRDHUP};
  return poll(&p, 1, 0) == 0;
}

/* The connector's first message, with a fresh nonce; kept in c->hs1 for the checks after. */
static rpl_status make_hs1(rpl_tr *tr, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  unsigned char nonce[RPL_HS_NONCE_LEN];
  rpl_status st = rpl_random_bytes(nonce, sizeof nonce, err);
  if (st != RPL_OK) return st;
  rpl_hs1_make(c->hs1, tr->rank, peer, tr->size, tr->peer_nonce[peer], nonce);
  c->hs_got = 0;
  return RPL_OK;
}

static rpl_status auth_error(rpl_tr *tr, int peer, const char *what, rpl_error *err) {
  char d[96];
  rpl_tr_peer_desc(tr, peer, d, sizeof d);
  return rpl_fail(err, RPL_ERR_PEER,
                  "%s %s: the link was not authenticated (the peer exited, or the two ranks "
                  "hold different link keys: do all ranks use the same job secret, "
                  "RIPPLES_JOB_SECRET / Options(job_secret)? is another process listening on "
                  "that address?)", d, what);
}

/* UCX: the lower rank connects to the peer's UCX listener and sends HS1 on the new stream. */
static rpl_status start_connect_ucx(rpl_tr *tr, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  rpl_status st = make_hs1(tr, peer, err);
  if (st != RPL_OK) return st;
  struct sockaddr_in to = tr->peer_addr[peer];
  to.sin_port = htons((uint16_t)tr->peer_uport[peer]);
  st = rpl_ucx_connect(tr->ucx, &to, c->hs1, RPL_HS1_SIZE, &c->ux, err);
  if (st != RPL_OK) return st;
  c->state = CONN_HANDSHAKE;
  return RPL_OK;
}

static rpl_status start_connect(rpl_tr *tr, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return rpl_fail_errno(err, RPL_ERR_SYSTEM, errno, "cannot create a socket");
  int r = connect(fd, (struct sockaddr *)&tr->peer_addr[peer], sizeof tr->peer_addr[peer]);
  if (r != 0 && errno != EINPROGRESS) {
    int e = errno;
    close(fd);
    char d[96];
    rpl_tr_peer_desc(tr, peer, d, sizeof d);
    return rpl_fail_errno(err, RPL_ERR_PEER, e, "cannot connect to %s (has it exited?)", d);
  }
  c->fd = fd;
  c->state = CONN_CONNECTING;
  return RPL_OK;
}

/* The connect completed (or failed): check, then send HS1 and wait for the acceptor's HS2. */
static rpl_status finish_connect(rpl_tr *tr, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  int soerr = 0;
  socklen_t sl = sizeof soerr;
  getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
  char d[96];
  rpl_tr_peer_desc(tr, peer, d, sizeof d);
  if (soerr != 0) {
    rpl_tr_close_conn(c);
    return rpl_fail_errno(err, RPL_ERR_PEER, soerr, "cannot connect to %s (has it exited?)", d);
  }
  rpl_status st = make_hs1(tr, peer, err);
  if (st != RPL_OK) return st;
  /* A fresh socket's send buffer takes a handshake message at once. */
  if (send(c->fd, c->hs1, RPL_HS1_SIZE, MSG_NOSIGNAL) != (ssize_t)RPL_HS1_SIZE) {
    int e = errno;
    rpl_tr_close_conn(c);
    return rpl_fail_errno(err, RPL_ERR_PEER, e, "cannot greet %s", d);
  }
  tune_data_socket(c->fd);
  c->state = CONN_HANDSHAKE;
  return RPL_OK;
}

/* Connector: reads the acceptor's HS2 as it arrives; once it proves the key, answers with HS3
 * and the link is ready (data may follow HS3 at once: the acceptor reads it in order). */
static rpl_status continue_handshake(rpl_tr *tr, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  if (c->state == CONN_HS_SENDING) { /* UCX: HS3 under way */
    ssize_t w = rpl_ucx_write(c->ux, c->hs3, RPL_HS3_SIZE, NULL, 0);
    if (w < 0) return rpl_tr_peer_closed(tr, peer, 0, "authenticating", err); /* UCX says why */
    if (w > 0) {
      c->state = CONN_READY;
      count_add(&tr->counters.connections, 1);
      count_add(&tr->counters.ucx_connections, 1);
    }
    return RPL_OK;
  }
  while (c->hs_got < RPL_HS2_SIZE) {
    ssize_t r;
    if (c->ux) {
      r = rpl_ucx_read(c->ux, c->hs2 + c->hs_got, RPL_HS2_SIZE - c->hs_got);
      if (r == 0) return RPL_OK;
    } else {
      r = recv(c->fd, c->hs2 + c->hs_got, RPL_HS2_SIZE - c->hs_got, MSG_DONTWAIT);
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return RPL_OK;
      if (r == 0) r = -1;
    }
    if (r < 0 && c->ux) return rpl_tr_peer_closed(tr, peer, 0, "authenticating", err);
    if (r < 0) {
      rpl_tr_close_conn(c);
      return auth_error(tr, peer, "closed the connection while authenticating", err);
    }
    c->hs_got += (size_t)r;
  }
  if (!rpl_hs2_check(c->hs2, tr->key, c->hs1, peer)) {
    rpl_tr_close_conn(c);
    count_add(&tr->counters.auth_failures, 1);
    return auth_error(tr, peer, "answered with a wrong proof", err);
  }
  rpl_hs3_make(c->hs3, tr->key, c->hs1, c->hs2);
  if (c->ux) {
    c->state = CONN_HS_SENDING;
    return continue_handshake(tr, peer, err);
  }
  if (send(c->fd, c->hs3, RPL_HS3_SIZE, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)RPL_HS3_SIZE) {
    int e = errno;
    rpl_tr_close_conn(c);
    return rpl_fail_errno(err, RPL_ERR_PEER, e, "cannot complete the handshake with rank %d",
                          peer);
  }
  c->state = CONN_READY;
  rpl_tr_frame_key(tr, c, c->hs1, c->hs2);
  count_add(&tr->counters.connections, 1);
  return RPL_OK;
}

rpl_status rpl_tr_conn_advance(rpl_tr *tr, int peer, rpl_error *err) {
  if (tr->conns[peer].state == CONN_CONNECTING) return finish_connect(tr, peer, err);
  return continue_handshake(tr, peer, err);
}

/* ---- the acceptor's side: connections that have not authenticated yet ---------------- *
 * Nothing here blocks: each pending connection is read when it has data, its messages are
 * fixed-size, and it is dropped at a deadline, on a wrong message, or for a newcomer when the
 * table is full. A stranger costs a run one accept and one short read, never a wait. */

static void pend_drop(rpl_tr *tr, int i) {
  pend *w = &tr->pend[i];
  if (w->fd >= 0) close(w->fd);
  if (w->ep) rpl_ucx_close(w->ep, 0);
  *w = tr->pend[--tr->n_pend];
}

void rpl_tr_pend_clear(rpl_tr *tr) {
  while (tr->n_pend > 0) pend_drop(tr, tr->n_pend - 1);
}

/* Drops pending connection i if it is past its deadline; returns 1 if it did. */
static int pend_expire(rpl_tr *tr, int i, double now) {
  pend *w = &tr->pend[i];
  if (!(now - w->since > (w->stage ? HS3_WAIT_S : HS1_WAIT_S))) return 0;
  pend_drop(tr, i);
  count_add(&tr->counters.handshakes_dropped, 1);
  return 1;
}

/* Makes room for one more: drops those past their deadline, then the oldest if still full. */
static void pend_make_room(rpl_tr *tr, double now) {
  for (int i = 0; i < tr->n_pend;)
    if (!pend_expire(tr, i, now)) i++;
  if (tr->n_pend < PEND_MAX) return;
  int oldest = 0;
  for (int i = 1; i < tr->n_pend; i++)
    if (tr->pend[i].since < tr->pend[oldest].since) oldest = i;
  pend_drop(tr, oldest);
  count_add(&tr->counters.handshakes_dropped, 1);
}

static void pend_add(rpl_tr *tr, int fd, rpl_ucx_ep *ep) {
  double now = rpl_now();
  pend_make_room(tr, now);
  pend *w = &tr->pend[tr->n_pend++];
  memset(w, 0, sizeof *w);
  w->fd = fd;
  w->ep = ep;
  w->since = now;
  w->peer = -1;
}

/* > 0 bytes read, 0 nothing yet, -1 closed or failed. */
static ssize_t pend_read(pend *w, void *dst, size_t n) {
  if (w->ep) return rpl_ucx_read(w->ep, dst, n);
  for (;;) {
    ssize_t r = recv(w->fd, dst, n, MSG_DONTWAIT);
    if (r > 0) return r;
    if (r == 0) return -1;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
  }
}

/* Sends HS2 (or finishes sending it on UCX): 1 sent, 0 under way, -1 failed. */
static int pend_write_hs2(pend *w) {
  if (w->ep) {
    ssize_t r = rpl_ucx_write(w->ep, w->hs2, RPL_HS2_SIZE, NULL, 0);
    return r > 0 ? 1 : r == 0 ? 0 : -1;
  }
  return send(w->fd, w->hs2, RPL_HS2_SIZE, MSG_NOSIGNAL | MSG_DONTWAIT) ==
                 (ssize_t)RPL_HS2_SIZE ? 1 : -1;
}

/* The connection authenticated as `peer`: it becomes that peer's link, unless the link it
 * would replace is still healthy. */
static void pend_promote(rpl_tr *tr, int i) {
  pend *w = &tr->pend[i];
  int peer = w->peer;
  /* A same-host peer with a ring never needs another link (a broken pair is rebuilt, never
   * replaced): whoever offers one is not that peer, whatever key it holds. */
  if (rpl_shm_has_ring(tr->shm, peer) || (!w->ep && link_healthy(tr, peer))) {
    count_add(&tr->counters.replacements_refused, 1);
    pend_drop(tr, i);
    return;
  }
  /* The peer dropped its end after a failed exchange and connected afresh. */
  replace_conn(tr, peer);
  conn *c = &tr->conns[peer];
  c->state = CONN_READY;
  rpl_tr_frame_key(tr, c, w->hs1, w->hs2);
  if (w->ep) {
    c->ux = w->ep;
    count_add(&tr->counters.ucx_connections, 1);
  } else {
    c->fd = w->fd;
    tune_data_socket(c->fd);
  }
  count_add(&tr->counters.connections, 1);
  *w = tr->pend[--tr->n_pend]; /* handed over, not closed */
}

/* Moves pending connection i as far as what has arrived allows. Returns 1 if it is still at
 * index i afterwards. */
static int pend_advance(rpl_tr *tr, int i) {
  pend *w = &tr->pend[i];
  if (w->writing) {
    int r = pend_write_hs2(w);
    if (r < 0) goto drop;
    w->writing = r == 0;
  }
  size_t want = w->stage == 0 ? RPL_HS1_SIZE : RPL_HS3_SIZE;
  while (w->got < want) {
    ssize_t r = pend_read(w, w->in + w->got, want - w->got);
    if (r < 0) goto drop;
    if (r == 0) return 1;
    w->got += (size_t)r;
  }
  if (w->stage == 0) {
    w->peer = rpl_hs1_parse(w->in, tr->rank, tr->size, tr->nonce);
    if (w->peer < 0) goto fail;
    unsigned char nonce[RPL_HS_NONCE_LEN];
    rpl_error e;
    if (rpl_random_bytes(nonce, sizeof nonce, &e) != RPL_OK) goto drop;
    memcpy(w->hs1, w->in, RPL_HS1_SIZE);
    rpl_hs2_make(w->hs2, tr->key, w->hs1, tr->rank, nonce);
    int r = pend_write_hs2(w);
    if (r < 0) goto drop;
    w->writing = r == 0;
    w->stage = 1;
    w->got = 0;
    w->since = rpl_now();
    return pend_advance(tr, i); /* HS3 may be there already */
  }
  if (!rpl_hs3_check(w->in, tr->key, w->hs1, w->hs2)) goto fail;
  if (w->writing) return 1; /* UCX: HS2 not completed yet (cannot be: HS3 answers it) */
  pend_promote(tr, i);
  return 0;
fail:
  count_add(&tr->counters.auth_failures, 1);
drop:
  pend_drop(tr, i);
  return 0;
}

/* What accepting connections left for a run: a newcomer that replaced a link the run was
 * using (see replace_conn) fails it. */
static rpl_status replaced_check(rpl_tr *tr, rpl_error *err) {
  if (tr->replaced < 0) return RPL_OK;
  return rpl_fail(err, RPL_ERR_PEER,
                  "rank %d reconnected while this rank was still exchanging data with it (it "
                  "gave up on the operation after an error of its own)", tr->replaced);
}

/* Accepts every connection waiting on the listener into the pending table. */
rpl_status rpl_tr_accept_tcp(rpl_tr *tr, rpl_error *err) {
  tr->replaced = -1;
  for (;;) {
    int fd = accept4(tr->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) break;
    pend_add(tr, fd, NULL);
    pend_advance(tr, tr->n_pend - 1); /* HS1 is often there already */
  }
  return replaced_check(tr, err);
}

/* UCX: takes the endpoints peers connected into the pending table, and moves every pending
 * UCX endpoint along (UCX raises no per-endpoint event to poll for). */
rpl_status rpl_tr_accept_ucx(rpl_tr *tr, rpl_error *err) {
  tr->replaced = -1;
  rpl_ucx_ep *e;
  while ((e = rpl_ucx_accept(tr->ucx))) pend_add(tr, -1, e);
  double now = rpl_now();
  for (int i = 0; i < tr->n_pend;) {
    if (!tr->pend[i].ep) {
      i++;
      continue;
    }
    if (pend_expire(tr, i, now)) continue;
    if (pend_advance(tr, i)) i++;
  }
  return replaced_check(tr, err);
}

rpl_status rpl_tr_accept_pending(rpl_tr *tr, rpl_error *err) {
  tr->replaced = -1;
  for (int i = 0; i < tr->n_pend;)
    if (tr->pend[i].fd < 0 || pend_advance(tr, i)) i++;
  return replaced_check(tr, err);
}

/* ---- peers that never connected ------------------------------------------------------- */

static rpl_status refused_error(rpl_tr *tr, int peer, rpl_error *err) {
  char d[96];
  rpl_tr_peer_desc(tr, peer, d, sizeof d);
  return rpl_fail(err, RPL_ERR_PEER,
                  "%s never connected to this rank and now refuses connections: it exited, was "
                  "killed, or closed its process group", d);
}

/* We wait for `peer` (a lower rank) to connect. One that died first never will, and nothing
 * else would tell: try its listener, which its kernel refuses once the process is gone. A live
 * peer reads EOF instead of a hello and drops the attempt. */
static rpl_status probe_listener(rpl_tr *tr, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  if (c->probe_fd >= 0) return RPL_OK; /* still under way */
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return RPL_OK; /* cannot probe: the deadline still bounds the wait */
  int r = connect(fd, (struct sockaddr *)&tr->peer_addr[peer], sizeof tr->peer_addr[peer]);
  if (r != 0 && errno == EINPROGRESS) {
    c->probe_fd = fd;
    tr->probes++;
    return RPL_OK;
  }
  int e = r == 0 ? 0 : errno;
  close(fd);
  return e == ECONNREFUSED ? refused_error(tr, peer, err) : RPL_OK;
}

rpl_status rpl_tr_probe_event(rpl_tr *tr, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  if (c->probe_fd < 0) return RPL_OK; /* the peer connected meanwhile */
  int soerr = 0;
  socklen_t sl = sizeof soerr;
  if (getsockopt(c->probe_fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0) soerr = 0;
  close(c->probe_fd);
  c->probe_fd = -1;
  tr->probes--;
  return soerr == ECONNREFUSED ? refused_error(tr, peer, err) : RPL_OK;
}

void rpl_tr_probes_close(rpl_tr *tr) {
  for (int p = 0; tr->probes > 0 && p < tr->size; p++)
    if (tr->conns[p].probe_fd >= 0) {
      close(tr->conns[p].probe_fd);
      tr->conns[p].probe_fd = -1;
      tr->probes--;
    }
}

rpl_status rpl_tr_conn_open(rpl_tr *tr, int peer, int listen_probe, int *accepting,
                            rpl_error *err) {
  if (tr->rank > peer) { /* the lower rank connects; we accept */
    *accepting = 1;
    return listen_probe ? probe_listener(tr, peer, err) : RPL_OK;
  }
  return tr->ucx ? start_connect_ucx(tr, peer, err) : start_connect(tr, peer, err);
}
