/* The dynamic Group Generator's policies: what each one generates when a requester's buffer is
 * empty (see the top of gg.c) -- random and adpsgd (the requester plus drawn live workers),
 * smart (a Global Division over the idle workers the filters of gg_speed.c admit, with
 * inter_intra's Inter and Intra groups), and static (the static schedule's group of the round,
 * for simulation). */
#include "gg_internal.h"

static void shuffle(uint64_t *rng, int *a, int n) {
  for (int i = n - 1; i > 0; i--) {
    int j = (int)rpl_rng_below(rng, (uint32_t)i + 1);
    int t = a[i];
    a[i] = a[j];
    a[j] = t;
  }
}

/* k distinct live workers other than w, uniformly; returns how many (fewer if not enough). */
static int draw_others(rpl_gg *gg, int w, int k, int *out) {
  int others = gg->nlive - (gg->w[w].state == RPL_WORKER_LIVE ? 1 : 0);
  if (k > others) k = others;
  if (k <= 0) return 0;
  if (others * 4 >= gg->n && others > 2 * k) {
    /* Plenty of candidates: rejection sampling costs O(k) instead of a scan of all workers. */
    int got = 0;
    while (got < k) {
      int r = (int)rpl_rng_below(&gg->rng, (uint32_t)gg->n);
      if (r == w || gg->w[r].state != RPL_WORKER_LIVE) continue;
      int dup = 0;
      for (int i = 0; i < got; i++) dup |= out[i] == r;
      if (!dup) out[got++] = r;
    }
    return got;
  }
  int *cand = gg->scratch_b, nc = 0;
  for (int r = 0; r < gg->n; r++)
    if (r != w && gg->w[r].state == RPL_WORKER_LIVE) cand[nc++] = r;
  for (int i = 0; i < k; i++) { /* partial Fisher-Yates */
    int j = i + (int)rpl_rng_below(&gg->rng, (uint32_t)(nc - i));
    int t = cand[i];
    cand[i] = cand[j];
    cand[j] = t;
    out[i] = cand[i];
  }
  return k;
}

/* Splits a[0..n) (already shuffled) into max(1, round(n/g)) groups whose sizes differ by at
 * most one -- but never a group of one beside others (3 workers in pairs: one group of 3, not
 * a pair and a no-op round) -- and creates them. */
static rpl_status partition_create(rpl_gg *gg, int *a, int n, rpl_phase phase, int heads,
                                   int initiator, uint64_t division, rpl_error *err) {
  if (n <= 0) return RPL_OK;
  int g = gg->group_size;
  int k = (n + g / 2) / g;
  if (k > n / 2) k = n / 2;
  if (k < 1) k = 1;
  for (int i = 0; i < k; i++) {
    int lo = (int)((int64_t)i * n / k), hi = (int)((int64_t)(i + 1) * n / k);
    rpl_status st = gg_group_create(gg, a + lo, hi - lo, phase, heads, 0, initiator, division,
                                    NULL, err);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}

static rpl_status generate_random(rpl_gg *gg, int w, rpl_error *err) {
  int *m = gg->scratch_a;
  int k = draw_others(gg, w, gg->group_size - 1, m + 1);
  m[0] = w;
  return gg_group_create(gg, m, k + 1, RPL_PHASE_PLAIN, 0, 0, w, 0, NULL, err);
}

/* The participants of a division started by w (w first) into p; returns how many. A deferred
 * worker is waiting already, so taking it in makes nobody wait: the filters do not apply to
 * it, nor to anyone when `widen` (w is isolated) -- but one that has stopped asking
 * (gg_stopped) is never taken in. NULL p only counts. */
int gg_division_participants(rpl_gg *gg, int w, int widen, int *p, uint64_t *nfiltered) {
  const gg_worker *me = &gg->w[w];
  int np = 0;
  if (p) p[np] = w;
  np++;
  for (int r = 0; r < gg->n; r++) {
    const gg_worker *x = &gg->w[r];
    if (r == w || x->state != RPL_WORKER_LIVE || !worker_idle(x)) continue;
    /* Not even widened: a group with a worker that has stopped asking is never handed, and
     * the isolated requester's round would wait for it until its deadline, round after round
     * (its steps done, the others' not). */
    if (gg_stopped(gg, x)) {
      if (nfiltered) gg->st.late++;
      continue;
    }
    if (!widen && !x->deferred && gg_filtered_out(gg, me, x)) {
      if (nfiltered) (*nfiltered)++;
      continue;
    }
    if (!widen && !x->deferred && gg_not_due(gg, me, x)) {
      if (nfiltered) gg->st.late++;
      continue;
    }
    if (p) p[np] = r;
    np++;
  }
  return np;
}

static rpl_status generate_division(rpl_gg *gg, int w, int widen, rpl_error *err) {
  int *p = gg->scratch_a;
  int np = gg_division_participants(gg, w, widen, p, &gg->st.filtered);
  uint64_t division = ++gg->next_division;
  gg->st.divisions++;
  if (gg->trace) { /* a sorted copy: tracing must not change the draws */
    memcpy(gg->scratch_b, p, sizeof(int) * (size_t)np);
    rpl_sort_ints(gg->scratch_b, np);
    rpl_gg_trace t = {RPL_TRACE_DIVISION, 0, gg->scratch_b, np, RPL_PHASE_PLAIN, 0, w,
                      division};
    gg->trace(gg->trace_ctx, &t);
  }
  if (!gg->inter_intra) {
    shuffle(&gg->rng, p, np);
    return partition_create(gg, p, np, RPL_PHASE_PLAIN, 0, w, division, err);
  }
  /* Inter-Intra (paper 5.2): bucket participants by host (counting sort into scratch_b). */
  const rpl_layout *l = gg->layout;
  int nh = rpl_layout_hosts(l);
  int *cnt = gg->host_cnt, *by = gg->scratch_b;
  memset(cnt, 0, sizeof(int) * (size_t)(nh + 1));
  for (int i = 0; i < np; i++) cnt[rpl_layout_host(l, p[i]) + 1]++;
  for (int h = 0; h < nh; h++) cnt[h + 1] += cnt[h];
  for (int i = 0; i < np; i++) by[cnt[rpl_layout_host(l, p[i])]++] = p[i];
  for (int h = nh; h > 0; h--) cnt[h] = cnt[h - 1]; /* restore starts: host h = [cnt[h], cnt[h+1]) */
  cnt[0] = 0;
  int represented = 0;
  for (int h = 0; h < nh; h++) represented += cnt[h + 1] > cnt[h];
  rpl_status st = RPL_OK;
  if (represented >= 2) {
    /* One random head per represented host; heads grouped across hosts. p is reused for the
     * heads, which are moved to the front of each host's slice. */
    int nheads = 0;
    for (int h = 0; h < nh && st == RPL_OK; h++) {
      int lo = cnt[h], hi = cnt[h + 1];
      if (hi == lo) continue;
      int j = lo + (int)rpl_rng_below(&gg->rng, (uint32_t)(hi - lo));
      int t = by[lo];
      by[lo] = by[j];
      by[j] = t;
      p[nheads++] = by[lo];
    }
    shuffle(&gg->rng, p, nheads);
    st = partition_create(gg, p, nheads, RPL_PHASE_INTER, 1, w, division, err);
    for (int h = 0; h < nh && st == RPL_OK; h++) {
      int lo = cnt[h] + 1, hi = cnt[h + 1];
      /* A lone non-head would average with nobody: it waits for its Intra group instead. */
      if (hi - lo < 2) continue;
      shuffle(&gg->rng, by + lo, hi - lo);
      st = partition_create(gg, by + lo, hi - lo, RPL_PHASE_INTER, 0, w, division, err);
    }
  } else {
    shuffle(&gg->rng, by, np);
    st = partition_create(gg, by, np, RPL_PHASE_INTER, 0, w, division, err);
  }
  /* Intra groups of one are left out: their worker (a head, or the initiator alone) has its
   * Inter group already, and its next request starts a division instead of a no-op round. */
  for (int h = 0; h < nh && st == RPL_OK; h++) {
    int lo = cnt[h], hi = cnt[h + 1];
    if (hi - lo >= 2)
      st = gg_group_create(gg, by + lo, hi - lo, RPL_PHASE_INTRA, 0, 0, w, division, NULL, err);
  }
  return st;
}

rpl_status gg_request_static(rpl_gg *gg, int w, uint64_t round, rpl_error *err) {
  gg_worker *me = &gg->w[w];
  if (me->blen > 0) return gg_try_hand(gg, me->buf[0], err);
  int *m = gg->scratch_a, n = 0;
  uint64_t key = 0;
  rpl_status st = rpl_static_group(gg->layout, w, round, m, gg->n, &n, &key, err);
  if (st != RPL_OK) return st;
  int k = 0; /* members out of the schedule (fenced, left, dead) sit this round out */
  for (int i = 0; i < n; i++)
    if (m[i] == w || gg->w[m[i]].state == RPL_WORKER_LIVE) m[k++] = m[i];
  n = k;
  /* A member that asked for this round already holds the group. */
  for (int i = 0; i < n; i++) {
    const gg_worker *x = &gg->w[m[i]];
    if (m[i] != w && x->waiting && x->blen > 0 && x->buf[0]->key == key &&
        x->buf[0]->state == G_PENDING) {
      gg_group *g = x->buf[0];
      if (gg_buf_push(me, g) != 0) return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
      return gg_try_hand(gg, g, err);
    }
  }
  /* Only the requester gets it now; the others join when they ask for the same round. */
  gg_group *g = gg_group_new(gg, m, n, n, RPL_PHASE_STATIC, key);
  if (!g) return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  if (gg_buf_push(me, g) != 0) {
    free(g);
    return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  }
  gg_pend_append(gg, g);
  gg_trace_group(gg, RPL_TRACE_CREATED, g, w, 0);
  return gg_try_hand(gg, g, err);
}

rpl_status gg_generate(rpl_gg *gg, int w, int widen, rpl_error *err) {
  gg_undefer(gg, w);
  return gg->policy == RPL_POLICY_SMART ? generate_division(gg, w, widen, err)
                                        : generate_random(gg, w, err);
}
