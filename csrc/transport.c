/* transport.c - the communicator's byte streams: shared-memory rings to peers on this host,
 * non-blocking TCP sockets or UCX endpoints (ucx.h) to the others, one run loop for all of
 * them. The other transport_*.c files hold what the loop calls on (transport_internal.h). */
#include "transport.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "bytes.h"
#include "common.h"
#include "kernels.h"
#include "transport_internal.h"

/* Reduce arriving data in pieces this large, so reduction overlaps the rest of the transfer. */
#define REDUCE_GRAIN (64u * 1024u)
/* What a run's poll descriptor is for (tr->pfd_peer): a peer's link (its rank), or one of: */
#define WAKE_PFD (-1)            /* the eventfd of rpl_tr_interrupt / rpl_tr_poke */
#define LISTEN_PFD (-2)          /* the listener */
#define PROBE_PFD(peer) (-3 - (peer)) /* a probe of that peer's listener (transport_conn.c) */
#define UCX_PFD INT32_MIN        /* the UCX worker's event descriptor */
#define PEND_PFD (INT32_MIN + 1) /* a connection still authenticating */

/* ---- outside a run ----------------------------------------------------------------------- */

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
  char cause[CAUSE_LEN];
  rpl_status st = rpl_shm_read_peer(tr->shm, peer, addr, dst, len, cause, sizeof cause, err);
  if (st != RPL_OK) {
    if (cause[0]) /* the peer's, passed on as it came (it names where it began) */
      snprintf(tr->cause, sizeof tr->cause, "%s", cause);
    else
      rpl_cause_make(tr->cause, sizeof tr->cause, st, tr->rank, err->msg);
    return st;
  }
  count_add(&tr->counters.bytes_received, len);
  count_add(&tr->counters.single_copy_bytes, len);
  return RPL_OK;
}

void rpl_tr_get_counters(const rpl_tr *tr, rpl_tr_counters *out) {
#define LOAD_(name, doc) out->name = __atomic_load_n(&tr->counters.name, __ATOMIC_RELAXED);
  RPL_TR_COUNTERS(LOAD_)
#undef LOAD_
}

const char *rpl_tr_peer_path(const rpl_tr *tr, int peer) {
  if (peer == tr->rank) return "self";
  const char *p = rpl_shm_path(tr->shm, peer);
  return p ? p : tr->ucx ? "ucx" : "tcp";
}

/* ---- sending --------------------------------------------------------------------------- */

static int next_active(const rpl_xfer *xs, int n, int from, int peer, int is_send) {
  for (int i = from; i < n; i++)
    if (!xs[i].done && xs[i].peer == peer && xs[i].is_send == is_send) return i;
  return -1;
}

/* Authenticated frames: the MAC follows the bytes of x that went out, from x->off = `from`
 * on (`sent` of them); once the payload is whole it is final in c->tx_tag, the trailer. */
static void mac_sent(rpl_tr *tr, conn *c, const rpl_xfer *x, const unsigned char *hdr,
                     size_t from, size_t sent) {
  size_t end = from + sent, pend = HDR_SIZE + x->len;
  if (from >= pend) return; /* the trailer itself */
  if (from == 0) rpl_tr_frame_mac_begin(&c->tx_mac, c, tr->rank, c->tx_frames++, hdr);
  size_t a = from > HDR_SIZE ? from : HDR_SIZE, b = end < pend ? end : pend;
  if (b > a) rpl_hmac_update(&c->tx_mac, (const unsigned char *)x->buf + (a - HDR_SIZE), b - a);
  if (end >= pend) {
    unsigned char full[RPL_SHA256_LEN];
    rpl_hmac_final(&c->tx_mac, full);
    memcpy(c->tx_tag, full, RPL_TR_FRAME_TAG);
  }
}

/* Sends to `peer` while its active send lasts and its link takes data. */
static rpl_status do_send(rpl_tr *tr, rpl_xfer *xs, int n, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  while (tr->act_send[peer] >= 0) {
    rpl_xfer *x = &xs[tr->act_send[peer]];
    unsigned char hdr[HDR_SIZE];
    struct iovec iov[3];
    int niov = 0;
    int fmac = rpl_tr_fmac(tr, c);
    size_t total = HDR_SIZE + x->len + (fmac ? RPL_TR_FRAME_TAG : 0);
    if (x->off < HDR_SIZE) {
      rpl_tr_encode_header(hdr, &x->meta, x->len);
      iov[niov].iov_base = hdr + x->off;
      iov[niov].iov_len = HDR_SIZE - x->off;
      niov++;
    }
    size_t poff = x->off > HDR_SIZE ? x->off - HDR_SIZE : 0;
    if (poff < x->len) {
      iov[niov].iov_base = (unsigned char *)x->buf + poff;
      iov[niov].iov_len = x->len - poff;
      niov++;
    } else if (fmac && x->off >= HDR_SIZE + x->len) { /* the payload is out: its MAC follows
                                                        (mac_sent made it final) */
      size_t toff = x->off - HDR_SIZE - x->len;
      iov[niov].iov_base = c->tx_tag + toff;
      iov[niov].iov_len = RPL_TR_FRAME_TAG - toff;
      niov++;
    }
    ssize_t r;
    if (c->ux) {
      /* UCX takes the whole message (the payload in place) and reports it once delivered. */
      rpl_tr_encode_header(hdr, &x->meta, x->len);
      r = rpl_ucx_write(c->ux, hdr, HDR_SIZE, x->buf, x->len);
      if (r == 0) {
        c->tx_mid = 1;
        return RPL_OK;
      }
      if (r < 0) return rpl_tr_peer_closed(tr, peer, 0, "sending", err);
    } else if (c->state == CONN_SHM) {
      r = (ssize_t)rpl_shm_write(tr->shm, peer, iov, niov);
      if (r == 0) return RPL_OK; /* ring full */
    } else {
      struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
      r = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return RPL_OK;
        return rpl_tr_peer_closed(tr, peer, errno, "sending", err);
      }
    }
    if (fmac) mac_sent(tr, c, x, hdr, x->off, (size_t)r);
    x->off += (size_t)r;
    count_add(&tr->counters.bytes_sent, (uint64_t)r);
    c->tx_mid = x->off != total;
    if (x->off == total) {
      x->done = 1;
      tr->completions++;
      tr->act_send[peer] = next_active(xs, n, tr->act_send[peer] + 1, peer, 1);
    }
  }
  return RPL_OK;
}

/* ---- receiving ------------------------------------------------------------------------- */

rpl_status rpl_tr_activate_recv(rpl_tr *tr, rpl_xfer *xs, int n, int peer, int from,
                                rpl_error *err) {
  for (;;) {
    int i = next_active(xs, n, from, peer, 0);
    tr->act_recv[peer] = i;
    if (i < 0 || xs[i].meta.op != RPL_OP_SEND) return RPL_OK;
    int matched;
    rpl_status st = rpl_tr_stash_take(tr, &xs[i], &matched, err);
    if (st != RPL_OK) return st;
    if (!matched) return RPL_OK;
    from = i + 1;
  }
}

/* Reduces the whole elements of x's payload that have arrived (`got` bytes) into reduce_dst:
 * a grain at a time, at a window's end, or at once when `now`. */
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

/* Where the next bytes from c's link go, and how many of them are wanted there. */
static unsigned char *rx_dest(conn *c, rpl_xfer *xs, size_t *want) {
  if (c->rx_mode == RX_HEADER) {
    *want = HDR_SIZE - c->rx_hdr_got;
    return c->rx_hdr + c->rx_hdr_got;
  }
  if (c->rx_mode == RX_STASH) {
    *want = c->rx_stash->len - c->rx_stash_got;
    return c->rx_stash->data + c->rx_stash_got;
  }
  if (c->rx_mode == RX_TAG) {
    *want = RPL_TR_FRAME_TAG - c->rx_tag_got;
    return c->rx_tag + c->rx_tag_got;
  }
  rpl_xfer *t = &xs[c->rx_idx];
  size_t got = t->off - HDR_SIZE, at = t->window ? got % t->window : got;
  *want = t->len - got;
  if (t->window) *want = RPL_MIN(*want, t->window - at); /* not past the window's end */
  return (unsigned char *)t->buf + at;
}

/* Reduces straight from the ring into t->reduce_dst while whole, aligned elements are
 * contiguous there; a partial element (the ring's wrap, or not all of it written yet), or a
 * payload that an odd-sized earlier message left misaligned, goes through the window instead.
 * Returns the bytes taken, 0 when none can be taken this way, -1 when the ring is empty. */
static ssize_t reduce_from_ring(rpl_tr *tr, int peer, rpl_xfer *t) {
  size_t esz = rpl_dtype_size(t->rdtype), got = t->off - HDR_SIZE;
  if (got % esz != 0 || t->reduced * esz != got) return 0;
  const void *src;
  size_t avail = rpl_shm_peek(tr->shm, peer, &src, t->len - got);
  if (avail == 0) return -1;
  size_t k = (uintptr_t)src % esz ? 0 : avail / esz;
  if (k) {
    rpl_reduce_into((unsigned char *)t->reduce_dst + got, src, k, t->rdtype, t->rop);
    rpl_shm_consume(tr->shm, peer, k * esz);
    t->reduced += k;
  }
  return (ssize_t)(k * esz);
}

/* Reads up to `want` bytes (at least one unless want is 0) of what `peer` sent into dst, or
 * reduces them from the ring into t (the transfer being received, or NULL). *r: the bytes
 * taken, or -1 when nothing has arrived. */
static rpl_status rx_read(rpl_tr *tr, int peer, rpl_xfer *t, unsigned char *dst, size_t want,
                          ssize_t *r, rpl_error *err) {
  conn *c = &tr->conns[peer];
  *r = 0;
  if (!want) return RPL_OK;
  if (c->state == CONN_SHM) {
    if (t && t->reduce_dst && (*r = reduce_from_ring(tr, peer, t)) != 0) return RPL_OK;
    size_t got = rpl_shm_read(tr->shm, peer, dst, want);
    *r = got ? (ssize_t)got : -1;
    return RPL_OK;
  }
  if (c->ux) {
    ssize_t got = rpl_ucx_read(c->ux, dst, want);
    if (got < 0) return rpl_tr_peer_closed(tr, peer, 0, "receiving", err);
    *r = got ? got : -1;
    return RPL_OK;
  }
  for (;;) {
    ssize_t got = recv(c->fd, dst, want, MSG_DONTWAIT);
    if (got > 0) {
      *r = got;
      return RPL_OK;
    }
    if (got == 0) return rpl_tr_peer_closed(tr, peer, 0, "receiving", err);
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return rpl_tr_peer_closed(tr, peer, errno, "receiving", err);
    *r = -1;
    return RPL_OK;
  }
}

/* Which receive takes the message whose header (magic, m, len) arrived from `peer`: *target,
 * or -1 for the stash. The active receive decides what may arrive next; in a p2p run the
 * payload may go to a later receive with the message's tag. */
static rpl_status rx_route(rpl_tr *tr, rpl_xfer *xs, int n, int peer, uint32_t magic,
                           const rpl_meta *m, uint64_t len, int *target, rpl_error *err) {
  if (tr->p2p && magic == DATA_MAGIC && m->op == RPL_OP_SEND) {
    /* Point-to-point run: the first unfinished receive with this tag takes it. */
    *target = rpl_tr_find_p2p_recv(xs, n, peer, m->tag);
    if (*target >= 0 && len != xs[*target].len)
      return rpl_tr_p2p_size_mismatch(peer, &xs[*target], len, err);
    return RPL_OK;
  }
  const rpl_xfer *x = &xs[tr->act_recv[peer]];
  rpl_status st = rpl_tr_check_header(tr, peer, x, magic, m, len, err);
  if (st != RPL_OK) return st;
  *target = m->op == RPL_OP_SEND && (x->meta.op != RPL_OP_SEND || m->tag != x->meta.tag)
                ? -1
                : tr->act_recv[peer];
  return RPL_OK;
}

/* A whole header has arrived from `peer`: its payload goes to a receive or to the stash.
 * Sets *stop when the link is to be read no further for now. */
static rpl_status rx_header(rpl_tr *tr, rpl_xfer *xs, int n, int peer, int *stop,
                            rpl_error *err) {
  conn *c = &tr->conns[peer];
  c->rx_hdr_got = 0;
  int was_held = c->held;
  c->held = 0; /* set again if the stash still has no room for it */
  uint32_t magic;
  rpl_meta m;
  uint64_t len;
  rpl_tr_decode_header(c->rx_hdr, &magic, &m, &len);
  rpl_status st = rpl_tr_leave_error(tr, peer, magic, len, err);
  if (st != RPL_OK) return st;
  if (tr->p2p && magic == DATA_MAGIC && m.op != RPL_OP_SEND && tr->any_read[peer]) {
    /* A collective's message from a peer read only for an any-source receive: it is for a
     * later collective. Keep its header (run_begin hands it to that run) and read no further
     * from this peer in this run. */
    c->rx_hdr_got = HDR_SIZE;
    tr->act_recv[peer] = -1;
    *stop = 1;
    return RPL_OK;
  }
  int target;
  st = rx_route(tr, xs, n, peer, magic, &m, len, &target, err);
  if (st != RPL_OK) return st;
  if (target < 0) { /* unexpected point-to-point message: for the recv that will want it */
    st = rpl_tr_stash_begin(tr, peer, m.tag, len, was_held, err);
    *stop = c->held;
    return st;
  }
  c->rx_idx = target;
  xs[target].off = HDR_SIZE;
  c->rx_mode = RX_XFER;
  return RPL_OK;
}

/* Authenticated frames: a whole payload is followed by its MAC (RX_TAG), checked before the
 * message completes. Returns RPL_OK with *wait set while the trailer is still to come. */
static rpl_status rx_check_tag(rpl_tr *tr, conn *c, int peer, int *wait, rpl_error *err) {
  *wait = 0;
  if (!rpl_tr_fmac(tr, c) || c->rx_tag_ok) return RPL_OK;
  if (c->rx_mode != RX_TAG) { /* the payload just completed */
    c->rx_after = c->rx_mode;
    c->rx_mode = RX_TAG;
    c->rx_tag_got = 0;
  }
  if (c->rx_tag_got < RPL_TR_FRAME_TAG) {
    *wait = 1;
    return RPL_OK;
  }
  unsigned char full[RPL_SHA256_LEN];
  rpl_hmac_final(&c->rx_mac, full);
  c->rx_mode = c->rx_after;
  if (!rpl_ct_equal(full, c->rx_tag, RPL_TR_FRAME_TAG)) {
    count_add(&tr->counters.auth_failures, 1);
    rpl_status st = rpl_fail(err, RPL_ERR_PEER,
                             "a frame from rank %d failed its MAC (authenticated frames): it "
                             "was changed, replayed or injected on the way", peer);
    rpl_cause_make(tr->cause, sizeof tr->cause, st, tr->rank, err->msg);
    return st;
  }
  c->rx_tag_ok = 1;
  return RPL_OK;
}

/* After bytes arrived from `peer`: completes the message being received if it is whole. */
static rpl_status rx_finish(rpl_tr *tr, rpl_xfer *xs, int n, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  int wait = 0;
  int mode = c->rx_mode == RX_TAG ? c->rx_after : c->rx_mode;
  if (mode == RX_XFER) {
    rpl_xfer *t = &xs[c->rx_idx];
    if (t->off - HDR_SIZE != t->len) return RPL_OK;
    rpl_status ts = rx_check_tag(tr, c, peer, &wait, err);
    if (ts != RPL_OK || wait) return ts;
    reduce_arrived(t, t->len, 1);
    t->done = 1;
    tr->completions++;
    c->rx_mode = RX_HEADER;
    if (c->rx_idx != tr->act_recv[peer]) return RPL_OK;
    return rpl_tr_activate_recv(tr, xs, n, peer, tr->act_recv[peer] + 1, err);
  }
  if (mode != RX_STASH || c->rx_stash_got != c->rx_stash->len) return RPL_OK;
  rpl_status ts = rx_check_tag(tr, c, peer, &wait, err);
  if (ts != RPL_OK || wait) return ts;
  stash_msg *s = c->rx_stash;
  c->rx_stash = NULL;
  c->rx_mode = RX_HEADER;
  return rpl_tr_stash_complete(tr, xs, n, peer, s, err);
}

/* Receives from `peer` while its active receive lasts and its link has data: a header, then
 * a payload that goes to a transfer (RX_XFER) or to the stash (RX_STASH). */
static rpl_status do_recv(rpl_tr *tr, rpl_xfer *xs, int n, int peer, rpl_error *err) {
  conn *c = &tr->conns[peer];
  while (tr->act_recv[peer] >= 0) {
    rpl_xfer *t = c->rx_mode == RX_XFER ? &xs[c->rx_idx] : NULL;
    size_t want;
    unsigned char *dst = rx_dest(c, xs, &want);
    ssize_t r;
    rpl_status st = rx_read(tr, peer, t, dst, want, &r, err);
    if (st != RPL_OK) return st;
    if (r < 0) return RPL_OK; /* nothing more has arrived */
    count_add(&tr->counters.bytes_received, (uint64_t)r);
    if (c->rx_mode == RX_HEADER) {
      c->rx_hdr_got += (size_t)r;
      if (c->rx_hdr_got < HDR_SIZE) continue;
      if (r > 0 && rpl_tr_fmac(tr, c) && rpl_get32(c->rx_hdr) == DATA_MAGIC) {
        /* Once per frame, as its header completes (a header kept back for a later run comes
         * through here again with r == 0). */
        rpl_tr_frame_mac_begin(&c->rx_mac, c, peer, c->rx_frames++, c->rx_hdr);
        c->rx_tag_ok = 0;
      }
      int stop = 0;
      st = rx_header(tr, xs, n, peer, &stop, err);
      if (st != RPL_OK || stop) return st;
    } else if (c->rx_mode == RX_XFER) {
      if (rpl_tr_fmac(tr, c)) rpl_hmac_update(&c->rx_mac, dst, (size_t)r);
      t->off += (size_t)r;
      reduce_arrived(t, t->off - HDR_SIZE, c->state == CONN_SHM);
    } else if (c->rx_mode == RX_STASH) {
      if (rpl_tr_fmac(tr, c)) rpl_hmac_update(&c->rx_mac, dst, (size_t)r);
      c->rx_stash_got += (size_t)r;
    } else {
      c->rx_tag_got += (size_t)r;
    }
    st = rx_finish(tr, xs, n, peer, err);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}

/* Moves what peer p's link allows in the directions asked for. */
static rpl_status link_io(rpl_tr *tr, rpl_xfer *xs, int n, int p, int can_recv, int can_send,
                          rpl_error *err) {
  rpl_status st = RPL_OK;
  if (can_recv && tr->act_recv[p] >= 0) st = do_recv(tr, xs, n, p, err);
  if (st == RPL_OK && can_send && tr->act_send[p] >= 0) st = do_send(tr, xs, n, p, err);
  return st;
}

/* ---- starting a run -------------------------------------------------------------------- */

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

/* Refuses a run on a closed transport or bad peers, and records its kind; a collective run
 * starts every transfer afresh, a p2p run keeps the progress of transfers already under way. */
static rpl_status run_check(rpl_tr *tr, rpl_xfer *xs, int n, int p2p, rpl_error *err) {
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
    if (p2p && rpl_tr_is_any(&xs[i])) continue;
    if (xs[i].peer < 0 || xs[i].peer >= tr->size || xs[i].peer == tr->rank)
      return rpl_fail(err, RPL_ERR_INVALID, "internal error: transfer to rank %d", xs[i].peer);
  }
  return RPL_OK;
}

/* The first unfinished send to each peer becomes active; a ring pair the peer gave up on
 * (after an error of its own) is abandoned for TCP, unless a message is under way on it (the
 * run then fails on the broken pair). */
static void begin_sends(rpl_tr *tr, rpl_xfer *xs, int n) {
  for (int p = 0; p < tr->size; p++) tr->act_send[p] = tr->act_recv[p] = -1;
  for (int i = 0; i < n; i++) {
    int p = xs[i].peer;
    if (xs[i].is_send && !xs[i].done && tr->act_send[p] < 0) tr->act_send[p] = i;
  }
  for (int p = 0; p < tr->size; p++) {
    conn *c = &tr->conns[p];
    int idle = c->rx_mode != RX_XFER &&
               (tr->act_send[p] < 0 || xs[tr->act_send[p]].off == 0);
    if (c->state == CONN_SHM && !rpl_shm_usable(tr->shm, p) && idle) {
      rpl_tr_close_conn(c); /* shm_pass rebuilds the pair */
      c->rebuilt = 1;
    }
  }
}

/* The first unfinished receive from each peer becomes active (p2p ones served from the
 * stash); a pending any-source receive reads every peer that no receive of its own reads. */
static rpl_status begin_recvs(rpl_tr *tr, rpl_xfer *xs, int n, int p2p, rpl_error *err) {
  for (int i = 0; i < n; i++) {
    int p = xs[i].peer;
    if (p == RPL_TR_ANY) continue;
    if (!xs[i].is_send && !xs[i].done && tr->act_recv[p] < 0) {
      rpl_status st = rpl_tr_activate_recv(tr, xs, n, p, i, err);
      if (st != RPL_OK) return st;
      if (tr->act_recv[p] < 0) tr->act_recv[p] = -2; /* all served from the stash */
    }
  }
  for (int p = 0; p < tr->size; p++) {
    if (tr->act_recv[p] == -2) tr->act_recv[p] = -1;
    tr->any_read[p] = 0;
  }
  if (p2p) rpl_tr_any_read_begin(tr, xs, n);
  return RPL_OK;
}

/* Sets up a run: validates peers, (re)computes the active transfer per peer and direction,
 * and, for p2p runs, serves receives from the stash. */
static rpl_status run_begin(rpl_tr *tr, rpl_xfer *xs, int n, int p2p, rpl_error *err) {
  rpl_status st = run_check(tr, xs, n, p2p, err);
  if (st != RPL_OK) return st;
  begin_sends(tr, xs, n);
  /* Receives posted since the last call take the messages already stashed for them. */
  if (p2p && (st = rpl_tr_stash_serve(tr, xs, n, err)) != RPL_OK) return st;
  if ((st = begin_recvs(tr, xs, n, p2p, err)) != RPL_OK) return st;
  /* A header an any-source run held back is processed now: no poll would report it. */
  for (int p = 0; p < tr->size; p++) {
    conn *c = &tr->conns[p];
    if (tr->act_recv[p] < 0 || c->rx_mode != RX_HEADER || c->rx_hdr_got != HDR_SIZE) continue;
    if ((st = do_recv(tr, xs, n, p, err)) != RPL_OK) return st;
  }
  return RPL_OK;
}

/* ---- the run loop -------------------------------------------------------------------- */

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
    if (tr->act_send[p] < 0 && tr->act_recv[p] < 0) continue;
    if (tr->conns[p].resuming) { /* only a peer that left or died fails a rebuild */
      rpl_status st = rpl_shm_check_peer(tr->shm, p, probe, 1, tr->peer_cause,
                                         sizeof tr->peer_cause, err);
      if (st != RPL_OK) return st;
      continue;
    }
    if (tr->conns[p].state != CONN_SHM) continue;
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
    rpl_status st = rpl_shm_check_peer(tr->shm, p, probe, 0, tr->peer_cause,
                                       sizeof tr->peer_cause, err);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}

/* What one pass over the peers found, and what the wait after it is for. */
typedef struct pass {
  int np;          /* descriptors to poll in tr->pfds */
  int pending;     /* a transfer is unfinished */
  int shm_pending; /* ... with a ring peer */
  int shm_moved;   /* the rings moved data */
  int tcp_pending; /* ... with a peer over a socket or UCX */
  int awaiting;    /* a lower rank has yet to connect to us */
  int ux_moved;    /* UCX links moved data or completed transfers */
  int ux_writing;  /* a UCX write or handshake is under way */
  uint32_t bell;   /* our doorbell before the ring pass */
} pass;

static uint64_t moved(const rpl_tr *tr) {
  return tr->counters.bytes_sent + tr->counters.bytes_received;
}

static void add_pfd(rpl_tr *tr, pass *ps, int fd, short events, int what) {
  tr->pfds[ps->np] = (struct pollfd){.fd = fd, .events = events};
  tr->pfd_peer[ps->np++] = what;
}

/* Shared-memory peers first: moves whatever the rings allow, no system call. */
static rpl_status shm_pass(rpl_tr *tr, rpl_xfer *xs, int n, pass *ps, rpl_error *err) {
  if (!tr->shm) return RPL_OK;
  ps->bell = rpl_shm_doorbell(tr->shm);
  uint64_t before = moved(tr);
  for (int p = 0; p < tr->size; p++) {
    conn *c = &tr->conns[p];
    c->resuming = 0;
    if (tr->act_send[p] < 0 && tr->act_recv[p] < 0) {
      /* Not in this run: its part of rebuilding a pair the peer broke, which the peer may be
       * waiting for (what the link held belonged to a run that failed already). */
      if (p == tr->rank || rpl_shm_usable(tr->shm, p)) continue;
      if (c->state == CONN_SHM) {
        rpl_tr_close_conn(c);
        c->rebuilt = 1;
      }
      if (c->state == CONN_NONE) rpl_shm_rearm(tr->shm, p);
      continue;
    }
    if (c->state == CONN_NONE) {
      rpl_shm_pair pair = rpl_shm_rearm(tr->shm, p);
      if (pair == RPL_SHM_REARMING) { /* wait for the peer's part; never TCP meanwhile */
        c->resuming = 1;
        ps->shm_pending = 1;
        continue;
      }
      if (pair == RPL_SHM_READY) {
        c->state = CONN_SHM;
        if (c->rebuilt) count_add(&tr->counters.shm_rebuilt, 1);
        c->rebuilt = 0;
      }
    }
    if (c->state != CONN_SHM) continue;
    if (!rpl_shm_usable(tr->shm, p))
      return rpl_shm_check_peer(tr->shm, p, 0, 0, tr->peer_cause, sizeof tr->peer_cause, err);
    rpl_status st = link_io(tr, xs, n, p, 1, 1, err);
    if (st != RPL_OK) return st;
    if (tr->act_send[p] >= 0 || tr->act_recv[p] >= 0) ps->shm_pending = 1;
  }
  ps->shm_moved = moved(tr) != before;
  return RPL_OK;
}

/* A UCX link has no descriptor of its own: it is moved now (the wait is on the worker's). A
 * peer that failed while we only send to it fails the run (what it sent before is read
 * first). */
static rpl_status ucx_pass(rpl_tr *tr, rpl_xfer *xs, int n, int p, pass *ps, rpl_error *err) {
  conn *c = &tr->conns[p];
  uint64_t before = moved(tr), done_before = tr->completions;
  if (c->state == CONN_HANDSHAKE || c->state == CONN_HS_SENDING) {
    rpl_status st = rpl_tr_conn_advance(tr, p, err);
    if (st != RPL_OK) return st;
    ps->ux_writing = 1; /* look again every millisecond until it is through */
    if (c->state != CONN_READY) return RPL_OK;
  }
  rpl_status st = link_io(tr, xs, n, p, 1, 1, err);
  if (st == RPL_OK && tr->act_send[p] >= 0 && tr->act_recv[p] < 0 && rpl_ucx_failed(c->ux))
    st = rpl_tr_peer_closed(tr, p, 0, "sending", err);
  if (st != RPL_OK) return st;
  ps->ux_moved |= moved(tr) != before || tr->completions != done_before;
  ps->ux_writing |= rpl_ucx_writing(c->ux);
  return RPL_OK;
}

/* Peer p (not on a ring) has transfers left: connects or waits to be connected to, moves a
 * UCX link, or says what to poll its socket for. */
static rpl_status link_pass(rpl_tr *tr, rpl_xfer *xs, int n, int p, int listen_probe,
                            pass *ps, rpl_error *err) {
  conn *c = &tr->conns[p];
  if (c->state == CONN_NONE) {
    int accepting = 0;
    rpl_status st = rpl_tr_conn_open(tr, p, listen_probe, &accepting, err);
    if (st != RPL_OK) return st;
    if (accepting) {
      ps->awaiting = 1;
      if (c->probe_fd >= 0) add_pfd(tr, ps, c->probe_fd, POLLOUT, PROBE_PFD(p));
      return RPL_OK;
    }
  }
  if (c->ux) return ucx_pass(tr, xs, n, p, ps, err);
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
  add_pfd(tr, ps, c->fd, ev, p);
  return RPL_OK;
}

/* Collects what is left and what to wait for: the descriptors to poll in tr->pfds. */
static rpl_status links_pass(rpl_tr *tr, rpl_xfer *xs, int n, double now, pass *ps,
                             rpl_error *err) {
  int listen_probe = now - tr->run_start >= LISTEN_PROBE_S && now >= tr->next_listen_probe;
  if (listen_probe) tr->next_listen_probe = now + LISTEN_PROBE_S;
  ps->pending = ps->shm_pending;
  add_pfd(tr, ps, tr->wake_fd, POLLIN, WAKE_PFD);
  add_pfd(tr, ps, tr->listen_fd, POLLIN, LISTEN_PFD);
  for (int p = 0; p < tr->size; p++) {
    if (tr->act_send[p] < 0 && tr->act_recv[p] < 0) continue;
    ps->pending = 1;
    if (tr->conns[p].state == CONN_SHM || tr->conns[p].resuming) continue;
    ps->tcp_pending = 1;
    rpl_status st = link_pass(tr, xs, n, p, listen_probe, ps, err);
    if (st != RPL_OK) return st;
  }
  if (tr->ucx) add_pfd(tr, ps, rpl_ucx_fd(tr->ucx), POLLIN, UCX_PFD);
  for (int i = 0; i < tr->n_pend; i++) /* connections authenticating (UCX ones: above) */
    if (tr->pend[i].fd >= 0) add_pfd(tr, ps, tr->pend[i].fd, POLLIN, PEND_PFD);
  return RPL_OK;
}

/* How long the poll may sleep (*ms), `left` seconds before the deadline. Every wait is finite
 * and ends by the deadline. */
static rpl_status wait_ms(rpl_tr *tr, rpl_xfer *xs, int n, double now, double left, pass *ps,
                          int *ms_out, rpl_error *err) {
  if (tr->give_up) left = RPL_MIN(left, RPL_TR_GIVE_UP_MS / 1000.0); /* to ask it again */
  int ms = left < 3600.0 ? (int)(left * 1000.0) + 1 : 3600000;
  if (ps->awaiting) ms = RPL_MIN(ms, (int)(LISTEN_PROBE_S * 1000.0)); /* to probe again */
  if (ps->shm_pending) {
    /* Ring peers are watched in every wait, whatever else the run waits for. */
    rpl_status st = watch_shm_peers(tr, xs, n, now, &ps->shm_moved, err);
    if (st != RPL_OK) return st;
    if (ps->shm_moved) ms = 0;
    else if (!ps->tcp_pending) {
      /* Only rings to wait on: sleep on our doorbell (rung by their progress, by an abort,
       * or by an interrupt), no longer than the liveness interval. */
      rpl_shm_wait(tr->shm, ps->bell, RPL_MIN(left, LIVENESS_S));
      ms = 0;
    } else {
      rpl_shm_wait(tr->shm, ps->bell, 0); /* spin briefly, then look at the sockets */
      ms = RPL_MIN(ms, 1);
    }
  }
  if (tr->ucx) {
    /* Sleep on the worker's descriptor only once UCX says nothing is left to process. A
     * write under way, and an endpoint being set up (UCX's wire-up messages go out only
     * when the worker is driven), are looked at every millisecond as well: neither need
     * raise an event. */
    if (ps->ux_moved || !rpl_ucx_arm(tr->ucx)) ms = 0;
    else if (ps->ux_writing || tr->n_pend > 0) ms = RPL_MIN(ms, 1);
  }
  *ms_out = ms;
  return RPL_OK;
}

/* Peer p's socket reported `re`. */
static rpl_status link_event(rpl_tr *tr, rpl_xfer *xs, int n, int p, short re,
                             rpl_error *err) {
  conn *c = &tr->conns[p];
  if (c->state == CONN_CONNECTING || c->state == CONN_HANDSHAKE)
    return rpl_tr_conn_advance(tr, p, err);
  if (c->state != CONN_READY) return RPL_OK; /* replaced by accepting a connection above */
  if (c->held && (re & (POLLRDHUP | POLLHUP | POLLERR)))
    return rpl_tr_peer_closed(tr, p, 0, "receiving", err); /* nothing more can be read */
  rpl_status st = link_io(tr, xs, n, p, (re & (POLLIN | POLLHUP | POLLERR)) != 0,
                          (re & (POLLOUT | POLLERR | POLLHUP)) != 0, err);
  /* Everything the peer sent before closing has been read above: a send still pending to
   * a peer that shut its end will never be read. */
  if (st == RPL_OK && (re & (POLLRDHUP | POLLHUP)) && tr->act_send[p] >= 0 &&
      tr->act_recv[p] < 0)
    st = rpl_tr_peer_closed(tr, p, 0, "sending", err);
  return st;
}

/* Handles what the poll reported. Sets *poked when a p2p run is to return (the engine has new
 * operations for the batch). */
static rpl_status on_events(rpl_tr *tr, rpl_xfer *xs, int n, int np, int p2p, int *poked,
                            rpl_error *err) {
  int pend_event = 0;
  for (int k = 0; k < np; k++) {
    short re = tr->pfds[k].revents;
    if (!re) continue;
    int p = tr->pfd_peer[k];
    rpl_status st = RPL_OK;
    if (p == UCX_PFD) continue; /* progressed at the top of the loop */
    if (p == PEND_PFD) { /* handled below: the table may change under these indices */
      pend_event = 1;
    } else if (p == WAKE_PFD) {
      uint64_t v;
      ssize_t rr = read(tr->wake_fd, &v, sizeof v);
      (void)rr;
      if (__atomic_load_n(&tr->interrupted, __ATOMIC_SEQ_CST))
        return rpl_fail(err, RPL_ERR_CLOSED, "interrupted: the process group is shutting down");
      if (p2p) { /* else a stale poke: nothing for a collective */
        *poked = 1;
        return RPL_OK;
      }
    } else if (p == LISTEN_PFD) {
      st = rpl_tr_accept_tcp(tr, err);
    } else if (p <= PROBE_PFD(0)) {
      st = rpl_tr_probe_event(tr, PROBE_PFD(p), err); /* PROBE_PFD is its own inverse */
    } else {
      st = link_event(tr, xs, n, p, re, err);
    }
    if (st != RPL_OK) return st;
  }
  return pend_event ? rpl_tr_accept_pending(tr, err) : RPL_OK;
}

static rpl_status run_inner(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, int p2p,
                            rpl_error *err) {
  uint64_t completions0 = tr->completions;
  rpl_status st = run_begin(tr, xs, n, p2p, err);
  if (st != RPL_OK) return st;
  for (;;) {
    if (tr->ucx) { /* UCX's callbacks run here: arrivals, completions, new endpoints */
      rpl_ucx_progress(tr->ucx);
      if ((st = rpl_tr_accept_ucx(tr, err)) != RPL_OK) return st;
    }
    pass ps;
    memset(&ps, 0, sizeof ps);
    if ((st = shm_pass(tr, xs, n, &ps, err)) != RPL_OK) return st;
    double now = rpl_now(); /* vDSO: no system call */
    if ((st = links_pass(tr, xs, n, now, &ps, err)) != RPL_OK) return st;
    if (!ps.pending) return RPL_OK;
    /* A p2p run returns as soon as any of its transfers completed, so that the engine can
     * complete that operation (its owner may wait on it before posting the next). */
    if (p2p && tr->completions != completions0) return RPL_OK;
    double left = deadline - now;
    if (!(left > 0)) return timeout_error(tr, xs, n, deadline, err);
    if (tr->give_up && tr->give_up(tr->give_up_arg))
      return rpl_fail(err, RPL_ERR_PEER, "given up by the caller while waiting");
    int ms;
    if ((st = wait_ms(tr, xs, n, now, left, &ps, &ms, err)) != RPL_OK) return st;
    int r = poll(tr->pfds, (nfds_t)ps.np, ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      return rpl_fail_errno(err, RPL_ERR_SYSTEM, errno, "poll failed");
    }
    if (r == 0) continue;
    int poked = 0;
    if ((st = on_events(tr, xs, n, ps.np, p2p, &poked, err)) != RPL_OK) return st;
    if (poked) return RPL_OK;
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
  rpl_tr_probes_close(tr);
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

rpl_status rpl_tr_run_until(rpl_tr *tr, rpl_xfer *xs, int n, double deadline,
                            int (*give_up)(void *arg), void *arg, rpl_error *err) {
  tr->give_up = give_up; /* for this run only: wait_ms and run_inner ask it */
  tr->give_up_arg = arg;
  rpl_status st = run_loop(tr, xs, n, deadline, 0, err);
  tr->give_up = NULL;
  tr->give_up_arg = NULL;
  return st;
}

rpl_status rpl_tr_run_p2p(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, rpl_error *err) {
  return run_loop(tr, xs, n, deadline, 1, err);
}

int rpl_tr_wants_idle(const rpl_tr *tr) { return tr->ucx != NULL && !tr->aborted; }

void rpl_tr_idle(rpl_tr *tr) {
  if (!rpl_tr_wants_idle(tr)) return;
  rpl_ucx_progress(tr->ucx);
  for (int p = 0; p < tr->size; p++) tr->act_send[p] = tr->act_recv[p] = -1; /* no run */
  rpl_tr_accept_ucx(tr, NULL); /* nothing to replace: no run */
}

void rpl_tr_p2p_remap(rpl_tr *tr, const int *new_index, int n) {
  for (int p = 0; p < tr->size; p++) {
    conn *c = &tr->conns[p];
    int to_xfer = c->rx_mode == RX_XFER || (c->rx_mode == RX_TAG && c->rx_after == RX_XFER);
    if (to_xfer && c->rx_idx >= 0 && c->rx_idx < n) c->rx_idx = new_index[c->rx_idx];
  }
}
