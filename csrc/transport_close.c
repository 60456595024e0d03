/* transport_close.c - how links end: closing one, the goodbye frame that passes a failure's
 * cause to the peer (and reading one), UCX's FIN/ACK when leaving after success, the errors a
 * closed link raises, rpl_tr_reset_peer and rpl_tr_abort. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "bytes.h"
#include "common.h"
#include "transport_internal.h"

/* How long closing a UCX endpoint after a goodbye lets UCX deliver it. */
#define UCX_LINGER_S 0.2
/* How long a rank leaving after success waits for its UCX peers to read what it sent. */
#define UCX_FIN_WAIT_S 2.0
/* How long a rank leaving after a failure keeps its UCX links open for peers to read the
 * goodbye (see ucx_await_goodbyes). A peer reading from us takes milliseconds. */
#define UCX_BYE_WAIT_S 1.0

void rpl_tr_close_conn(conn *c) {
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
  rpl_tr_stash_clear(c);
}

/* A frame header that carries no operation: a goodbye (with `len` bytes of text) or a FIN. */
static void control_header(unsigned char h[HDR_SIZE], uint32_t magic, uint64_t len) {
  rpl_meta none;
  memset(&none, 0, sizeof none);
  rpl_tr_encode_header(h, &none, len);
  rpl_put32(h, magic);
}

/* Before this rank closes a connection after a failure: unless a message of ours is half-sent
 * on it (the peer would read the goodbye as payload), send a goodbye frame carrying our cause,
 * so a peer blocked on us can say what went wrong first (say, which rank died) instead of only
 * that we closed. Best effort: never blocks; a peer that misses it sees the close. */
static void say_goodbye(rpl_tr *tr, conn *c) {
  if (c->state != CONN_READY || c->tx_mid || !tr->cause[0]) return;
  size_t n = strnlen(tr->cause, sizeof tr->cause - 1);
  unsigned char h[HDR_SIZE];
  control_header(h, BYE_MAGIC, n);
  if (c->ux) { /* delivered while rpl_tr_close_conn lingers; tr->cause outlives that */
    if (!rpl_ucx_writing(c->ux) && rpl_ucx_write(c->ux, h, HDR_SIZE, tr->cause, n) >= 0)
      c->ux_linger = 1;
    return;
  }
  struct iovec iov[2] = {{h, HDR_SIZE}, {tr->cause, n}};
  struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
  ssize_t r = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)r;
}

void rpl_tr_cut_links(rpl_tr *tr) {
  for (int p = 0; p < tr->size; p++)
    if (tr->conns[p].fd >= 0) shutdown(tr->conns[p].fd, SHUT_RDWR);
}

void rpl_tr_reset_peer(rpl_tr *tr, int peer) {
  if (!tr || peer < 0 || peer >= tr->size || peer == tr->rank) return;
  if (tr->shm) rpl_shm_set_cause(tr->shm, tr->cause); /* before the flag the peer reacts to */
  if (rpl_shm_usable(tr->shm, peer)) { /* the next run with the peer rebuilds the pair */
    rpl_shm_break(tr->shm, peer);
    tr->conns[peer].rebuilt = 1;
  } else {
    say_goodbye(tr, &tr->conns[peer]);
  }
  rpl_tr_close_conn(&tr->conns[peer]);
}

/* Reads what a UCX peer sent after our FIN or goodbye until its answer: an ACK, its own FIN
 * (which gets an ACK), or its own goodbye (it failed by itself and expects nothing from us).
 * *skip: the payload bytes still to skip before a header. Returns 1 once answered or gone, 0
 * while it may say more. */
static int answer_read(conn *c, int64_t *skip) {
  ssize_t r = 1;
  while (*skip >= 0 && r > 0) {
    unsigned char junk[4096];
    if (*skip > 0) { /* a message we no longer want */
      r = rpl_ucx_read(c->ux, junk, (size_t)RPL_MIN((uint64_t)*skip, sizeof junk));
      if (r > 0) *skip -= r;
    } else if ((r = rpl_ucx_read(c->ux, c->rx_hdr + c->rx_hdr_got,
                                 HDR_SIZE - c->rx_hdr_got)) > 0 &&
               (c->rx_hdr_got += (size_t)r) == HDR_SIZE) {
      c->rx_hdr_got = 0;
      uint32_t magic = rpl_get32(c->rx_hdr);
      if (magic == FIN_MAGIC) { /* the peer leaves too: answer it, expect no answer */
        rpl_put32(c->rx_hdr, ACK_MAGIC);
        if (!rpl_ucx_writing(c->ux)) rpl_ucx_write(c->ux, c->rx_hdr, HDR_SIZE, NULL, 0);
      }
      if (magic == ACK_MAGIC || magic == FIN_MAGIC || magic == BYE_MAGIC) r = -1; /* answered */
      else *skip = (int64_t)rpl_get64(c->rx_hdr + 32);
    }
  }
  return r < 0;
}

/* What to wait for on link c, as await_answers' skip: -2 not waited for, -1 its hang-up only
 * (a link we cannot read at a message boundary), else as in answer_read. `fin` is the FIN
 * header ucx_leave sends (NULL for the goodbyes). */
typedef int64_t (*await_plan)(conn *c, const unsigned char *fin);

/* Asks plan what to wait for on every link, then drives UCX until every peer waited for has
 * answered or hung up, or wait_s passes. */
static void await_answers(rpl_tr *tr, await_plan plan, const unsigned char *fin, double wait_s) {
  int64_t *skip = malloc(sizeof(int64_t) * (size_t)tr->size);
  if (!skip) return;
  int waiting = 0;
  for (int i = 0; i < tr->size; i++) {
    skip[i] = plan(&tr->conns[i], fin);
    if (skip[i] != -2) waiting++;
  }
  double end = rpl_now() + wait_s;
  while (waiting > 0 && rpl_now() < end) {
    rpl_ucx_progress(tr->ucx);
    for (int i = 0; i < tr->size; i++) {
      conn *c = &tr->conns[i];
      if (skip[i] == -2) continue;
      if (rpl_ucx_failed(c->ux) || (skip[i] >= 0 && answer_read(c, &skip[i]))) {
        skip[i] = -2;
        waiting--;
      }
    }
  }
  free(skip);
}

/* Only a link at a message boundary both ways can carry a FIN and be read for its answer. */
static int64_t fin_sent(conn *c, const unsigned char *fin) {
  if (!c->ux || rpl_ucx_writing(c->ux) || c->rx_mode != RX_HEADER ||
      rpl_ucx_write(c->ux, fin, HDR_SIZE, NULL, 0) < 0)
    return -2;
  return 0;
}

/* Leaving after success over UCX. Unlike a socket's kernel, UCX drops what a peer has not
 * read yet once this end disconnects, so each UCX peer gets a FIN after our last message and
 * answers it when its reads reach it; we wait for the answers (up to UCX_FIN_WAIT_S). A peer
 * that does not read from us meanwhile sees us gone when it next does. */
static void ucx_leave(rpl_tr *tr) {
  unsigned char fin[HDR_SIZE];
  control_header(fin, FIN_MAGIC, 0);
  await_answers(tr, fin_sent, fin, UCX_FIN_WAIT_S);
}

/* A link that carries a goodbye; one we are mid-message on can only be waited on to hang up. */
static int64_t goodbye_sent(conn *c, const unsigned char *fin) {
  (void)fin;
  if (!c->ux || !c->ux_linger) return -2;
  return c->rx_mode == RX_HEADER ? 0 : -1;
}

/* Leaving after a failure over UCX, goodbyes written (ux_linger marks them). Once an endpoint
 * disconnects, UCX drops on the peer's side what the peer had not read yet, goodbye included:
 * the peer would then only see this rank gone, not the cause (a third rank's death). So each
 * link that carries a goodbye stays open until the peer has read it and answered: it hangs up
 * (the goodbye failed its run), or sends a goodbye or FIN of its own; or until UCX_BYE_WAIT_S
 * passes (a peer that does not read from us meanwhile sees us gone when it next does). A link
 * we are mid-message on cannot be read for an answer: only its hang-up ends the wait. */
static void ucx_await_goodbyes(rpl_tr *tr) {
  await_answers(tr, goodbye_sent, NULL, UCX_BYE_WAIT_S);
}

void rpl_tr_abort(rpl_tr *tr) {
  if (!tr) return;
  if (tr->ucx && !tr->aborted && !tr->cause[0]) ucx_leave(tr);
  tr->aborted = 1;
  if (tr->shm) rpl_shm_set_cause(tr->shm, tr->cause); /* "" replaces a stale one */
  rpl_shm_close(tr->shm);
  if (tr->conns) {
    for (int i = 0; i < tr->size; i++) say_goodbye(tr, &tr->conns[i]);
    if (tr->ucx && tr->cause[0]) ucx_await_goodbyes(tr);
    for (int i = 0; i < tr->size; i++) {
      /* Leaving after success: UCX delivers what we wrote before it disconnects (a socket's
       * kernel does that by itself). */
      if (!tr->cause[0]) tr->conns[i].ux_linger = 1;
      rpl_tr_close_conn(&tr->conns[i]);
    }
  }
  rpl_tr_pend_clear(tr);
  if (tr->listen_fd >= 0) close(tr->listen_fd);
  tr->listen_fd = -1;
}

/* ---- a peer that left -------------------------------------------------------------------- */

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

static rpl_status closed_error(rpl_tr *tr, int peer, int errnum, const char *doing,
                               rpl_error *err) {
  char d[96];
  rpl_tr_peer_desc(tr, peer, d, sizeof d);
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
  rpl_tr_peer_desc(tr, peer, d, sizeof d);
  return rpl_fail(err, RPL_ERR_PEER, "%s gave up after an error of its own: %s", d, why);
}

/* A goodbye the peer sent before closing waits at a message boundary of our receive side
 * (everything before it has been read): its cause is looked for there first. */
rpl_status rpl_tr_peer_closed(rpl_tr *tr, int peer, int errnum, const char *doing,
                              rpl_error *err) {
  conn *c = &tr->conns[peer];
  unsigned char h[HDR_SIZE];
  if (c->ux) {
    if (c->rx_mode == RX_HEADER && c->rx_hdr_got == 0 &&
        link_read_wait(tr, c, h, HDR_SIZE, 0) == 0 && rpl_get32(h) == BYE_MAGIC)
      return goodbye_error(tr, peer, rpl_get64(h + 32), doing, err);
    char d[96];
    rpl_tr_peer_desc(tr, peer, d, sizeof d);
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

rpl_status rpl_tr_leave_error(rpl_tr *tr, int peer, uint32_t magic, uint64_t len,
                              rpl_error *err) {
  conn *c = &tr->conns[peer];
  if (magic == BYE_MAGIC && c->state != CONN_SHM)
    return goodbye_error(tr, peer, len, "receiving", err);
  if (magic != FIN_MAGIC || !c->ux) return RPL_OK;
  /* The peer leaves after success and waits until we read this far: tell it. Nothing else
   * will come from it, and the link is done (no write may follow this one). */
  unsigned char a[HDR_SIZE];
  memcpy(a, c->rx_hdr, HDR_SIZE);
  rpl_put32(a, ACK_MAGIC);
  if (!rpl_ucx_writing(c->ux)) rpl_ucx_write(c->ux, a, HDR_SIZE, NULL, 0);
  c->tx_mid = 1;
  char d[96];
  rpl_tr_peer_desc(tr, peer, d, sizeof d);
  return rpl_fail(err, RPL_ERR_PEER,
                  "%s closed its process group while this rank was receiving from it "
                  "(it left: ranks called different collectives, or it finished early)", d);
}
