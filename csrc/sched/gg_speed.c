/* The dynamic Group Generator's measured speeds and what they decide (see the top of gg.c):
 * where the bulk of the job is (medians of the workers' counts and steps), the slowdown filter,
 * the arrival filter and speed-aware admission, the deadline after which a smart group drops
 * its late members, and the adaptive period (whether the job is calm enough to pass a
 * request). */
#include "gg_internal.h"

static int in_job(const gg_worker *x) {
  return x->state == RPL_WORKER_LIVE || x->state == RPL_WORKER_FENCED;
}

/* Where the bulk of the job is: the lower medians of the request counts, of the long step
 * averages (pace) and of the compute steps (comp, with its median absolute deviation) and
 * handed -> request steps (iv) of the workers not gone; unknown steps (0) are left out of the
 * step medians. Recomputed when a count, a step or the set of workers changed (O(n)
 * selections). */
void gg_bulk_refresh(rpl_gg *gg) {
  if (!gg->c_dirty) return;
  double *a = gg->scratch_c;
  int k = 0;
  for (int r = 0; r < gg->n; r++)
    if (in_job(&gg->w[r])) a[k++] = (double)gg->w[r].c; /* exact: counts stay below 2^53 */
  gg->c_med = (uint64_t)rpl_lower_median(a, k);
  k = 0;
  for (int r = 0; r < gg->n; r++)
    if (in_job(&gg->w[r])) a[k++] = gg->w[r].pace;
  gg->pace_med = rpl_lower_median(a, k);
  k = 0;
  for (int r = 0; r < gg->n; r++)
    if (in_job(&gg->w[r]) && gg->w[r].comp > 0) a[k++] = gg->w[r].comp;
  gg->comp_med = rpl_lower_median(a, k);
  k = 0;
  for (int r = 0; r < gg->n; r++) {
    if (!in_job(&gg->w[r]) || gg->w[r].comp <= 0) continue;
    double dev = gg->w[r].comp - gg->comp_med;
    a[k++] = dev < 0 ? -dev : dev;
  }
  gg->comp_mad = rpl_lower_median(a, k);
  k = 0;
  for (int r = 0; r < gg->n; r++)
    if (in_job(&gg->w[r]) && gg->w[r].iv > 0) a[k++] = gg->w[r].iv;
  gg->iv_med = rpl_lower_median(a, k);
  gg->c_dirty = 0;
}

/* The arrival window (seconds, see GG_WINDOW_*), or a negative value while no compute step is
 * measured. */
static double arrival_window(rpl_gg *gg) {
  gg_bulk_refresh(gg);
  double m = gg->comp_med;
  if (m <= 0) return -1.0;
  double w = GG_WINDOW_STEP * m + GG_WINDOW_SPREAD * gg->comp_mad;
  if (w > m) w = m;
  return w < RPL_GG_MIN_PARTNER_WAIT ? RPL_GG_MIN_PARTNER_WAIT : w;
}

/* When idle x is expected to ask (GG clock), from its compute step measured since it last left
 * the GG; a negative value if unknown. */
static double expected_arrival(const gg_worker *x) {
  if (x->comp <= 0 || x->free_at < 0 || x->free_at < x->handed_at) return -1.0;
  return x->free_at + x->comp;
}

/* Slowdown filter (paper 5.3): x is far behind the initiator i -- and, beyond the paper, far
 * behind the bulk of the job too, and (once steps are measured) slower than the bulk. The
 * paper's count rule alone ratchets: at equal speeds the counts drift apart by chance, a worker
 * c_thres behind the rest was left out of their divisions, waited for partners every round and
 * fell further behind -- for good (4 workers, groups of 3: one worker at 2/3 of the others'
 * rate). A worker behind by chance steps as fast as the bulk; a straggler is behind and slow. */
int gg_filtered_out(rpl_gg *gg, const gg_worker *i, const gg_worker *x) {
  if (gg->c_thres < 0 || i->c <= x->c || i->c - x->c < (uint64_t)gg->c_thres) return 0;
  gg_bulk_refresh(gg);
  if (gg->c_med <= x->c || gg->c_med - x->c < (uint64_t)gg->c_thres) return 0;
  /* Speed is what a worker computes between rounds (not its waits, nor the reductions). */
  if (gg->speed_aware && x->comp > 0 && gg->comp_med > 0)
    return x->comp > GG_SLOWER * gg->comp_med;
  if (x->pace <= 0 || gg->pace_med <= 0) return 1; /* no clock: counts alone */
  return x->pace > GG_SLOWER * gg->pace_med;
}

/* Arrival filter: an idle worker not expected to ask within the arrival window would make
 * the initiator's group wait for it -- a straggler computing. The window is the bulk's (see
 * GG_WINDOW_*), the same for every initiator: it does not grow with the coordinator's round
 * trip or with the straggler's own steps, which is what let a job settle into lockstep with a
 * straggler (everyone waited for it, so it never fell behind in requests and its arrivals
 * looked due). Before compute steps are measured: the old estimate (group handed -> next
 * request, within the partner wait or the initiator's step). Unknown intervals never exclude. */
int gg_not_due(rpl_gg *gg, const gg_worker *i, const gg_worker *x) {
  if (!gg->arrival_filter) return 0;
  if (gg->speed_aware && x->late) return 1;
  double eta = gg->speed_aware ? expected_arrival(x) : -1.0;
  double window = gg->speed_aware ? arrival_window(gg) : -1.0;
  if (eta >= 0 && window > 0) return eta - gg->now > window;
  if (x->iv <= 0 || x->handed_at < 0) return 0;
  window = gg_partner_wait(gg);
  if (i->iv > window) window = i->iv;
  return x->handed_at + x->iv - gg->now > window;
}

/* Since when x has been computing without asking, < 0 if it is not (waiting, in a group, fenced)
 * or nobody knows: its last answer; else, if it has not asked since, the end of its last fence
 * or the job's first request -- a worker that has not asked once since warm-up ended is
 * computing from when the others began asking, not of unknown whereabouts to be waited for
 * without end. */
static double computing_since(const rpl_gg *gg, const gg_worker *x) {
  if (x->waiting || x->locked) return -1.0;
  if (x->free_at >= 0) return x->free_at;
  if (x->state != RPL_WORKER_LIVE) return -1.0;
  if (x->unfenced_at >= 0) return x->unfenced_at;
  return x->counted ? -1.0 : gg->first_request_at;
}

/* Whether x has been computing GG_OVERDUE of its step (or the bulk's, if longer) without
 * asking: it has stopped for now -- its steps done, an evaluation, a checkpoint. Waiting for it
 * then, however fast its steps were, costs a worker left behind a partner wait at every
 * request, and the isolation hold after a few groups of one, for nobody (measured: 0.7 s a
 * round with 2 s deadlines, the rounds skipped). Overdue as in job_calm. Part of smart's
 * speed-aware arrival filter: never with either off, nor under another policy. */
int gg_stopped(rpl_gg *gg, const gg_worker *x) {
  double since = computing_since(gg, x);
  if (gg->policy != RPL_POLICY_SMART || !gg->speed_aware || !gg->arrival_filter || since < 0)
    return 0; /* other policies' groups are fixed when drawn: dropping a member breaks them */
  gg_bulk_refresh(gg);
  double step = x->comp > gg->comp_med ? x->comp : gg->comp_med;
  /* No compute step known: exact collectives between every two rounds (FSDP's shard group,
   * a loss all-reduced each step) end each step in a fence, which is no compute step. The
   * step from a group handed to the next request (x's, or the bulk's if longer) is the scale
   * then. Without it a worker that had asked once was never taken for stopped, and a worker
   * left training waited for it without end (its rounds to their timeout). */
  if (step <= 0) step = x->iv > gg->iv_med ? x->iv : gg->iv_med;
  /* Nothing measured at all (the job's first rounds: every group that holds a worker that
   * has never asked waits, so nothing would ever be): the longest partner wait -- 2 s, far
   * beyond the spread of first requests that leave warm-up's last exact step together, yet a
   * bound. */
  if (step <= 0) step = RPL_GG_MAX_PARTNER_WAIT;
  return gg->now - since > GG_OVERDUE * step;
}

/* Whether x (live, smart) is worth waiting for, at most `wait`: a worker of the bulk's speed
 * (or of unknown speed) is, it asks about one bulk step from now at most, unless it has
 * stopped (gg_stopped); a straggler is only if it is computing and expected within the wait --
 * waiting for it otherwise is the lockstep the arrival window avoids. */
int gg_arrives_within(rpl_gg *gg, const gg_worker *x, double wait) {
  if (!gg->speed_aware) return 1;
  gg_bulk_refresh(gg);
  if (x->late || gg_stopped(gg, x)) return 0;
  if (x->comp <= 0 || gg->comp_med <= 0 || x->comp <= GG_SLOWER * gg->comp_med) return 1;
  double eta = worker_idle(x) ? expected_arrival(x) : -1.0;
  return eta >= 0 && eta - gg->now <= wait;
}

/* How long the members of a group are waited for after its first one is ready: two arrival
 * windows, or the partner wait if longer; negative while no compute step is measured. */
static double evict_after(rpl_gg *gg) {
  double window = arrival_window(gg), wait = gg_partner_wait(gg);
  if (window <= 0) return -1.0;
  return GG_EVICT_WINDOWS * window > wait ? GG_EVICT_WINDOWS * window : wait;
}

/* The first member ready for g starts its clock (see evict_after; half a window in a
 * calm job, GG_CALM_EVICT_WINDOWS). Measured from the first arrival, not from generation: a
 * division's second group (inter_intra's Intra) waits for its members' first ones. */
void gg_arm_deadline(rpl_gg *gg, gg_group *g) {
  if (!g || !g->evictable || g->deadline >= 0 || g->state != G_PENDING) return;
  double after = evict_after(gg);
  if (after < 0) return; /* no compute step measured yet: no prediction to have failed */
  g->calm = gg->period > 1;
  g->deadline = gg->now + (g->calm ? GG_CALM_EVICT_WINDOWS * arrival_window(gg) : after);
}

/* Smart groups past their deadline drop the members that have not asked, if two or more have:
 * the admission predicted their arrivals within the arrival window, and a prediction that
 * failed (a worker slowed just now) must cost the others a bounded wait. A group with fewer
 * than two members waiting keeps everyone (dropping would leave a group of one) -- except
 * members that have stopped asking (gg_stopped: their steps done, say), which any group with a
 * member waiting drops at once, however few are left: such a group would never be handed, and
 * its waiting member would meet it again at the head of its buffer at every request. The
 * dropped members' buffers lose the group and nothing else, so every order still holds; they
 * are served afresh when they ask. */
rpl_status gg_evict_late(rpl_gg *gg, rpl_error *err) {
  rpl_status st = RPL_OK;
  gg_group *g = gg->pend_head;
  while (g && st == RPL_OK) {
    gg_group *next = g->next;
    int arrived = 0, stopped = 0;
    for (int i = 0; i < g->n; i++) {
      const gg_worker *x = &gg->w[g->members[i]];
      if (arrived_for(x, g)) arrived++;
      else stopped += gg_stopped(gg, x);
    }
    int due = g->deadline >= 0 && g->deadline <= gg->now && arrived >= 2 && arrived < g->n;
    if (due || (arrived >= 1 && stopped > 0)) {
      /* A calm job's late member that missed its last due group already is kept: the group
       * waits for it, bounded as outside calm, so that it averages at least every
       * 2 x period_max requests. */
      int k = 0, kept = 0;
      for (int i = 0; i < g->n; i++) {
        int m = g->members[i];
        gg_worker *x = &gg->w[m];
        int gone = !arrived_for(x, g) && gg_stopped(gg, x);
        if (arrived_for(x, g)) {
          g->members[k++] = m;
        } else if (!gone && (!due || (g->calm && x->missed_last))) {
          g->members[k++] = m;
          kept += due;
        } else {
          gg_buf_remove(x, g);
          x->late = 1;
          x->missed = x->missed_last = g->calm;
          gg->st.late_dropped++;
        }
      }
      int dropped = g->n - k;
      g->n = k; /* still sorted */
      if (due) {
        g->calm = 0;
        g->deadline = kept ? gg->now + evict_after(gg) : -1.0;
      }
      if (dropped) gg_trace_group(gg, RPL_TRACE_DROPPED, g, -1, 0);
      st = gg_try_hand(gg, g, err); /* handed now if every member left is waiting */
    }
    g = next;
  }
  return st;
}

/* ---- the adaptive period (see the top of gg.c) ----------------------------------------------- */

/* Whether the job keeps its pace: every live worker's compute step (from leaving the GG to
 * asking again, so neither reductions nor waits for groups count) is known, and none has been
 * computing for GG_OVERDUE of its expected steps (a worker slowed just now is seen before its
 * slow step ends). A worker whose step is over GG_BEHIND of the bulk's is a straggler: with the
 * previous rules (speed_aware off) it makes the job not calm; speed-aware, it is expected at its
 * own pace, passed only where nobody is due (gg_period_pass), and the bulk keeps its period --
 * the fast workers of a job with a persistent straggler (production traces: one worker 2.35x,
 * or two speed classes) need not average at every step because one worker is slow. Fenced workers are
 * inside an exact collective with everyone: they do not count. Needs the clock. O(n). */
static int job_calm(rpl_gg *gg) {
  if (gg->now <= 0) return 0;
  double *a = gg->scratch_c;
  int k = 0;
  for (int r = 0; r < gg->n; r++) {
    const gg_worker *x = &gg->w[r];
    if (x->state != RPL_WORKER_LIVE) continue;
    if (x->comp <= 0) return 0;
    a[k++] = x->comp;
  }
  if (k == 0) return 0;
  double med = rpl_lower_median(a, k);
  gg->calm_med = med;
  for (int r = 0; r < gg->n; r++) {
    const gg_worker *x = &gg->w[r];
    if (x->state != RPL_WORKER_LIVE) continue;
    int straggler = x->comp > GG_BEHIND * med;
    if (straggler && !gg->speed_aware) return 0;
    int computing = !x->waiting && !x->locked && x->free_at >= 0;
    if (computing && gg->now - x->free_at > GG_OVERDUE * (straggler ? x->comp : med)) return 0;
  }
  return 1;
}

/* Updates the period for a request of `me` and says whether to pass it (then counts the pass
 * in me->since). The period rises to period_max only after a calm request from each worker in
 * a row, so that one noisy step does not flip it, and falls to 1 at the first request that
 * finds the job not calm (a worker overdue). A known straggler is passed only when nobody is
 * due to average with it (idle and expected within the arrival window, as a division would
 * take them in), never twice in a row. */
int gg_period_pass(rpl_gg *gg, gg_worker *me) {
  if (gg->period_max <= 1) return 0;
  if (!job_calm(gg)) {
    if (gg->period > 1) gg->st.period_drops++;
    gg->period = 1;
    gg->calm = 0;
  } else if (gg->period == 1 && ++gg->calm >= gg->n - gg->ngone) {
    gg->period = gg->period_max;
  }
  gg->st.period = (uint32_t)gg->period;
  int missed = me->missed;
  me->missed = 0;
  /* Never pass a worker others wait for: its group is generated (buffer), or partners wait. */
  if (gg->period <= 1 || me->blen != 0 || gg->dq_len != 0 || is_isolated(gg, me)) return 0;
  if (me->comp > GG_BEHIND * gg->calm_med) {
    /* A straggler averages at every other request at least: with nobody due to average with
     * now (the bulk computing, all faster) it would wait up to a bulk step for them; it passes
     * instead, once. */
    if (me->since != 0 || gg_division_participants(gg, (int)(me - gg->w), 0, NULL, NULL) >= 2)
      return 0;
    me->since++;
    return 1;
  }
  if (missed) { /* late for its due group: counted as if it had been in it, so that it is due
                 * again with the rest of that group, at the next due step */
    me->since = 0;
    return 1;
  }
  if (me->since + 1 >= (uint32_t)gg->period) return 0;
  me->since++;
  return 1;
}
