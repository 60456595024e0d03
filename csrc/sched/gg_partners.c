/* The dynamic Group Generator's group formation in time (see the top of gg.c): whether a
 * requester with an empty buffer gets its group now or waits, bounded, for partners about to be
 * available; the isolation bound (a worker alone too often waits longer, or joins a pending
 * group); and the GG's clock, which ends those waits. */
#include "gg_internal.h"

/* The partner wait: about one step of the bulk (the median worker's group handed -> next
 * request), not the mean over requests, which a straggler in lockstep drags towards its own. */
double gg_partner_wait(rpl_gg *gg) {
  if (gg->partner_wait > 0) return gg->partner_wait;
  gg_bulk_refresh(gg);
  double base = gg->speed_aware && gg->iv_med > 0 ? gg->iv_med : gg->interval;
  double w = base > 0 ? 1.5 * base : RPL_GG_FIRST_PARTNER_WAIT;
  return w < RPL_GG_MIN_PARTNER_WAIT ? RPL_GG_MIN_PARTNER_WAIT
                                     : w > RPL_GG_MAX_PARTNER_WAIT ? RPL_GG_MAX_PARTNER_WAIT : w;
}

/* How many members w's group would have if generated now (w included). */
static int available(rpl_gg *gg, int w, int widen) {
  if (gg->policy == RPL_POLICY_SMART) return gg_division_participants(gg, w, widen, NULL, NULL);
  int others = gg->nlive - (gg->w[w].state == RPL_WORKER_LIVE ? 1 : 0);
  return 1 + (others < gg->group_size - 1 ? others : gg->group_size - 1);
}

/* Whether a worker w could group with is about to become available and is not far behind w:
 * fenced inside the exact collective w has just left, or (smart) live but busy in a group or
 * not due yet. */
static int others_coming(rpl_gg *gg, int w, int widen) {
  const gg_worker *me = &gg->w[w];
  for (int r = 0; r < gg->n; r++) {
    const gg_worker *x = &gg->w[r];
    if (r == w) continue;
    /* A worker that fenced after w's last unfence is in a collective w has not entered -- one
     * that may wait for w itself (a metric, a final average): not coming, however recent its
     * fence. One fenced before was in w's collective and is leaving it, unless w left that a
     * wait ago already. */
    int soon = (x->state == RPL_WORKER_FENCED && x->fenced_at <= me->unfenced_at &&
                gg->now - me->unfenced_at < gg_partner_wait(gg)) ||
               (gg->policy == RPL_POLICY_SMART && x->state == RPL_WORKER_LIVE &&
                (!worker_idle(x) || gg_not_due(gg, me, x)) && /* the idle and due are in already */
                gg_arrives_within(gg, x, gg_partner_wait(gg)));
    if (soon && (widen || !gg_filtered_out(gg, me, x))) return 1;
  }
  return 0;
}

static void defer(rpl_gg *gg, int w, double deadline) {
  gg->w[w].deferred = 1;
  gg->w[w].deadline = deadline;
  gg->dq[gg->dq_len++] = w;
  gg->st.deferred++;
}

/* Adds the isolated, waiting w to the pending group most of whose members are waiting (the
 * one handed soonest). w's buffer is empty, so the group is at its head and in generation
 * order. Returns 1 if it joined one. */
static int join_pending(rpl_gg *gg, int w, rpl_status *st, rpl_error *err) {
  gg_group *best = NULL;
  int best_arrived = -1;
  for (gg_group *g = gg->pend_head; g; g = g->next) {
    if (g->key != 0 || g->n >= g->cap || group_has(g, w)) continue;
    int arrived = 0;
    for (int i = 0; i < g->n; i++) {
      const gg_worker *x = &gg->w[g->members[i]];
      arrived += x->waiting && x->blen > 0 && x->buf[0] == g;
    }
    if (arrived > best_arrived) {
      best = g;
      best_arrived = arrived;
    }
  }
  if (!best) return 0;
  if (gg_buf_push(&gg->w[w], best) != 0) {
    *st = rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
    return 1;
  }
  int i = best->n++;
  while (i > 0 && best->members[i - 1] > w) {
    best->members[i] = best->members[i - 1];
    i--;
  }
  best->members[i] = w;
  gg_undefer(gg, w);
  gg->st.joins++;
  gg_trace_group(gg, RPL_TRACE_JOINED, best, w, 0);
  *st = gg_try_hand(gg, best, err);
  return 1;
}

/* w is waiting with an empty buffer: generate its group now, or let it wait for partners. */
rpl_status gg_serve(rpl_gg *gg, int w, rpl_error *err) {
  gg_worker *me = &gg->w[w];
  int isolated = is_isolated(gg, me);
  int active = gg->n - gg->ngone;
  int need = isolated ? 2 : gg->group_size < active ? gg->group_size : active;
  if (available(gg, w, isolated) >= need || !others_coming(gg, w, isolated))
    return gg_generate(gg, w, isolated, err);
  if (!me->deferred) {
    if (gg->partner_wait < 0 && !isolated) return gg_generate(gg, w, 0, err);
    defer(gg, w, gg->now + (gg->partner_wait < 0 ? 0 : gg_partner_wait(gg)));
  }
  if (isolated) { /* isolated and alone while others are coming: join a pending group */
    rpl_status st = RPL_OK;
    if (join_pending(gg, w, &st, err)) return st;
  }
  if (me->deadline > gg->now) return RPL_OK;
  if (isolated && !me->held) {
    /* Hold on past the wait -- bounded, so that a worker nobody serves (the others stuck in
     * a long exact collective, say) still gets its no-op round before its request times out. */
    double hold = 4 * gg_partner_wait(gg);
    me->held = 1;
    me->deadline = gg->now + hold;
    gg->st.isolation_holds++;
    return RPL_OK;
  }
  gg->st.wait_expired++; /* a smaller group, or one of one */
  return gg_generate(gg, w, isolated, err);
}

/* Re-checks every deferred request after an event (or a clock step) changed who is available. */
rpl_status gg_serve_deferred(rpl_gg *gg, rpl_error *err) {
  rpl_status st = RPL_OK;
  /* gg_serve() only ever removes entries (a generated or joined group takes its waiting members
   * out): start again from the front after each removal. */
  for (int i = 0; i < gg->dq_len && st == RPL_OK;) {
    int w = gg->dq[i], len = gg->dq_len;
    st = gg_serve(gg, w, err);
    i = gg->dq_len != len ? 0 : i + 1;
  }
  return st;
}

rpl_status rpl_gg_advance(rpl_gg *gg, double now, rpl_error *err) {
  if (now > gg->now) gg->now = now;
  rpl_status st = gg_evict_late(gg, err);
  return st != RPL_OK ? st : gg_serve_deferred(gg, err);
}

double rpl_gg_next_deadline(const rpl_gg *gg) {
  double next = -1.0;
  for (int i = 0; i < gg->dq_len; i++) {
    double d = gg->w[gg->dq[i]].deadline;
    if (next < 0 || d < next) next = d;
  }
  /* Pending groups' deadlines still ahead (one passed acts at the next event instead: the
   * caller must not be woken again and again for a group waiting for its second member). */
  for (const gg_group *g = gg->pend_head; g; g = g->next)
    if (g->deadline > gg->now && (next < 0 || g->deadline < next)) next = g->deadline;
  return next;
}
