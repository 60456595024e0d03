/* transport_stash.c - point-to-point messages that arrive before a receive wants them: each
 * link keeps them in arrival order (bounded per peer, see STASH_MAX_*) until a receive with
 * their tag takes them; any-source receives are served from here too. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "transport_internal.h"

/* What one peer's unexpected point-to-point messages may hold in memory. Past that its link
 * is read no further (the sender is held back by the link's own flow control) until receives
 * take messages out. */
#define STASH_MAX_BYTES ((size_t)256 << 20)
#define STASH_MAX_MSGS 4096

/* A stashed message leaves the stash (taken by a receive, or given up): its room is free. */
static void stash_free(conn *c, stash_msg *m) {
  c->stash_bytes -= m->len;
  c->stash_msgs--;
  free(m->data);
  free(m);
}

void rpl_tr_stash_clear(conn *c) {
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

int rpl_tr_find_p2p_recv(const rpl_xfer *xs, int n, int peer, uint32_t tag) {
  for (int i = 0; i < n; i++)
    if (!xs[i].done && !xs[i].is_send && xs[i].peer == peer && xs[i].meta.op == RPL_OP_SEND &&
        xs[i].meta.tag == tag)
      return i;
  return -1;
}

rpl_status rpl_tr_p2p_size_mismatch(int peer, const rpl_xfer *x, uint64_t len, rpl_error *err) {
  return rpl_fail(err, RPL_ERR_MISMATCH,
                  "recv from rank %d (tag %u) expects %zu bytes but rank %d sent %llu bytes",
                  peer, x->meta.tag, x->len, peer, (unsigned long long)len);
}

static rpl_status any_size_mismatch(const rpl_xfer *x, int peer, size_t len, rpl_error *err) {
  return rpl_fail(err, RPL_ERR_MISMATCH,
                  "recv from any rank (tag %u) expects %zu bytes but rank %d sent %zu bytes",
                  x->meta.tag, x->len, peer, len);
}

/* Hands stashed message m (after prev in c's list) to receive x, which completes. */
static void stash_deliver(rpl_tr *tr, conn *c, stash_msg *prev, stash_msg *m, rpl_xfer *x) {
  if (m->len) memcpy(x->buf, m->data, m->len);
  if (prev) prev->next = m->next;
  else c->stash_head = m->next;
  if (c->stash_tail == m) c->stash_tail = prev;
  stash_free(c, m);
  x->done = 1;
  tr->completions++;
}

rpl_status rpl_tr_stash_take(rpl_tr *tr, rpl_xfer *x, int *matched, rpl_error *err) {
  conn *c = &tr->conns[x->peer];
  stash_msg *prev = NULL;
  *matched = 0;
  for (stash_msg *m = c->stash_head; m; prev = m, m = m->next) {
    if (m->tag != x->meta.tag) continue;
    if (m->len != x->len) return rpl_tr_p2p_size_mismatch(x->peer, x, m->len, err);
    stash_deliver(tr, c, prev, m, x);
    *matched = 1;
    return RPL_OK;
  }
  return RPL_OK;
}

/* Any-source receives (peer RPL_TR_ANY in a p2p run) take whole messages from the stash:
 * while one is pending, every peer without a receive of its own is read into the stash, and
 * a stashed message no receive from its peer takes goes to the first any-source receive with
 * its tag, which then records its sender in `peer`. */
static int find_any_recv(const rpl_xfer *xs, int n, uint32_t tag) {
  for (int i = 0; i < n; i++)
    if (!xs[i].done && rpl_tr_is_any(&xs[i]) && xs[i].meta.tag == tag) return i;
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
  if (best->len != x->len) return any_size_mismatch(x, best_peer, best->len, err);
  x->peer = best_peer;
  stash_deliver(tr, &tr->conns[best_peer], best_prev, best, x);
  return RPL_OK;
}

rpl_status rpl_tr_stash_serve(rpl_tr *tr, rpl_xfer *xs, int n, rpl_error *err) {
  /* In arrival order per tag: the stash never holds a message a pending receive could take. */
  for (int i = 0; i < n; i++) {
    rpl_xfer *x = &xs[i];
    if (x->done || x->is_send) continue;
    rpl_status st;
    if (rpl_tr_is_any(x)) {
      st = any_from_stash(tr, x, err);
    } else {
      conn *c = &tr->conns[x->peer];
      if ((c->rx_mode == RX_XFER || (c->rx_mode == RX_TAG && c->rx_after == RX_XFER)) &&
          c->rx_idx == i)
        continue;
      int matched;
      st = rpl_tr_stash_take(tr, x, &matched, err);
    }
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}

void rpl_tr_any_read_begin(rpl_tr *tr, rpl_xfer *xs, int n) {
  for (int i = 0; i < n; i++) {
    if (xs[i].done || !rpl_tr_is_any(&xs[i])) continue;
    for (int p = 0; p < tr->size; p++)
      if (p != tr->rank && tr->act_recv[p] < 0) {
        tr->act_recv[p] = i;
        tr->any_read[p] = 1;
      }
    break;
  }
}

rpl_status rpl_tr_stash_begin(rpl_tr *tr, int peer, uint32_t tag, uint64_t len, int was_held,
                              rpl_error *err) {
  conn *c = &tr->conns[peer];
  /* No room: keep the header and read this peer no further until receives take messages
   * out (run_begin looks at the header again). */
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
  s->tag = tag;
  s->arrival = ++tr->arrivals;
  s->len = (size_t)len;
  c->stash_bytes += s->len;
  c->stash_msgs++;
  c->rx_stash = s;
  c->rx_stash_got = 0;
  c->rx_mode = RX_STASH;
  return RPL_OK;
}

/* In a p2p run, a receive posted since the message's header arrived takes it at once (one
 * from its peer first, else an any-source one); otherwise it waits, in arrival order. */
rpl_status rpl_tr_stash_complete(rpl_tr *tr, rpl_xfer *xs, int n, int peer, stash_msg *s,
                                 rpl_error *err) {
  conn *c = &tr->conns[peer];
  int j = tr->p2p ? rpl_tr_find_p2p_recv(xs, n, peer, s->tag) : -1;
  int any = j < 0 && tr->p2p && (j = find_any_recv(xs, n, s->tag)) >= 0;
  if (j < 0) {
    if (c->stash_tail) c->stash_tail->next = s;
    else c->stash_head = s;
    c->stash_tail = s;
    return RPL_OK;
  }
  rpl_status st = RPL_OK;
  if (s->len != xs[j].len) {
    st = any ? any_size_mismatch(&xs[j], peer, s->len, err)
             : rpl_tr_p2p_size_mismatch(peer, &xs[j], s->len, err);
  } else {
    if (s->len) memcpy(xs[j].buf, s->data, s->len);
    if (any) xs[j].peer = peer;
    xs[j].done = 1;
    tr->completions++;
    if (!any && tr->act_recv[peer] == j)
      st = rpl_tr_activate_recv(tr, xs, n, peer, j + 1, err);
  }
  stash_free(c, s);
  return st;
}
