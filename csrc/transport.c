/* transport.c - the communicator's byte streams: shared-memory rings to peers on this host,
 * non-blocking TCP sockets or UCX endpoints (ucx.h) to the others, one framing and one run
 * loop for all of them. */
#include "transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "bytes.h"
#include "common.h"
#include "crypto.h"
#include "kernels.h"
#include "shm.h"
#include "ucx.h"
#include "wire.h"

#define HDR_SIZE 40
#define DATA_MAGIC 0x31444c52u  /* "RLD1" little-endian */
#define BYE_MAGIC 0x31424c52u   /* "RLB1": a goodbye, see say_goodbye */
#define FIN_MAGIC 0x31464c52u   /* "RLF1": UCX only: the sender leaves after success */
#define ACK_MAGIC 0x31414c52u   /* "RLA1": the answer: everything before the FIN was read */
/* A connection that has not authenticated is dropped once it has been silent this long
 * before its first message (a peer sends HS1 right after connecting), or this long after our
 * challenge (a peer answers it as soon as a run of its own reads it). */
#define HS1_WAIT_S 5.0
#define HS3_WAIT_S 60.0
/* Connections still authenticating, TCP and UCX together. When full, the oldest is dropped
 * for a newcomer: a flood of strangers costs them their slots, never a wait. */
#define PEND_MAX 64
/* What one peer's unexpected point-to-point messages may hold in memory. Past that its link
 * is read no further (the sender is held back by the link's own flow control) until receives
 * take messages out. */
#define STASH_MAX_BYTES ((size_t)256 << 20)
#define STASH_MAX_MSGS 4096
#define CAUSE_LEN 320           /* bytes of a failure's cause passed on to peers */
/* How often a waiting rank makes sure its peers are still there, where nothing else would tell
 * it: ring peers (a lock probe, one system call each) and peers that never connected to us (a
 * connection attempt to their listener, which the peer's kernel refuses once it is gone). */
#define LIVENESS_S 0.1
#define LISTEN_PROBE_S 0.5
/* Reduce arriving data in pieces this large, so reduction overlaps the rest of the transfer. */
#define REDUCE_GRAIN (64u * 1024u)
/* How long closing a UCX endpoint after a goodbye lets UCX deliver it. */
#define UCX_LINGER_S 0.2
/* How long a rank leaving after success waits for its UCX peers to read what it sent. */
#define UCX_FIN_WAIT_S 2.0
/* CONN_HANDSHAKE: connected, HS1 sent, waiting for the acceptor's HS2 (see wire.h);
 * CONN_HS_SENDING (UCX only): HS3 under way. Data moves only on CONN_READY (and CONN_SHM). */
enum { CONN_NONE = 0, CONN_CONNECTING, CONN_HANDSHAKE, CONN_HS_SENDING, CONN_READY, CONN_SHM };
enum { RX_HEADER = 0, RX_XFER, RX_STASH };

typedef struct stash_msg {
  struct stash_msg *next;
  uint32_t tag;
  size_t len;
  unsigned char *data;
  uint64_t arrival; /* order of arrival across peers, for any-source receives */
} stash_msg;

typedef struct conn {
  int fd;
  int state;
  /* Receive side: a header, then a payload that goes to a transfer or to the stash. */
  int rx_mode;
  int rx_idx; /* RX_XFER: index of the transfer the payload goes to (stable across p2p calls) */
  unsigned char rx_hdr[HDR_SIZE];
  size_t rx_hdr_got;
  stash_msg *rx_stash; /* being filled */
  size_t rx_stash_got;
  stash_msg *stash_head, *stash_tail; /* complete unexpected p2p messages, in arrival order */
  size_t stash_bytes; /* held by the stash and rx_stash, bounded by STASH_MAX_BYTES */
  int stash_msgs;     /* bounded by STASH_MAX_MSGS */
  int held;           /* a header in rx_hdr waits for room in the stash: the link is not read */
  /* Connector side of the handshake: what we sent, what the acceptor answered. */
  unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE], hs3[RPL_HS3_SIZE];
  size_t hs_got;
  int tx_mid;   /* a message of ours is half-written on the socket: no goodbye may follow */
  int probe_fd; /* a connection attempt to the peer's listener (see probe_listener), or -1 */
  rpl_ucx_ep *ux; /* the link is a UCX endpoint (state CONN_READY, fd -1), or NULL */
  int ux_linger;  /* a goodbye was written on ux: closing lets UCX deliver it */
} conn;

/* An accepted connection (a socket, or a UCX endpoint) until it has authenticated. */
typedef struct pend {
  int fd;          /* or -1 */
  rpl_ucx_ep *ep;  /* or NULL */
  double since;    /* accepted, or challenged */
  int stage;       /* 0: reading HS1; 1: HS2 sent (or under way), reading HS3 */
  int writing;     /* UCX: HS2 still under way */
  int peer;        /* from HS1 */
  size_t got;
  unsigned char in[RPL_HS2_SIZE];
  unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE];
} pend;

struct rpl_tr {
  int rank, size;
  int listen_fd;
  int wake_fd; /* eventfd: rpl_tr_interrupt */
  uint64_t nonce; /* this transport's identity (acceptor_id of wire.h), published with its address */
  unsigned char key[RPL_LINK_KEY_LEN]; /* the link key (rpl_tr_set_key); zero by default */
  struct sockaddr_in self;
  struct sockaddr_in *peer_addr;
  uint64_t *peer_nonce;
  conn *conns;
  int *act_send, *act_recv; /* per peer: index of the active transfer in the current run */
  unsigned char *any_read;  /* per peer: read in this p2p run only for any-source receives */
  struct pollfd *pfds;
  int *pfd_peer;
  int aborted;
  int interrupted; /* sticky, set by rpl_tr_interrupt (atomic) */
  int p2p;         /* the current run is a point-to-point batch (rpl_tr_run_p2p) */
  uint64_t completions; /* transfers completed, for rpl_tr_run_p2p's early return */
  uint64_t arrivals;    /* p2p messages stashed so far (stash_msg.arrival) */
  int replaced; /* a peer this run was using reconnected, or -1 */
  double run_start;
  double next_probe;        /* when waiting runs next check their ring peers' locks */
  double next_listen_probe; /* when they next probe peers that never connected */
  int probes;               /* probe_fd descriptors open */
  /* The cause of the last failed run (until a run succeeds): passed on to the peers when this
   * rank gives up on its links. peer_cause: the cause a peer passed on, during a run. */
  char cause[CAUSE_LEN];
  char peer_cause[CAUSE_LEN];
  rpl_shm *shm; /* rings to local peers, or NULL */
  /* UCX links to the peers not on shared memory (transport "ucx"), or NULL: TCP. */
  rpl_ucx *ucx;
  unsigned *peer_uport; /* each peer's UCX listener port, 0 when it does not use UCX */
  pend pend[PEND_MAX];
  int n_pend;
  rpl_tr_counters counters;
};

static void pend_drop(rpl_tr *tr, int i);
static rpl_status peer_closed(rpl_tr *tr, int peer, int errnum, const char *doing,
                              rpl_error *err);
_Static_assert(RPL_TR_KEY_LEN == RPL_LINK_KEY_LEN, "one key length");

/* ---- frame headers --------------------------------------------------------------------- */

static void encode_header(unsigned char *h, const rpl_meta *m, uint64_t len) {
  rpl_put32(h, DATA_MAGIC);
  h[4] = m->op;
  h[5] = m->dtype;
  h[6] = (unsigned char)(m->step & 0xff);
  h[7] = (unsigned char)(m->step >> 8);
  rpl_put32(h + 8, m->tag);
  rpl_put64(h + 16, m->seq);
  rpl_put64(h + 24, m->count);
  rpl_put64(h + 32, len);
}

static void decode_header(const unsigned char *h, uint32_t *magic, rpl_meta *m, uint64_t *len) {
  *magic = rpl_get32(h);
  m->op = h[4];
  m->dtype = h[5];
  m->step = (uint16_t)(h[6] | (h[7] << 8));
  m->tag = rpl_get32(h + 8);
  m->seq = rpl_get64(h + 16);
  m->count = rpl_get64(h + 24);
  *len = rpl_get64(h + 32);
}

static void count_add(uint64_t *c, uint64_t v) { __atomic_fetch_add(c, v, __ATOMIC_RELAXED); }

/* ---- setup --------------------------------------------------------------------------- */

static void tune_data_socket(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

rpl_status rpl_tr_create(int rank, int size, const char *bind_addr, int use_ucx, rpl_tr **out,
                         rpl_error *err) {
  *out = NULL;
  rpl_tr *tr = calloc(1, sizeof *tr);
  if (!tr) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating the transport");
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
    return rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating the transport");
  }
  for (int i = 0; i < size; i++) tr->conns[i].fd = tr->conns[i].probe_fd = -1;

  /* The transport's identity: a connection naming another one is dropped at its first
   * message. From the kernel's CSPRNG, never from a guessable fallback. */
  rpl_status rst = rpl_random_bytes(&tr->nonce, sizeof tr->nonce, err);
  if (rst != RPL_OK) {
    rpl_tr_destroy(tr);
    return rst;
  }

  const char *addr = bind_addr && *bind_addr ? bind_addr : "127.0.0.1";
  memset(&tr->self, 0, sizeof tr->self);
  tr->self.sin_family = AF_INET;
  if (inet_pton(AF_INET, addr, &tr->self.sin_addr) != 1) {
    rpl_tr_destroy(tr);
    return rpl_fail(err, RPL_ERR_INVALID,
                    "bind address '%s' is not an IPv4 address (set RIPPLES_BIND_ADDR to the IP "
                    "peers should use to reach this process)", addr);
  }
  tr->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  tr->listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (tr->wake_fd < 0 || tr->listen_fd < 0) {
    int e = errno;
    rpl_tr_destroy(tr);
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, e, "cannot create sockets");
  }
  socklen_t sl = sizeof tr->self;
  if (bind(tr->listen_fd, (struct sockaddr *)&tr->self, sizeof tr->self) != 0 ||
      listen(tr->listen_fd, 256) != 0 ||
      getsockname(tr->listen_fd, (struct sockaddr *)&tr->self, &sl) != 0) {
    int e = errno;
    rpl_tr_destroy(tr);
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, e, "cannot listen on %s", addr);
  }
  if (use_ucx) {
    rpl_status st = rpl_ucx_create(&tr->self.sin_addr, &tr->ucx, err);
    if (st != RPL_OK) {
      rpl_tr_destroy(tr);
      return st;
    }
  }
  *out = tr;
  return RPL_OK;
}

/* A stashed message leaves the stash (taken by a receive, or given up): its room is free. */
static void stash_free(conn *c, stash_msg *m) {
  c->stash_bytes -= m->len;
  c->stash_msgs--;
  free(m->data);
  free(m);
}

static void free_stash(conn *c) {
  for (stash_msg *m = c->stash_head; m;) {
    stash_msg *next = m->next;
    free(m->data);
    free(m);
    m = next;
  }
  c->stash_head = c->stash_tail = NULL;
  c->stash_bytes = 0;
  c->stash_msgs = 0;
  if (c->rx_stash) {
    free(c->rx_stash->data);
    free(c->rx_stash);
    c->rx_stash = NULL;
  }
}

static void close_conn(conn *c) {
  if (c->fd >= 0) {
    shutdown(c->fd, SHUT_RDWR);
    close(c->fd);
  }
  if (c->ux) rpl_ucx_close(c->ux, c->ux_linger ? UCX_LINGER_S : 0);
  c->ux = NULL;
  c->ux_linger = 0;
  c->fd = -1;
  c->state = CONN_NONE;
  c->rx_mode = RX_HEADER;
  c->rx_hdr_got = 0;
  c->tx_mid = 0;
  c->held = 0;
  c->hs_got = 0;
  free_stash(c);
}

/* Before this rank closes a connection after a failure: unless a message of ours is half-sent
 * on it (the peer would read the goodbye as payload), send a goodbye frame carrying our cause,
 * so a peer blocked on us can say what went wrong first (say, which rank died) instead of only
 * that we closed. Best effort: never blocks; a peer that misses it sees the close. */
static void say_goodbye(rpl_tr *tr, conn *c) {
  if (c->state != CONN_READY || c->tx_mid || !tr->cause[0]) return;
  size_t n = strnlen(tr->cause, sizeof tr->cause - 1);
  unsigned char h[HDR_SIZE];
  rpl_meta none;
  memset(&none, 0, sizeof none);
  encode_header(h, &none, n);
  rpl_put32(h, BYE_MAGIC);
  if (c->ux) { /* delivered while close_conn lingers; tr->cause outlives that */
    if (!rpl_ucx_writing(c->ux) && rpl_ucx_write(c->ux, h, HDR_SIZE, tr->cause, n) >= 0)
      c->ux_linger = 1;
    return;
  }
  struct iovec iov[2] = {{h, HDR_SIZE}, {tr->cause, n}};
  struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
  ssize_t r = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)r;
}

void rpl_tr_reset_peer(rpl_tr *tr, int peer) {
  if (!tr || peer < 0 || peer >= tr->size || peer == tr->rank) return;
  if (tr->shm) rpl_shm_set_cause(tr->shm, tr->cause); /* before the flag the peer reacts to */
  if (rpl_shm_usable(tr->shm, peer)) rpl_shm_break(tr->shm, peer); /* both sides move to TCP */
  else say_goodbye(tr, &tr->conns[peer]);
  close_conn(&tr->conns[peer]);
}

void rpl_tr_set_shm(rpl_tr *tr, rpl_shm *shm) { tr->shm = shm; }

void rpl_tr_held_desc(const rpl_tr *tr, int peer, char *buf, size_t cap) {
  buf[0] = '\0';
  for (int p = 0; p < tr->size; p++) {
    const conn *c = &tr->conns[p];
    if (!c->held || (peer != RPL_TR_ANY && peer != p)) continue;
    snprintf(buf, cap,
             "rank %d sent more point-to-point messages that no receive has taken than this "
             "rank buffers (%d messages, %zu bytes; at most %d messages and %zu MiB per peer), "
             "so its link is held back: post receives for those messages first",
             p, c->stash_msgs, c->stash_bytes, STASH_MAX_MSGS, STASH_MAX_BYTES >> 20);
    return;
  }
}

void rpl_tr_set_key(rpl_tr *tr, const unsigned char key[RPL_TR_KEY_LEN]) {
  memcpy(tr->key, key, RPL_TR_KEY_LEN);
}

/* Leaving after success over UCX. Unlike a socket's kernel, UCX drops what a peer has not
 * read yet once this end disconnects, so each UCX peer gets a FIN after our last message and
 * answers it when its reads reach it; we wait for the answers (up to UCX_FIN_WAIT_S). A peer
 * that does not read from us meanwhile sees us gone when it next does. */
static void ucx_leave(rpl_tr *tr) {
  unsigned char fin[HDR_SIZE];
  rpl_meta none;
  memset(&none, 0, sizeof none);
  encode_header(fin, &none, 0);
  rpl_put32(fin, FIN_MAGIC);
  /* Per peer: -1 not waited for, else the payload bytes still to skip before a header. */
  int64_t *skip = malloc(sizeof(int64_t) * (size_t)tr->size);
  if (!skip) return;
  int waiting = 0;
  for (int i = 0; i < tr->size; i++) {
    conn *c = &tr->conns[i];
    skip[i] = -1;
    /* Only a link at a message boundary both ways can carry a FIN and be read for its answer. */
    if (!c->ux || rpl_ucx_writing(c->ux) || c->rx_mode != RX_HEADER ||
        rpl_ucx_write(c->ux, fin, HDR_SIZE, NULL, 0) < 0)
      continue;
    skip[i] = 0;
    waiting++;
  }
  double end = rpl_now() + UCX_FIN_WAIT_S;
  while (waiting > 0 && rpl_now() < end) {
    rpl_ucx_progress(tr->ucx);
    for (int i = 0; i < tr->size; i++) {
      conn *c = &tr->conns[i];
      ssize_t r = 1;
      while (skip[i] >= 0 && r > 0) {
        unsigned char junk[4096];
        if (skip[i] > 0) { /* a message we no longer want */
          r = rpl_ucx_read(c->ux, junk, (size_t)RPL_MIN((uint64_t)skip[i], sizeof junk));
          if (r > 0) skip[i] -= r;
        } else if ((r = rpl_ucx_read(c->ux, c->rx_hdr + c->rx_hdr_got,
                                     HDR_SIZE - c->rx_hdr_got)) > 0 &&
                   (c->rx_hdr_got += (size_t)r) == HDR_SIZE) {
          c->rx_hdr_got = 0;
          uint32_t magic = rpl_get32(c->rx_hdr);
          if (magic == FIN_MAGIC) { /* the peer leaves too: answer it, expect no answer */
            rpl_put32(c->rx_hdr, ACK_MAGIC);
            if (!rpl_ucx_writing(c->ux)) rpl_ucx_write(c->ux, c->rx_hdr, HDR_SIZE, NULL, 0);
          }
          if (magic == ACK_MAGIC || magic == FIN_MAGIC) r = -1; /* read up to our FIN */
          else skip[i] = (int64_t)rpl_get64(c->rx_hdr + 32);
        }
        if (r < 0) { /* answered, or gone */
          skip[i] = -1;
          waiting--;
        }
      }
    }
  }
  free(skip);
}

void rpl_tr_abort(rpl_tr *tr) {
  if (!tr) return;
  if (tr->ucx && !tr->aborted && !tr->cause[0]) ucx_leave(tr);
  tr->aborted = 1;
  if (tr->shm) rpl_shm_set_cause(tr->shm, tr->cause); /* "" replaces a stale one */
  rpl_shm_close(tr->shm);
  if (tr->conns)
    for (int i = 0; i < tr->size; i++) {
      say_goodbye(tr, &tr->conns[i]);
      /* Leaving after success: UCX delivers what we wrote before it disconnects (a socket's
       * kernel does that by itself). */
      if (!tr->cause[0]) tr->conns[i].ux_linger = 1;
      close_conn(&tr->conns[i]);
    }
  while (tr->n_pend > 0) pend_drop(tr, tr->n_pend - 1);
  if (tr->listen_fd >= 0) close(tr->listen_fd);
  tr->listen_fd = -1;
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

static void wake(rpl_tr *tr) {
  uint64_t one = 1;
  ssize_t r = write(tr->wake_fd, &one, sizeof one);
  (void)r;
  if (tr->shm) rpl_shm_ring_self(tr->shm);
}

void rpl_tr_interrupt(rpl_tr *tr) {
  __atomic_store_n(&tr->interrupted, 1, __ATOMIC_SEQ_CST);
  wake(tr);
}

void rpl_tr_poke(rpl_tr *tr) { wake(tr); }

int rpl_tr_can_read(const rpl_tr *tr, int peer) {
  return tr->shm && peer != tr->rank && rpl_shm_can_read(tr->shm, peer);
}

rpl_status rpl_tr_read(rpl_tr *tr, int peer, uint64_t addr, void *dst, size_t len,
                       rpl_error *err) {
  if (__atomic_load_n(&tr->interrupted, __ATOMIC_SEQ_CST))
    return rpl_fail(err, RPL_ERR_CLOSED, "interrupted: the process group is shutting down");
  rpl_status st = rpl_shm_read_peer(tr->shm, peer, addr, dst, len, err);
  if (st != RPL_OK) {
    rpl_cause_make(tr->cause, sizeof tr->cause, st, tr->rank, err->msg);
    return st;
  }
  count_add(&tr->counters.bytes_received, len);
  count_add(&tr->counters.single_copy_bytes, len);
  return RPL_OK;
}

void rpl_tr_get_counters(const rpl_tr *tr, rpl_tr_counters *out) {
  out->single_copy_bytes = __atomic_load_n(&tr->counters.single_copy_bytes, __ATOMIC_RELAXED);
  out->bytes_sent = __atomic_load_n(&tr->counters.bytes_sent, __ATOMIC_RELAXED);
  out->bytes_received = __atomic_load_n(&tr->counters.bytes_received, __ATOMIC_RELAXED);
  out->connections = __atomic_load_n(&tr->counters.connections, __ATOMIC_RELAXED);
  out->ucx_connections = __atomic_load_n(&tr->counters.ucx_connections, __ATOMIC_RELAXED);
  out->auth_failures = __atomic_load_n(&tr->counters.auth_failures, __ATOMIC_RELAXED);
  out->handshakes_dropped = __atomic_load_n(&tr->counters.handshakes_dropped, __ATOMIC_RELAXED);
  out->replacements_refused =
      __atomic_load_n(&tr->counters.replacements_refused, __ATOMIC_RELAXED);
  out->stash_holds = __atomic_load_n(&tr->counters.stash_holds, __ATOMIC_RELAXED);
}

/* ---- connection establishment -------------------------------------------------------- */

static void peer_desc(const rpl_tr *tr, int peer, char *buf, size_t cap) {
  char ip[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &tr->peer_addr[peer].sin_addr, ip, sizeof ip);
  snprintf(buf, cap, "rank %d (%s:%u)", peer, ip, (unsigned)ntohs(tr->peer_addr[peer].sin_port));
}

/* A peer connected afresh: its old link (if any) is dead. If this run was still using it, the
 * run fails (see run_inner). */
static void replace_conn(rpl_tr *tr, int peer) {
  if (tr->conns[peer].state == CONN_NONE) return;
  if (tr->act_send[peer] >= 0 || tr->act_recv[peer] >= 0) tr->replaced = peer;
  close_conn(&tr->conns[peer]);
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
  peer_desc(tr, peer, d, sizeof d);
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
    peer_desc(tr, peer, d, sizeof d);
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
  peer_desc(tr, peer, d, sizeof d);
  if (soerr != 0) {
    close_conn(c);
    return rpl_fail_errno(err, RPL_ERR_PEER, soerr, "cannot connect to %s (has it exited?)", d);
  }
  rpl_status st = make_hs1(tr, peer, err);
  if (st != RPL_OK) return st;
  /* A fresh socket's send buffer takes a handshake message at once. */
  if (send(c->fd, c->hs1, RPL_HS1_SIZE, MSG_NOSIGNAL) != (ssize_t)RPL_HS1_SIZE) {
    int e = errno;
    close_conn(c);
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
    if (w < 0) return peer_closed(tr, peer, 0, "authenticating", err); /* UCX says why */
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
    if (r < 0 && c->ux) return peer_closed(tr, peer, 0, "authenticating", err);
    if (r < 0) {
      close_conn(c);
      return auth_error(tr, peer, "closed the connection while authenticating", err);
    }
    c->hs_got += (size_t)r;
  }
  if (!rpl_hs2_check(c->hs2, tr->key, c->hs1, peer)) {
    close_conn(c);
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
    close_conn(c);
    return rpl_fail_errno(err, RPL_ERR_PEER, e, "cannot complete the handshake with rank %d",
                          peer);
  }
  c->state = CONN_READY;
  count_add(&tr->counters.connections, 1);
  return RPL_OK;
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

/* Makes room for one more: drops those past their deadline, then the oldest if still full. */
static void pend_make_room(rpl_tr *tr, double now) {
  for (int i = 0; i < tr->n_pend;) {
    pend *w = &tr->pend[i];
    if (now - w->since > (w->stage ? HS3_WAIT_S : HS1_WAIT_S)) {
      pend_drop(tr, i);
      count_add(&tr->counters.handshakes_dropped, 1);
    } else {
      i++;
    }
  }
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
  if (!w->ep && link_healthy(tr, peer)) {
    count_add(&tr->counters.replacements_refused, 1);
    pend_drop(tr, i);
    return;
  }
  /* The peer dropped its end after a failed exchange and connected afresh. */
  replace_conn(tr, peer);
  conn *c = &tr->conns[peer];
  c->state = CONN_READY;
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

/* Accepts every connection waiting on the listener into the pending table. */
static void accept_pending(rpl_tr *tr) {
  for (;;) {
    int fd = accept4(tr->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    pend_add(tr, fd, NULL);
    pend_advance(tr, tr->n_pend - 1); /* HS1 is often there already */
  }
}

/* UCX: takes the endpoints peers connected into the pending table, and moves every pending
 * UCX endpoint along (UCX raises no per-endpoint event to poll for). */
static void accept_ucx(rpl_tr *tr) {
  rpl_ucx_ep *e;
  while ((e = rpl_ucx_accept(tr->ucx))) pend_add(tr, -1, e);
  double now = rpl_now();
  for (int i = 0; i < tr->n_pend;) {
    pend *w = &tr->pend[i];
    if (!w->ep) {
      i++;
      continue;
    }
    if (now - w->since > (w->stage ? HS3_WAIT_S : HS1_WAIT_S)) {
      pend_drop(tr, i);
      count_add(&tr->counters.handshakes_dropped, 1);
      continue;
    }
    if (pend_advance(tr, i)) i++;
  }
}

/* Reads exactly n bytes from a non-blocking socket, waiting at most `wait_s`. */
static int read_full_wait(int fd, unsigned char *buf, size_t n, double wait_s) {
  double end = rpl_now() + wait_s;
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(fd, buf + got, n - got, 0);
    if (r > 0) {
      got += (size_t)r;
      continue;
    }
    if (r == 0) return -1;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return -1;
    int ms = (int)((end - rpl_now()) * 1000);
    if (ms <= 0) return -1;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, ms) < 0 && errno != EINTR) return -1;
  }
  return 0;
}

/* Reads exactly n bytes from a link within wait_s (error paths: a goodbye and its text). */
static int link_read_wait(rpl_tr *tr, conn *c, unsigned char *buf, size_t n, double wait_s) {
  if (!c->ux) return read_full_wait(c->fd, buf, n, wait_s);
  double end = rpl_now() + wait_s;
  size_t got = 0;
  while (got < n) {
    ssize_t r = rpl_ucx_read(c->ux, buf + got, n - got);
    if (r < 0) return -1;
    if (r > 0) {
      got += (size_t)r;
      continue;
    }
    if (rpl_now() > end) return -1;
    rpl_ucx_progress(tr->ucx);
  }
  return 0;
}

/* ---- data movement ------------------------------------------------------------------- */

static int next_active(const rpl_xfer *xs, int n, int from, int peer, int is_send) {
  for (int i = from; i < n; i++)
    if (!xs[i].done && xs[i].peer == peer && xs[i].is_send == is_send) return i;
  return -1;
}

static rpl_status complete_from_stash(rpl_tr *tr, rpl_xfer *x, int *matched, rpl_error *err) {
  conn *c = &tr->conns[x->peer];
  stash_msg *prev = NULL;
  *matched = 0;
  for (stash_msg *m = c->stash_head; m; prev = m, m = m->next) {
    if (m->tag != x->meta.tag) continue;
    if (m->len != x->len)
      return rpl_fail(err, RPL_ERR_MISMATCH,
                      "recv from rank %d (tag %u) expects %zu bytes but rank %d sent %zu bytes",
                      x->peer, x->meta.tag, x->len, x->peer, m->len);
    if (m->len) memcpy(x->buf, m->data, m->len);
    if (prev) prev->next = m->next;
    else c->stash_head = m->next;
    if (c->stash_tail == m) c->stash_tail = prev;
    stash_free(c, m);
    x->done = 1;
    tr->completions++;
    *matched = 1;
    return RPL_OK;
  }
  return RPL_OK;
}

/* Any-source receives (peer RPL_TR_ANY in a p2p run) take whole messages from the stash:
 * while one is pending, every peer without a receive of its own is read into the stash, and
 * a stashed message no receive from its peer takes goes to the first any-source receive with
 * its tag, which then records its sender in `peer`. */
static int is_any(const rpl_xfer *x) { return !x->is_send && x->peer == RPL_TR_ANY; }

static int find_any_recv(const rpl_xfer *xs, int n, uint32_t tag) {
  for (int i = 0; i < n; i++)
    if (!xs[i].done && is_any(&xs[i]) && xs[i].meta.tag == tag) return i;
  return -1;
}

/* Serves an any-source receive from the stash: the earliest message with its tag, from any
 * peer. */
static rpl_status any_from_stash(rpl_tr *tr, rpl_xfer *x, rpl_error *err) {
  stash_msg *best = NULL, *best_prev = NULL;
  int best_peer = -1;
  for (int p = 0; p < tr->size; p++) {
    stash_msg *prev = NULL;
    for (stash_msg *m = tr->conns[p].stash_head; m; prev = m, m = m->next) {
      if (m->tag != x->meta.tag) continue;
      if (!best || m->arrival < best->arrival) {
        best = m;
        best_prev = prev;
        best_peer = p;
      }
      break; /* per peer, the first with the tag is the earliest */
    }
  }
  if (!best) return RPL_OK;
  if (best->len != x->len)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "recv from any rank (tag %u) expects %zu bytes but rank %d sent %zu bytes",
                    x->meta.tag, x->len, best_peer, best->len);
  conn *c = &tr->conns[best_peer];
  if (best->len) memcpy(x->buf, best->data, best->len);
  if (best_prev) best_prev->next = best->next;
  else c->stash_head = best->next;
  if (c->stash_tail == best) c->stash_tail = best_prev;
  stash_free(c, best);
  x->peer = best_peer;
  x->done = 1;
  tr->completions++;
  return RPL_OK;
}

/* Makes the first unfinished receive from `peer` active, serving p2p receives from the stash. */
static rpl_status activate_recv(rpl_tr *tr, rpl_xfer *xs, int n, int peer, int from,
                                rpl_error *err) {
  for (;;) {
    int i = next_active(xs, n, from, peer, 0);
    tr->act_recv[peer] = i;
    if (i < 0 || xs[i].meta.op != RPL_OP_SEND) return RPL_OK;
    int matched;
    rpl_status st = complete_from_stash(tr, &xs[i], &matched, err);
    if (st != RPL_OK) return st;
    if (!matched) return RPL_OK;
    from = i + 1;
  }
}

static rpl_status closed_error(rpl_tr *tr, int peer, int errnum, const char *doing,
                               rpl_error *err) {
  char d[96];
  peer_desc(tr, peer, d, sizeof d);
  if (errnum)
    return rpl_fail_errno(err, RPL_ERR_PEER, errnum,
                          "lost the connection to %s while %s (the peer exited or aborted "
                          "after an error)", d, doing);
  return rpl_fail(err, RPL_ERR_PEER,
                  "%s closed the connection while this rank was %s (the peer exited, or "
                  "aborted after an error of its own)", d, doing);
}

/* A goodbye header (see say_goodbye) arrived from `peer`: fails the run with the cause it
 * carries, which becomes this rank's cause too (so a chain of failures keeps naming the
 * first one). The text follows the header at once; waits briefly for it (an error path). */
static rpl_status goodbye_error(rpl_tr *tr, int peer, uint64_t len, const char *doing,
                                rpl_error *err) {
  char text[CAUSE_LEN];
  size_t n = 0;
  if (len > 0 && len < sizeof text &&
      link_read_wait(tr, &tr->conns[peer], (unsigned char *)text, (size_t)len, 0.5) == 0)
    n = (size_t)len;
  text[n] = '\0';
  for (size_t i = 0; i < n; i++) /* printable text only, whatever arrived */
    if ((unsigned char)text[i] < 0x20 || (unsigned char)text[i] > 0x7e) text[i] = '?';
  if (!n) return closed_error(tr, peer, 0, doing, err);
  snprintf(tr->peer_cause, sizeof tr->peer_cause, "%s", text);
  int origin;
  const char *why;
  if (rpl_cause_split(text, &origin, &why) == RPL_ERR_MISMATCH)
    return rpl_fail(err, RPL_ERR_MISMATCH, "%s [found by rank %d]", why, origin);
  char d[96];
  peer_desc(tr, peer, d, sizeof d);
  return rpl_fail(err, RPL_ERR_PEER, "%s gave up after an error of its own: %s", d, why);
}

/* The connection to `peer` closed (EOF, reset, or the peer shut its end while we only send to
 * it): fails the run, with the peer's cause if it said goodbye first (the goodbye then waits
 * at a message boundary of our receive side, and everything before it has been read). */
static rpl_status peer_closed(rpl_tr *tr, int peer, int errnum, const char *doing,
                              rpl_error *err) {
  conn *c = &tr->conns[peer];
  unsigned char h[HDR_SIZE];
  if (c->ux) {
    if (c->rx_mode == RX_HEADER && c->rx_hdr_got == 0 && link_read_wait(tr, c, h, HDR_SIZE, 0) == 0 &&
        rpl_get32(h) == BYE_MAGIC)
      return goodbye_error(tr, peer, rpl_get64(h + 32), doing, err);
    char d[96];
    peer_desc(tr, peer, d, sizeof d);
    return rpl_fail(err, RPL_ERR_PEER,
                    "lost the UCX connection to %s while this rank was %s (%s: the peer exited, "
                    "or aborted after an error of its own)", d, doing, rpl_ucx_failure(c->ux));
  }
  if (c->state == CONN_READY && c->rx_mode == RX_HEADER && c->rx_hdr_got == 0 &&
      recv(c->fd, h, HDR_SIZE, MSG_PEEK | MSG_DONTWAIT) == HDR_SIZE && rpl_get32(h) == BYE_MAGIC &&
      recv(c->fd, h, HDR_SIZE, MSG_DONTWAIT) == HDR_SIZE)
    return goodbye_error(tr, peer, rpl_get64(h + 32), doing, err);
  return closed_error(tr, peer, errnum, doing, err);
}

static rpl_status do_send(rpl_tr *tr, rpl_xfer *xs, int n, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  while (tr->act_send[peer] >= 0) {
    rpl_xfer *x = &xs[tr->act_send[peer]];
    unsigned char hdr[HDR_SIZE];
    struct iovec iov[2];
    int niov = 0;
    if (x->off < HDR_SIZE) {
      encode_header(hdr, &x->meta, x->len);
      iov[niov].iov_base = hdr + x->off;
      iov[niov].iov_len = HDR_SIZE - x->off;
      niov++;
    }
    size_t poff = x->off > HDR_SIZE ? x->off - HDR_SIZE : 0;
    if (poff < x->len) {
      iov[niov].iov_base = (unsigned char *)x->buf + poff;
      iov[niov].iov_len = x->len - poff;
      niov++;
    }
    ssize_t r;
    if (c->ux) {
      /* UCX takes the whole message (the payload in place) and reports it once delivered. */
      encode_header(hdr, &x->meta, x->len);
      r = rpl_ucx_write(c->ux, hdr, HDR_SIZE, x->buf, x->len);
      if (r == 0) {
        c->tx_mid = 1;
        return RPL_OK;
      }
      if (r < 0) return peer_closed(tr, peer, 0, "sending", err);
    } else if (c->state == CONN_SHM) {
      r = (ssize_t)rpl_shm_write(tr->shm, peer, iov, niov);
      if (r == 0) return RPL_OK; /* ring full */
    } else {
      struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
      r = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return RPL_OK;
        return peer_closed(tr, peer, errno, "sending", err);
      }
    }
    x->off += (size_t)r;
    count_add(&tr->counters.bytes_sent, (uint64_t)r);
    c->tx_mid = x->off != HDR_SIZE + x->len;
    if (x->off == HDR_SIZE + x->len) {
      x->done = 1;
      tr->completions++;
      tr->act_send[peer] = next_active(xs, n, tr->act_send[peer] + 1, peer, 1);
    }
  }
  return RPL_OK;
}

static rpl_status check_header(rpl_tr *tr, int peer, const rpl_xfer *x, uint32_t magic,
                               const rpl_meta *m, uint64_t len, rpl_error *err) {
  const rpl_meta *e = &x->meta;
  if (magic != DATA_MAGIC)
    return rpl_fail(err, RPL_ERR_PEER, "corrupt message header from rank %d", peer);
  if (m->op == RPL_OP_SEND && (e->op != RPL_OP_SEND || m->tag != e->tag))
    return RPL_OK; /* a p2p message for a later recv: the caller stashes it */
  if (m->op == RPL_OP_SEND) {
    /* Point-to-point moves raw bytes, as gloo does: only the size must agree. */
    if (len != x->len)
      return rpl_fail(err, RPL_ERR_MISMATCH,
                      "recv from rank %d (tag %u) expects %zu bytes but rank %d sent %llu bytes",
                      peer, e->tag, x->len, peer, (unsigned long long)len);
    return RPL_OK;
  }
  if (e->op == RPL_OP_SEND && m->op != RPL_OP_SEND)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "rank %d sent its %s #%llu while this rank waits in recv(src=%d, tag=%u): "
                    "ranks issued operations in different orders", peer,
                    rpl_op_name((rpl_op_kind)m->op), (unsigned long long)m->seq, peer, e->tag);
  /* The messages name both ranks, the lower first, and not "this rank": a peer that learns
   * of the mismatch from the rank that found it raises the same text. */
  int lo = RPL_MIN(peer, tr->rank), hi = RPL_MAX(peer, tr->rank);
  const rpl_meta *ml = peer < tr->rank ? m : e, *mh = peer < tr->rank ? e : m;
  if (m->op != e->op || m->seq != e->seq)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "collective mismatch: rank %d is in %s #%llu, rank %d in %s #%llu (ranks "
                    "called different collectives, or in a different order)",
                    lo, rpl_op_name((rpl_op_kind)ml->op), (unsigned long long)ml->seq, hi,
                    rpl_op_name((rpl_op_kind)mh->op), (unsigned long long)mh->seq);
  if (m->dtype != e->dtype)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "dtype mismatch in %s #%llu: rank %d has %s tensors, rank %d has %s",
                    rpl_op_name((rpl_op_kind)e->op), (unsigned long long)e->seq, lo,
                    rpl_dtype_name((rpl_dtype)ml->dtype), hi,
                    rpl_dtype_name((rpl_dtype)mh->dtype));
  if (m->tag != e->tag && e->op != RPL_OP_SEND)
    return rpl_fail(err, RPL_ERR_MISMATCH, "%s #%llu: rank %d passed %u tensors, rank %d %u",
                    rpl_op_name((rpl_op_kind)e->op), (unsigned long long)e->seq, lo, ml->tag,
                    hi, mh->tag);
  if (e->count != RPL_ANY_COUNT && m->count != e->count)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "size mismatch in %s #%llu: rank %d has %llu elements, rank %d has %llu "
                    "(tensor %u; every rank must pass tensors of the same size)",
                    rpl_op_name((rpl_op_kind)e->op), (unsigned long long)e->seq, lo,
                    (unsigned long long)ml->count, hi, (unsigned long long)mh->count, e->step);
  if (m->step != e->step || len != x->len)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "size mismatch in %s #%llu: rank %d sends %llu bytes, this rank expects "
                    "%zu (split sizes or tensor sizes differ across ranks)",
                    rpl_op_name((rpl_op_kind)e->op), (unsigned long long)e->seq, peer,
                    (unsigned long long)len, x->len);
  return RPL_OK;
}

static void reduce_arrived(rpl_xfer *x, size_t got, int now) {
  if (!x->reduce_dst) return;
  size_t esz = rpl_dtype_size(x->rdtype);
  size_t whole = got / esz;
  if (whole == x->reduced) return;
  /* A window is reduced before it is reused: whenever arrivals reach its end. */
  int at_end = got == x->len || (x->window && got % x->window == 0);
  if (!now && !at_end && (whole - x->reduced) * esz < REDUCE_GRAIN) return;
  size_t from = x->reduced * esz;
  if (x->window) from %= x->window;
  rpl_reduce_into((unsigned char *)x->reduce_dst + x->reduced * esz,
                  (unsigned char *)x->buf + from, whole - x->reduced, x->rdtype, x->rop);
  x->reduced = whole;
}

/* The first unfinished point-to-point receive from `peer` with `tag`, or -1. */
static int find_p2p_recv(const rpl_xfer *xs, int n, int peer, uint32_t tag) {
  for (int i = 0; i < n; i++)
    if (!xs[i].done && !xs[i].is_send && xs[i].peer == peer && xs[i].meta.op == RPL_OP_SEND &&
        xs[i].meta.tag == tag)
      return i;
  return -1;
}

static rpl_status p2p_size_mismatch(int peer, const rpl_xfer *x, uint64_t len, rpl_error *err) {
  return rpl_fail(err, RPL_ERR_MISMATCH,
                  "recv from rank %d (tag %u) expects %zu bytes but rank %d sent %llu bytes",
                  peer, x->meta.tag, x->len, peer, (unsigned long long)len);
}

/* A p2p message finished arriving into the stash. In a p2p run, a receive posted since its
 * header arrived takes it at once; otherwise it waits in the stash, in arrival order. */
static rpl_status stash_complete(rpl_tr *tr, rpl_xfer *xs, int n, int peer, stash_msg *s,
                                 rpl_error *err) {
  conn *c = &tr->conns[peer];
  int j = tr->p2p ? find_p2p_recv(xs, n, peer, s->tag) : -1;
  if (j < 0 && tr->p2p && (j = find_any_recv(xs, n, s->tag)) >= 0) {
    if (s->len != xs[j].len) {
      rpl_status st = rpl_fail(err, RPL_ERR_MISMATCH,
                               "recv from any rank (tag %u) expects %zu bytes but rank %d sent "
                               "%zu bytes", s->tag, xs[j].len, peer, s->len);
      stash_free(c, s);
      return st;
    }
    if (s->len) memcpy(xs[j].buf, s->data, s->len);
    xs[j].peer = peer;
    xs[j].done = 1;
    tr->completions++;
    stash_free(c, s);
    return RPL_OK;
  }
  if (j < 0) {
    if (c->stash_tail) c->stash_tail->next = s;
    else c->stash_head = s;
    c->stash_tail = s;
    return RPL_OK;
  }
  rpl_status st = RPL_OK;
  if (s->len != xs[j].len) {
    st = p2p_size_mismatch(peer, &xs[j], s->len, err);
  } else {
    if (s->len) memcpy(xs[j].buf, s->data, s->len);
    xs[j].done = 1;
    tr->completions++;
    if (tr->act_recv[peer] == j) st = activate_recv(tr, xs, n, peer, j + 1, err);
  }
  stash_free(c, s);
  return st;
}

static rpl_status do_recv(rpl_tr *tr, rpl_xfer *xs, int n, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  while (tr->act_recv[peer] >= 0) {
    /* The active receive decides what may arrive next; in a p2p run the payload may go to a
     * later receive with the message's tag (c->rx_idx). */
    rpl_xfer *x = &xs[tr->act_recv[peer]];
    rpl_xfer *t = c->rx_mode == RX_XFER ? &xs[c->rx_idx] : NULL;
    unsigned char *dst;
    size_t want;
    if (c->rx_mode == RX_HEADER) {
      dst = c->rx_hdr + c->rx_hdr_got;
      want = HDR_SIZE - c->rx_hdr_got;
    } else if (c->rx_mode == RX_XFER) {
      size_t got = t->off - HDR_SIZE, at = t->window ? got % t->window : got;
      dst = (unsigned char *)t->buf + at;
      want = t->len - got;
      if (t->window) want = RPL_MIN(want, t->window - at); /* not past the window's end */
    } else {
      dst = c->rx_stash->data + c->rx_stash_got;
      want = c->rx_stash->len - c->rx_stash_got;
    }
    ssize_t r = 0;
    if (want && c->state == CONN_SHM && t && t->reduce_dst) {
      /* Reduce straight from the ring while whole, aligned elements are contiguous there; a
       * partial element (the ring's wrap, or not all of it written yet), or a payload that an
       * odd-sized earlier message left misaligned, goes through the window. */
      size_t esz = rpl_dtype_size(t->rdtype), got = t->off - HDR_SIZE;
      if (got % esz == 0 && t->reduced * esz == got) {
        const void *src;
        size_t avail = rpl_shm_peek(tr->shm, peer, &src, t->len - got);
        if (avail == 0) return RPL_OK; /* ring empty */
        size_t k = (uintptr_t)src % esz ? 0 : avail / esz;
        if (k) {
          rpl_reduce_into((unsigned char *)t->reduce_dst + got, src, k, t->rdtype, t->rop);
          rpl_shm_consume(tr->shm, peer, k * esz);
          t->reduced += k;
          want = 0;
          r = (ssize_t)(k * esz);
        }
      }
    }
    if (want && c->state == CONN_SHM) {
      r = (ssize_t)rpl_shm_read(tr->shm, peer, dst, want);
      if (r == 0) return RPL_OK; /* ring empty */
    } else if (want && c->ux) {
      r = rpl_ucx_read(c->ux, dst, want);
      if (r == 0) return RPL_OK;
      if (r < 0) return peer_closed(tr, peer, 0, "receiving", err);
    } else if (want) {
      r = recv(c->fd, dst, want, MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return RPL_OK;
        return peer_closed(tr, peer, errno, "receiving", err);
      }
      if (r == 0) return peer_closed(tr, peer, 0, "receiving", err);
    }
    count_add(&tr->counters.bytes_received, (uint64_t)r);

    if (c->rx_mode == RX_HEADER) {
      c->rx_hdr_got += (size_t)r;
      if (c->rx_hdr_got < HDR_SIZE) continue;
      c->rx_hdr_got = 0;
      int was_held = c->held;
      c->held = 0; /* set again below if the stash still has no room for it */
      uint32_t magic;
      rpl_meta m;
      uint64_t len;
      decode_header(c->rx_hdr, &magic, &m, &len);
      if (magic == BYE_MAGIC && c->state != CONN_SHM)
        return goodbye_error(tr, peer, len, "receiving", err);
      if (magic == FIN_MAGIC && c->ux) {
        /* The peer leaves after success and waits until we read this far: tell it. Nothing
         * else will come from it, and the link is done (no write may follow this one). */
        unsigned char a[HDR_SIZE];
        memcpy(a, c->rx_hdr, HDR_SIZE);
        rpl_put32(a, ACK_MAGIC);
        if (!rpl_ucx_writing(c->ux)) rpl_ucx_write(c->ux, a, HDR_SIZE, NULL, 0);
        c->tx_mid = 1;
        char d[96];
        peer_desc(tr, peer, d, sizeof d);
        return rpl_fail(err, RPL_ERR_PEER,
                        "%s closed its process group while this rank was receiving from it "
                        "(it left: ranks called different collectives, or it finished early)",
                        d);
      }
      int target;
      if (tr->p2p && magic == DATA_MAGIC && m.op != RPL_OP_SEND && tr->any_read[peer]) {
        /* A collective's message from a peer read only for an any-source receive: it is
         * for a later collective. Keep its header (run_begin hands it to that run) and read
         * no further from this peer in this run. */
        c->rx_hdr_got = HDR_SIZE;
        tr->act_recv[peer] = -1;
        return RPL_OK;
      }
      if (tr->p2p && magic == DATA_MAGIC && m.op == RPL_OP_SEND) {
        /* Point-to-point run: the first unfinished receive with this tag takes it. */
        target = find_p2p_recv(xs, n, peer, m.tag);
        if (target >= 0 && len != xs[target].len)
          return p2p_size_mismatch(peer, &xs[target], len, err);
      } else {
        rpl_status st = check_header(tr, peer, x, magic, &m, len, err);
        if (st != RPL_OK) return st;
        target = m.op == RPL_OP_SEND && (x->meta.op != RPL_OP_SEND || m.tag != x->meta.tag)
                     ? -1
                     : tr->act_recv[peer];
      }
      if (target < 0) {
        /* Unexpected point-to-point message: keep it for the recv that will want it, if the
         * stash has room; else keep its header and read this peer no further until
         * receives take messages out (run_begin looks at the header again). */
        if (c->stash_msgs >= STASH_MAX_MSGS || len > STASH_MAX_BYTES - c->stash_bytes) {
          if (!was_held) count_add(&tr->counters.stash_holds, 1);
          c->held = 1;
          c->rx_hdr_got = HDR_SIZE;
          return RPL_OK;
        }
        stash_msg *s = calloc(1, sizeof *s);
        if (s) s->data = malloc(len ? (size_t)len : 1);
        if (!s || !s->data) {
          free(s);
          return rpl_fail(err, RPL_ERR_NOMEM, "out of memory buffering a %llu-byte message "
                          "from rank %d", (unsigned long long)len, peer);
        }
        s->tag = m.tag;
        s->arrival = ++tr->arrivals;
        s->len = (size_t)len;
        c->stash_bytes += s->len;
        c->stash_msgs++;
        c->rx_stash = s;
        c->rx_stash_got = 0;
        c->rx_mode = RX_STASH;
      } else {
        c->rx_idx = target;
        t = &xs[target];
        t->off = HDR_SIZE;
        c->rx_mode = RX_XFER;
      }
    } else if (c->rx_mode == RX_XFER) {
      t->off += (size_t)r;
      reduce_arrived(t, t->off - HDR_SIZE, c->state == CONN_SHM);
    } else {
      c->rx_stash_got += (size_t)r;
    }

    if (c->rx_mode == RX_XFER && t->off - HDR_SIZE == t->len) {
      reduce_arrived(t, t->len, 1);
      t->done = 1;
      tr->completions++;
      c->rx_mode = RX_HEADER;
      if (c->rx_idx == tr->act_recv[peer]) {
        rpl_status st = activate_recv(tr, xs, n, peer, tr->act_recv[peer] + 1, err);
        if (st != RPL_OK) return st;
      }
    } else if (c->rx_mode == RX_STASH && c->rx_stash_got == c->rx_stash->len) {
      stash_msg *s = c->rx_stash;
      c->rx_stash = NULL;
      c->rx_mode = RX_HEADER;
      rpl_status st = stash_complete(tr, xs, n, peer, s, err);
      if (st != RPL_OK) return st;
    }
  }
  return RPL_OK;
}

/* ---- the run loop -------------------------------------------------------------------- */

static rpl_status timeout_error(rpl_tr *tr, const rpl_xfer *xs, int n, double deadline_s,
                                rpl_error *err) {
  char who[256] = "";
  size_t used = 0;
  int listed = 0;
  for (int i = 0; i < n && listed < 8; i++) {
    if (xs[i].done) continue;
    int dup = 0;
    for (int j = 0; j < i; j++) dup |= !xs[j].done && xs[j].peer == xs[i].peer;
    if (dup) continue;
    int w = xs[i].peer == RPL_TR_ANY
                ? snprintf(who + used, sizeof who - used, "%sany", listed ? ", " : "")
                : snprintf(who + used, sizeof who - used, "%s%d", listed ? ", " : "", xs[i].peer);
    if (w < 0 || (size_t)w >= sizeof who - used) break;
    used += (size_t)w;
    listed++;
  }
  (void)deadline_s;
  for (int p = 0; p < tr->size; p++)
    if (tr->conns[p].held && tr->act_recv[p] >= 0) {
      char held[256];
      rpl_tr_held_desc(tr, p, held, sizeof held);
      return rpl_fail(err, RPL_ERR_TIMEOUT, "Timed out waiting for rank(s) %s: %s", who, held);
    }
  return rpl_fail(err, RPL_ERR_TIMEOUT,
                  "Timed out waiting for rank(s) %s (a peer is slow, stuck in another "
                  "operation, or gone)", who);
}

/* Sets up a run: validates peers, (re)computes the active transfer per peer and direction,
 * and, for p2p runs, serves receives from the stash. Collective runs start every transfer
 * afresh; p2p runs keep the progress of transfers already under way. */
static rpl_status run_begin(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, int p2p,
                            rpl_error *err) {
  if (tr->aborted) return rpl_fail(err, RPL_ERR_ABORTED, "the transport was closed");
  if (__atomic_load_n(&tr->interrupted, __ATOMIC_SEQ_CST))
    return rpl_fail(err, RPL_ERR_CLOSED, "interrupted: the process group is shutting down");
  tr->p2p = p2p;
  for (int i = 0; i < n; i++) {
    if (!p2p) {
      xs[i].off = 0;
      xs[i].reduced = 0;
      xs[i].done = 0;
    }
    if (p2p && is_any(&xs[i])) continue;
    if (xs[i].peer < 0 || xs[i].peer >= tr->size || xs[i].peer == tr->rank)
      return rpl_fail(err, RPL_ERR_INVALID, "internal error: transfer to rank %d", xs[i].peer);
  }
  for (int p = 0; p < tr->size; p++) tr->act_send[p] = tr->act_recv[p] = -1;
  for (int i = 0; i < n; i++) {
    int p = xs[i].peer;
    if (xs[i].is_send && !xs[i].done && tr->act_send[p] < 0) tr->act_send[p] = i;
  }
  for (int p = 0; p < tr->size; p++) {
    /* A ring pair the peer gave up on (after an error of its own) is abandoned for TCP,
     * unless a message is under way on it (the run then fails on the broken pair). */
    conn *c = &tr->conns[p];
    int idle = c->rx_mode != RX_XFER &&
               (tr->act_send[p] < 0 || xs[tr->act_send[p]].off == 0);
    if (c->state == CONN_SHM && !rpl_shm_usable(tr->shm, p) && idle) close_conn(c);
  }
  if (p2p) {
    /* Receives posted since the last call take the messages already stashed for them, in
     * arrival order per tag (the stash never holds a message a pending receive could take). */
    for (int i = 0; i < n; i++) {
      rpl_xfer *x = &xs[i];
      if (x->done || x->is_send) continue;
      rpl_status st;
      if (is_any(x)) {
        st = any_from_stash(tr, x, err);
      } else {
        conn *c = &tr->conns[x->peer];
        if (c->rx_mode == RX_XFER && c->rx_idx == i) continue;
        int matched;
        st = complete_from_stash(tr, x, &matched, err);
      }
      if (st != RPL_OK) return st;
    }
  }
  for (int i = 0; i < n; i++) {
    int p = xs[i].peer;
    if (p == RPL_TR_ANY) continue;
    if (!xs[i].is_send && !xs[i].done && tr->act_recv[p] < 0) {
      rpl_status st = activate_recv(tr, xs, n, p, i, err);
      if (st != RPL_OK) return st;
      if (tr->act_recv[p] < 0) tr->act_recv[p] = -2; /* all served from the stash */
    }
  }
  for (int p = 0; p < tr->size; p++)
    if (tr->act_recv[p] == -2) tr->act_recv[p] = -1;
  /* A pending any-source receive reads every peer that no receive of its own reads. */
  for (int p = 0; p < tr->size; p++) tr->any_read[p] = 0;
  for (int i = 0; p2p && i < n; i++) {
    if (xs[i].done || !is_any(&xs[i])) continue;
    for (int p = 0; p < tr->size; p++)
      if (p != tr->rank && tr->act_recv[p] < 0) {
        tr->act_recv[p] = i;
        tr->any_read[p] = 1;
      }
    break;
  }
  /* A header an any-source run held back is processed now: no poll would report it. */
  for (int p = 0; p < tr->size; p++) {
    conn *c = &tr->conns[p];
    if (tr->act_recv[p] < 0 || c->rx_mode != RX_HEADER || c->rx_hdr_got != HDR_SIZE) continue;
    rpl_status st = do_recv(tr, xs, n, p, err);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}

/* Fails the run if a ring peer it waits on announced that it gave up (memory reads, on every
 * wait) or has died (a lock probe per peer, at most every LIVENESS_S). A peer may write its
 * last message of the run and close right after our receive pass looked at its ring: what it
 * wrote before raising the flag is visible (the flag is released after the writes), so a run
 * that only receives from it reads once more and fails only if that moves nothing. Sets
 * *moved when that read made progress. */
static rpl_status watch_shm_peers(rpl_tr *tr, rpl_xfer *xs, int n, double now, int *moved,
                                  rpl_error *err) {
  int probe = now >= tr->next_probe;
  if (probe) tr->next_probe = now + LIVENESS_S;
  for (int p = 0; p < tr->size; p++) {
    if (tr->conns[p].state != CONN_SHM) continue;
    if (tr->act_send[p] < 0 && tr->act_recv[p] < 0) continue;
    if (!probe && !rpl_shm_peer_flagged(tr->shm, p)) continue;
    if (tr->act_send[p] < 0 && rpl_shm_usable(tr->shm, p)) {
      uint64_t before = tr->counters.bytes_received;
      rpl_status st = do_recv(tr, xs, n, p, err);
      if (st != RPL_OK) return st;
      if (tr->counters.bytes_received != before || tr->act_recv[p] < 0) {
        *moved = 1;
        continue;
      }
    }
    rpl_status st = rpl_shm_check_peer(tr->shm, p, probe, tr->peer_cause,
                                       sizeof tr->peer_cause, err);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}

static rpl_status refused_error(rpl_tr *tr, int peer, rpl_error *err) {
  char d[96];
  peer_desc(tr, peer, d, sizeof d);
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

static rpl_status probe_done(rpl_tr *tr, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  int soerr = 0;
  socklen_t sl = sizeof soerr;
  if (getsockopt(c->probe_fd, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0) soerr = 0;
  close(c->probe_fd);
  c->probe_fd = -1;
  tr->probes--;
  return soerr == ECONNREFUSED ? refused_error(tr, peer, err) : RPL_OK;
}

static rpl_status replaced_error(rpl_tr *tr, rpl_error *err) {
  return rpl_fail(err, RPL_ERR_PEER,
                  "rank %d reconnected while this rank was still exchanging data with it (it "
                  "gave up on the operation after an error of its own)", tr->replaced);
}

/* Moves what a UCX link allows now. A peer that failed while we only send to it fails the run
 * (what it sent before is read first). */
static rpl_status ucx_io(rpl_tr *tr, rpl_xfer *xs, int n, int p, rpl_error *err) {
  conn *c = &tr->conns[p];
  rpl_status st = RPL_OK;
  if (tr->act_recv[p] >= 0) st = do_recv(tr, xs, n, p, err);
  if (st == RPL_OK && tr->act_send[p] >= 0) st = do_send(tr, xs, n, p, err);
  if (st == RPL_OK && tr->act_send[p] >= 0 && tr->act_recv[p] < 0 && rpl_ucx_failed(c->ux))
    st = peer_closed(tr, p, 0, "sending", err);
  return st;
}

#define UCX_PFD INT32_MIN /* pfd_peer of the UCX worker's event descriptor */
#define PEND_PFD (INT32_MIN + 1) /* pfd_peer of a connection still authenticating */

static rpl_status run_inner(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, int p2p,
                            rpl_error *err) {
  uint64_t completions0 = tr->completions;
  rpl_status st0 = run_begin(tr, xs, n, deadline, p2p, err);
  if (st0 != RPL_OK) return st0;

  for (;;) {
    if (tr->ucx) { /* UCX's callbacks run here: arrivals, completions, new endpoints */
      rpl_ucx_progress(tr->ucx);
      tr->replaced = -1;
      accept_ucx(tr);
      if (tr->replaced >= 0) return replaced_error(tr, err);
    }
    /* Shared-memory peers first: move whatever the rings allow, no system call. */
    uint32_t bell = tr->shm ? rpl_shm_doorbell(tr->shm) : 0;
    int shm_pending = 0;
    uint64_t moved_before = tr->counters.bytes_sent + tr->counters.bytes_received;
    for (int p = 0; p < tr->size && tr->shm; p++) {
      if (tr->act_send[p] < 0 && tr->act_recv[p] < 0) continue;
      conn *c = &tr->conns[p];
      if (c->state == CONN_NONE && rpl_shm_usable(tr->shm, p)) c->state = CONN_SHM;
      if (c->state != CONN_SHM) continue;
      if (!rpl_shm_usable(tr->shm, p))
        return rpl_shm_check_peer(tr->shm, p, 0, tr->peer_cause, sizeof tr->peer_cause, err);
      rpl_status st = RPL_OK;
      if (tr->act_recv[p] >= 0) st = do_recv(tr, xs, n, p, err);
      if (st == RPL_OK && tr->act_send[p] >= 0) st = do_send(tr, xs, n, p, err);
      if (st != RPL_OK) return st;
      if (tr->act_send[p] >= 0 || tr->act_recv[p] >= 0) shm_pending = 1;
    }
    int shm_moved =
        tr->counters.bytes_sent + tr->counters.bytes_received != moved_before;

    /* Collect what is left and what to wait for. */
    double now = rpl_now(); /* vDSO: no system call */
    int listen_probe = now - tr->run_start >= LISTEN_PROBE_S && now >= tr->next_listen_probe;
    if (listen_probe) tr->next_listen_probe = now + LISTEN_PROBE_S;
    int np = 0, pending = shm_pending, tcp_pending = 0, awaiting = 0;
    int ux_moved = 0, ux_writing = 0;
    tr->pfds[np] = (struct pollfd){.fd = tr->wake_fd, .events = POLLIN};
    tr->pfd_peer[np++] = -1;
    tr->pfds[np] = (struct pollfd){.fd = tr->listen_fd, .events = POLLIN};
    tr->pfd_peer[np++] = -2;
    for (int p = 0; p < tr->size; p++) {
      if (tr->act_send[p] < 0 && tr->act_recv[p] < 0) continue;
      pending = 1;
      conn *c = &tr->conns[p];
      if (c->state == CONN_SHM) continue;
      tcp_pending = 1;
      if (c->state == CONN_NONE) {
        if (tr->rank > p) { /* the lower rank connects; we accept */
          awaiting = 1;
          if (listen_probe) {
            rpl_status st = probe_listener(tr, p, err);
            if (st != RPL_OK) return st;
          }
          if (c->probe_fd >= 0) {
            tr->pfds[np] = (struct pollfd){.fd = c->probe_fd, .events = POLLOUT};
            tr->pfd_peer[np++] = -3 - p;
          }
          continue;
        }
        rpl_status st = tr->ucx ? start_connect_ucx(tr, p, err) : start_connect(tr, p, err);
        if (st != RPL_OK) return st;
      }
      if (c->ux) { /* no descriptor per link: try it now, wait on the worker's below */
        uint64_t before = tr->counters.bytes_sent + tr->counters.bytes_received;
        uint64_t done_before = tr->completions;
        if (c->state == CONN_HANDSHAKE || c->state == CONN_HS_SENDING) {
          rpl_status st = continue_handshake(tr, p, err);
          if (st != RPL_OK) return st;
          ux_writing = 1; /* look again every millisecond until it is through */
          if (c->state != CONN_READY) continue;
        }
        rpl_status st = ucx_io(tr, xs, n, p, err);
        if (st != RPL_OK) return st;
        ux_moved |= tr->counters.bytes_sent + tr->counters.bytes_received != before ||
                    tr->completions != done_before;
        ux_writing |= rpl_ucx_writing(c->ux);
        continue;
      }
      short ev = 0;
      if (c->state == CONN_CONNECTING) ev = POLLOUT;
      else if (c->state == CONN_HANDSHAKE) ev = POLLIN;
      else {
        /* POLLRDHUP: the peer shut its end (it exited or gave up), also when we only send.
         * A link held for want of stash room is not read (the sender is held back). */
        ev = POLLRDHUP;
        if (tr->act_send[p] >= 0) ev |= POLLOUT;
        if (tr->act_recv[p] >= 0 && !c->held) ev |= POLLIN;
      }
      tr->pfds[np] = (struct pollfd){.fd = c->fd, .events = ev};
      tr->pfd_peer[np++] = p;
    }
    if (tr->ucx) {
      tr->pfds[np] = (struct pollfd){.fd = rpl_ucx_fd(tr->ucx), .events = POLLIN};
      tr->pfd_peer[np++] = UCX_PFD;
    }
    for (int i = 0; i < tr->n_pend; i++) /* connections authenticating (UCX ones: above) */
      if (tr->pend[i].fd >= 0) {
        tr->pfds[np] = (struct pollfd){.fd = tr->pend[i].fd, .events = POLLIN};
        tr->pfd_peer[np++] = PEND_PFD;
      }
    if (!pending) return RPL_OK;
    /* A p2p run returns as soon as any of its transfers completed, so that the engine can
     * complete that operation (its owner may wait on it before posting the next). */
    if (p2p && tr->completions != completions0) return RPL_OK;

    /* Every wait below is finite and ends by the deadline. */
    double left = deadline - now;
    if (!(left > 0)) return timeout_error(tr, xs, n, deadline, err);
    int ms = left < 3600.0 ? (int)(left * 1000.0) + 1 : 3600000;
    if (awaiting) ms = RPL_MIN(ms, (int)(LISTEN_PROBE_S * 1000.0)); /* to probe again */
    if (shm_pending) {
      /* Ring peers are watched in every wait, whatever else the run waits for. */
      rpl_status st = watch_shm_peers(tr, xs, n, now, &shm_moved, err);
      if (st != RPL_OK) return st;
      if (shm_moved) ms = 0;
      else if (!tcp_pending) {
        /* Only rings to wait on: sleep on our doorbell (rung by their progress, by an abort,
         * or by an interrupt), no longer than the liveness interval. */
        rpl_shm_wait(tr->shm, bell, RPL_MIN(left, LIVENESS_S));
        ms = 0;
      } else {
        rpl_shm_wait(tr->shm, bell, 0); /* spin briefly, then look at the sockets */
        ms = RPL_MIN(ms, 1);
      }
    }
    if (tr->ucx) {
      /* Sleep on the worker's descriptor only once UCX says nothing is left to process. A
       * write under way, and an endpoint being set up (UCX's wire-up messages go out only
       * when the worker is driven), are looked at every millisecond as well: neither need
       * raise an event. */
      if (ux_moved || !rpl_ucx_arm(tr->ucx)) ms = 0;
      else if (ux_writing || tr->n_pend > 0) ms = RPL_MIN(ms, 1);
    }
    int r = poll(tr->pfds, (nfds_t)np, ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      return rpl_fail_errno(err, RPL_ERR_SYSTEM, errno, "poll failed");
    }
    if (r == 0) continue;
    int pend_event = 0;
    for (int k = 0; k < np; k++) {
      short re = tr->pfds[k].revents;
      if (!re) continue;
      int p = tr->pfd_peer[k];
      if (p == UCX_PFD) continue; /* progressed at the top of the loop */
      if (p == PEND_PFD) { /* handled below: the table may change under these indices */
        pend_event = 1;
        continue;
      }
      if (p == -1) {
        uint64_t v;
        ssize_t rr = read(tr->wake_fd, &v, sizeof v);
        (void)rr;
        if (__atomic_load_n(&tr->interrupted, __ATOMIC_SEQ_CST))
          return rpl_fail(err, RPL_ERR_CLOSED,
                          "interrupted: the process group is shutting down");
        if (p2p) return RPL_OK; /* poked: the engine has new operations for the batch */
        continue;               /* a stale poke: nothing for a collective */
      }
      if (p == -2) {
        tr->replaced = -1;
        accept_pending(tr);
        if (tr->replaced >= 0) return replaced_error(tr, err);
        continue;
      }
      if (p <= -3) {
        if (tr->conns[-3 - p].probe_fd < 0) continue; /* the peer connected meanwhile */
        rpl_status st = probe_done(tr, -3 - p, err);
        if (st != RPL_OK) return st;
        continue;
      }
      conn *c = &tr->conns[p];
      if (c->state == CONN_CONNECTING) {
        rpl_status st = finish_connect(tr, p, err);
        if (st != RPL_OK) return st;
        continue;
      }
      if (c->state == CONN_HANDSHAKE) {
        rpl_status st = continue_handshake(tr, p, err);
        if (st != RPL_OK) return st;
        continue;
      }
      if (c->state != CONN_READY) continue; /* replaced by accept_pending above */
      if (c->held && (re & (POLLRDHUP | POLLHUP | POLLERR)))
        return peer_closed(tr, p, 0, "receiving", err); /* nothing more can be read */
      rpl_status st = RPL_OK;
      if ((re & (POLLIN | POLLHUP | POLLERR)) && tr->act_recv[p] >= 0)
        st = do_recv(tr, xs, n, p, err);
      if (st == RPL_OK && (re & (POLLOUT | POLLERR | POLLHUP)) && tr->act_send[p] >= 0)
        st = do_send(tr, xs, n, p, err);
      /* Everything the peer sent before closing has been read above: a send still pending to
       * a peer that shut its end will never be read. */
      if (st == RPL_OK && (re & (POLLRDHUP | POLLHUP)) && tr->act_send[p] >= 0 &&
          tr->act_recv[p] < 0)
        st = peer_closed(tr, p, 0, "sending", err);
      if (st != RPL_OK) return st;
    }
    if (pend_event) {
      tr->replaced = -1;
      for (int i = 0; i < tr->n_pend;)
        if (tr->pend[i].fd < 0 || pend_advance(tr, i)) i++;
      if (tr->replaced >= 0) return replaced_error(tr, err);
    }
  }
}

/* One run, and what it leaves behind: the probes it started are closed, and the cause kept
 * for the peers is that of this run if it failed (the root cause if a peer passed one on), and
 * nothing once a run succeeds (a later shutdown passes no stale cause on). */
static rpl_status run_loop(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, int p2p,
                           rpl_error *err) {
  tr->peer_cause[0] = '\0';
  tr->run_start = rpl_now();
  rpl_status st = run_inner(tr, xs, n, deadline, p2p, err);
  for (int p = 0; tr->probes > 0 && p < tr->size; p++)
    if (tr->conns[p].probe_fd >= 0) {
      close(tr->conns[p].probe_fd);
      tr->conns[p].probe_fd = -1;
      tr->probes--;
    }
  if (st == RPL_OK) {
    if (tr->cause[0]) {
      tr->cause[0] = '\0';
      if (tr->shm) rpl_shm_set_cause(tr->shm, "");
    }
  } else if (st != RPL_ERR_CLOSED && st != RPL_ERR_ABORTED) {
    if (tr->peer_cause[0]) /* a peer's, passed on as it came (it names where it began) */
      snprintf(tr->cause, sizeof tr->cause, "%s", tr->peer_cause);
    else
      rpl_cause_make(tr->cause, sizeof tr->cause, st, tr->rank,
                     err ? err->msg : rpl_status_name(st));
  }
  return st;
}

rpl_status rpl_tr_run(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, rpl_error *err) {
  return run_loop(tr, xs, n, deadline, 0, err);
}

rpl_status rpl_tr_run_p2p(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, rpl_error *err) {
  return run_loop(tr, xs, n, deadline, 1, err);
}

int rpl_tr_wants_idle(const rpl_tr *tr) { return tr->ucx != NULL && !tr->aborted; }

void rpl_tr_idle(rpl_tr *tr) {
  if (!rpl_tr_wants_idle(tr)) return;
  rpl_ucx_progress(tr->ucx);
  for (int p = 0; p < tr->size; p++) tr->act_send[p] = tr->act_recv[p] = -1; /* no run */
  accept_ucx(tr);
}

void rpl_tr_p2p_remap(rpl_tr *tr, const int *new_index, int n) {
  for (int p = 0; p < tr->size; p++) {
    conn *c = &tr->conns[p];
    if (c->rx_mode == RX_XFER && c->rx_idx >= 0 && c->rx_idx < n) c->rx_idx = new_index[c->rx_idx];
  }
}
