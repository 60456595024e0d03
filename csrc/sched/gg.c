/*
 * The dynamic Group Generator: a state machine over plain structs, no I/O, no clock. This file:
 * the model below and the state machine itself (see "Files" at the end of this comment).
 *
 * Model (shared by every policy). One partial call of a worker is one round and one group.
 * Each worker has a Group Buffer: the groups it belongs to and has not yet received, in
 * generation order. A group is handed to its members all at once, when every member is
 * waiting (has an outstanding request) with that group at the head of its buffer and holds no
 * lock. Handing sets each member's lock (the paper's lock vector), released by its done.
 * Consequences, relied on by the tests:
 *   - every worker receives its groups in generation order (buffers are FIFO);
 *   - no worker is in two running groups (a lock is held from handing to done, and a member
 *     only asks again after its done);
 *   - no deadlock: the oldest pending group is at the head of all its members' buffers, so it
 *     is handed as soon as they all ask;
 *   - cancelling a group that has not been handed is always safe: nobody has started it.
 * Groups must stay groups (docs/design.md §3): a worker in a group of one averages with nobody, so
 * before generating for a requester whose buffer is empty the GG checks how many partners
 * it could get now. If fewer than group_size, and others are about to be available (busy in a
 * group, or still fenced in the exact collective the requester has just left -- not in one
 * entered since, which may be waiting for the requester; not one computing GG_OVERDUE of its
 * step without asking, which has stopped for now), the request is *deferred*: it
 * waits, at most partner_wait, while every event re-checks it (a worker finishing a group,
 * unfencing, asking). A deferred requester is idle and waiting, so others' divisions take it
 * in, past the slowdown filter (it makes nobody wait). The isolation bound: a worker that got
 * max_isolated groups of one in a row waits past its deadline, with the filters widened, until
 * it is in a group of two or more (it may join a pending group) -- unless no other worker is
 * about to come. None of this changes the model above: a deferred request has no group yet,
 * a joined group is still pending and at the head of the joiner's (empty) buffer.
 * Policies differ only in what they generate when a requester's buffer is empty:
 *   random  - one group: the requester plus group_size-1 live workers drawn uniformly. Drawn
 *             workers may be busy; the group then waits (a conflict, counted).
 *   adpsgd  - random with pairs.
 *   smart   - a Global Division: every idle live worker (empty buffer, no lock) that passes the
 *             slowdown filter is partitioned into groups of about group_size; the filter
 *             leaves w out if c_i - c_w >= c_thres, w is as far behind the bulk of the job,
 *             and (once steps are measured) w steps GG_SLOWER times slower than the bulk: a
 *             worker behind by chance is no straggler. With inter_intra, an Inter then an
 *             Intra group per participant (a group of one is left out: a no-op round).
 *             Beyond the paper, the arrival filter also leaves out idle workers not expected
 *             to ask within the partner wait: without it a straggler drawn while computing
 *             holds its group (at 4 workers and groups of 3, the whole job) at its pace, and
 *             the counters c never drift apart for the slowdown filter to see it.
 *   static  - the static schedule's group for the request's round (for simulation).
 * The adaptive period (not static) sits in front of all this: while the job is calm -- every
 * live worker's compute step measured, none computing for GG_OVERDUE of its expected steps --
 * a worker with nothing generated for it and nobody waiting for partners is answered PASS at
 * once, period_max - 1 times out of period_max, unless it is a straggler (its step over
 * GG_BEHIND of the bulk's: passed only when nobody is due to average with it, never twice in
 * a row; with speed_aware off a straggler makes the job not calm). The first worker due starts a group or division as above; the
 * others' next requests take their groups from their buffers, so the job averages together
 * every period_max steps; a member late for such a group by half an arrival window
 * passes it instead (gg_speed.c). A request that finds the job not calm sets the period to 1
 * before it is served.
 *
 * Files: this one holds the state machine (buffers, the pending list, creating, handing and
 * cancelling groups, the workers' events, introspection); gg_generate.c what each policy
 * generates; gg_speed.c the measured speeds and what they decide (the slowdown and arrival
 * filters, late members dropped, the adaptive period); gg_partners.c the wait for partners and
 * the isolation bound; gg_internal.h the state they share.
 */
#include "gg_internal.h"

const char *rpl_policy_name(rpl_policy p) {
  switch (p) {
    case RPL_POLICY_STATIC: return "static";
    case RPL_POLICY_RANDOM: return "random";
    case RPL_POLICY_SMART: return "smart";
    case RPL_POLICY_ADPSGD: return "adpsgd";
    default: return "?";
  }
}

rpl_status rpl_policy_parse(const char *name, rpl_policy *out, rpl_error *err) {
  for (int p = 0; p < RPL_POLICY_COUNT; p++) {
    if (name && strcmp(name, rpl_policy_name((rpl_policy)p)) == 0) {
      *out = (rpl_policy)p;
      return RPL_OK;
    }
  }
  return rpl_fail(err, RPL_ERR_INVALID,
                  "unknown schedule policy '%s' (static, random, smart, adpsgd)",
                  name ? name : "(null)");
}

const char *rpl_reason_name(rpl_reason r) {
  switch (r) {
    case RPL_REASON_NONE: return "none";
    case RPL_REASON_FENCED: return "fenced";
    case RPL_REASON_LEFT: return "left";
    case RPL_REASON_DEAD: return "dead";
    default: return "?";
  }
}

const char *rpl_worker_state_name(rpl_worker_state s) {
  switch (s) {
    case RPL_WORKER_LIVE: return "live";
    case RPL_WORKER_FENCED: return "fenced";
    case RPL_WORKER_LEFT: return "left";
    case RPL_WORKER_DEAD: return "dead";
    default: return "?";
  }
}

/* ---- small containers ------------------------------------------------------------------------ */

int gg_buf_push(gg_worker *w, gg_group *g) {
  if (w->blen == w->bcap) {
    int cap = w->bcap ? 2 * w->bcap : 4;
    gg_group **nb = realloc(w->buf, sizeof *nb * (size_t)cap);
    if (!nb) return -1;
    w->buf = nb;
    w->bcap = cap;
  }
  w->buf[w->blen++] = g;
  g->refs++;
  return 0;
}

/* Removes g from w's buffer; returns its former position or -1. */
int gg_buf_remove(gg_worker *w, gg_group *g) {
  for (int i = 0; i < w->blen; i++) {
    if (w->buf[i] == g) {
      memmove(w->buf + i, w->buf + i + 1, sizeof *w->buf * (size_t)(w->blen - i - 1));
      w->blen--;
      g->refs--;
      return i;
    }
  }
  return -1;
}

static void group_maybe_free(gg_group *g) {
  if (g->refs == 0 && g->state != G_PENDING) free(g);
}

static int ev_push(rpl_gg *gg, uint8_t kind, int worker, gg_group *g, uint64_t round,
                   int culprit, rpl_reason reason) {
  if (gg->ev_pos > 0 && gg->ev_pos == gg->ev_len) gg->ev_pos = gg->ev_len = 0;
  if (gg->ev_len == gg->ev_cap) {
    size_t cap = gg->ev_cap ? 2 * gg->ev_cap : 64;
    gg_event *ne = realloc(gg->ev, sizeof *ne * cap);
    if (!ne) return -1;
    gg->ev = ne;
    gg->ev_cap = cap;
  }
  gg_event *e = &gg->ev[gg->ev_len++];
  e->kind = kind;
  e->worker = worker;
  e->group = g;
  e->round = round;
  e->culprit = culprit;
  e->reason = (uint8_t)reason;
  e->period = gg->period;
  if (g) g->refs++; /* PASS has no group */
  return 0;
}

void gg_trace_group(rpl_gg *gg, rpl_trace_kind kind, const gg_group *g, int initiator,
                    uint64_t division) {
  if (!gg->trace) return;
  rpl_gg_trace t = {kind, g->id, g->members, g->n, (rpl_phase)g->phase, g->heads, initiator,
                    division};
  gg->trace(gg->trace_ctx, &t);
}

/* ---- lifecycle ------------------------------------------------------------------------------- */

rpl_status rpl_gg_create(const rpl_gg_config *cfg, rpl_gg **out, rpl_error *err) {
  *out = NULL;
  if (!cfg) return rpl_fail(err, RPL_ERR_INVALID, "gg: no config");
  if ((int)cfg->policy < 0 || cfg->policy >= RPL_POLICY_COUNT)
    return rpl_fail(err, RPL_ERR_INVALID, "gg: unknown policy %d", (int)cfg->policy);
  if (cfg->nworkers < 1 || cfg->nworkers > RPL_SCHED_MAX_WORKERS)
    return rpl_fail(err, RPL_ERR_INVALID, "gg: nworkers %d out of range [1, %d]",
                    cfg->nworkers, RPL_SCHED_MAX_WORKERS);
  if (cfg->group_size < 0 || cfg->group_size > RPL_SCHED_MAX_WORKERS)
    return rpl_fail(err, RPL_ERR_INVALID, "gg: group_size %d must be >= 1 (0 = default)",
                    cfg->group_size);
  if (cfg->period_max > RPL_GG_MAX_PERIOD)
    return rpl_fail(err, RPL_ERR_INVALID, "gg: period_max %d out of range (at most %d)",
                    cfg->period_max, RPL_GG_MAX_PERIOD);
  rpl_gg *gg = calloc(1, sizeof *gg);
  if (!gg) return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  gg->policy = cfg->policy;
  gg->n = cfg->nworkers;
  gg->group_size = cfg->group_size ? cfg->group_size : RPL_GG_DEFAULT_GROUP_SIZE;
  if (gg->policy == RPL_POLICY_ADPSGD) gg->group_size = 2;
  gg->c_thres = cfg->c_thres ? cfg->c_thres : RPL_GG_DEFAULT_C_THRES;
  gg->inter_intra = cfg->inter_intra ? 1 : 0;
  gg->partner_wait = cfg->partner_wait_ms < 0 ? -1.0 : cfg->partner_wait_ms / 1000.0;
  gg->max_isolated = cfg->max_isolated ? cfg->max_isolated : RPL_GG_DEFAULT_MAX_ISOLATED;
  gg->arrival_filter = cfg->arrival_filter >= 0;
  gg->speed_aware = cfg->speed_aware >= 0;
  gg->period_max = cfg->period_max == 0 ? RPL_GG_DEFAULT_PERIOD_MAX
                   : cfg->period_max < 1 ? 1 : cfg->period_max;
  if (gg->policy == RPL_POLICY_STATIC) gg->period_max = 1; /* a fixed schedule, no coordinator */
  gg->period = 1;
  gg->st.period = 1;
  gg->rng = cfg->seed ^ 0x5851f42d4c957f2dull;
  gg->trace = cfg->trace;
  gg->trace_ctx = cfg->trace_ctx;
  gg->next_id = 1;
  gg->nlive = gg->n;
  rpl_status st = rpl_layout_create(gg->n, cfg->host_of, &gg->layout, err);
  if (st != RPL_OK) {
    free(gg);
    return st;
  }
  gg->w = calloc((size_t)gg->n, sizeof *gg->w);
  gg->scratch_a = malloc(sizeof(int) * (size_t)gg->n);
  gg->scratch_b = malloc(sizeof(int) * (size_t)gg->n);
  gg->scratch_c = malloc(sizeof(double) * (size_t)gg->n);
  gg->c_dirty = 1;
  gg->host_cnt = calloc((size_t)rpl_layout_hosts(gg->layout) + 1, sizeof(int));
  gg->dq = malloc(sizeof(int) * (size_t)gg->n);
  st = rpl_whatif_create(gg->n, &gg->whatif, err);
  if (st != RPL_OK) {
    rpl_gg_destroy(gg);
    return st;
  }
  if (!gg->w || !gg->scratch_a || !gg->scratch_b || !gg->scratch_c || !gg->host_cnt || !gg->dq) {
    rpl_gg_destroy(gg);
    return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  }
  for (int i = 0; i < gg->n; i++)
    gg->w[i].handed_at = gg->w[i].unfenced_at = gg->w[i].free_at = -1.0;
  gg->first_request_at = -1.0;
  *out = gg;
  return RPL_OK;
}

void rpl_gg_destroy(rpl_gg *gg) {
  if (!gg) return;
  /* Every group is reachable from the pending list, a buffer or an event: drop all refs. */
  for (size_t i = gg->ev_pos; i < gg->ev_len; i++) {
    gg_group *g = gg->ev[i].group;
    if (!g) continue; /* PASS */
    g->refs--;
    group_maybe_free(g);
  }
  while (gg->pend_head) {
    gg_group *g = gg->pend_head;
    gg->pend_head = g->next;
    g->state = G_CANCELLED;
    g->prev = g->next = NULL;
  }
  if (gg->w) {
    for (int i = 0; i < gg->n; i++) {
      gg_worker *w = &gg->w[i];
      for (int k = 0; k < w->blen; k++) {
        w->buf[k]->refs--;
        group_maybe_free(w->buf[k]);
      }
      free(w->buf);
    }
  }
  free(gg->w);
  free(gg->ev);
  rpl_whatif_destroy(gg->whatif);
  free(gg->scratch_a);
  free(gg->scratch_b);
  free(gg->scratch_c);
  free(gg->host_cnt);
  free(gg->dq);
  rpl_layout_destroy(gg->layout);
  free(gg);
}

/* ---- groups ---------------------------------------------------------------------------------- */

static void pend_unlink(rpl_gg *gg, gg_group *g) {
  if (g->prev) g->prev->next = g->next;
  else gg->pend_head = g->next;
  if (g->next) g->next->prev = g->prev;
  else gg->pend_tail = g->prev;
  g->prev = g->next = NULL;
  gg->st.pending--;
}

void gg_undefer(rpl_gg *gg, int w) {
  gg_worker *x = &gg->w[w];
  if (!x->deferred) return;
  x->deferred = 0;
  x->held = 0;
  for (int i = 0; i < gg->dq_len; i++) {
    if (gg->dq[i] == w) {
      memmove(gg->dq + i, gg->dq + i + 1, sizeof *gg->dq * (size_t)(gg->dq_len - i - 1));
      gg->dq_len--;
      break;
    }
  }
}

gg_group *gg_group_new(rpl_gg *gg, const int *members, int n, int cap, rpl_phase phase,
                       uint64_t key) {
  gg_group *g = calloc(1, sizeof *g + sizeof(int) * (size_t)cap);
  if (!g) return NULL;
  g->id = gg->next_id++;
  g->key = key;
  g->n = n;
  g->cap = cap;
  g->phase = (uint8_t)phase;
  g->deadline = -1.0;
  memcpy(g->members, members, sizeof(int) * (size_t)n);
  return g;
}

void gg_pend_append(rpl_gg *gg, gg_group *g) {
  g->prev = gg->pend_tail;
  if (gg->pend_tail) gg->pend_tail->next = g;
  else gg->pend_head = g;
  gg->pend_tail = g;
  gg->st.pending++;
  gg->st.groups_created++;
}

/* Creates a group from members[0..n) (any order; sorted here), appends it to every member's
 * buffer and the pending list. */
rpl_status gg_group_create(rpl_gg *gg, const int *members, int n, rpl_phase phase,
                           int heads, uint64_t key, int initiator, uint64_t division,
                           gg_group **out, rpl_error *err) {
  int cap = n > 2 * gg->group_size ? n : 2 * gg->group_size; /* room for isolated joiners */
  gg_group *g = gg_group_new(gg, members, n, cap, phase, key);
  if (!g) return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  g->heads = (uint8_t)heads;
  g->evictable = gg->policy == RPL_POLICY_SMART && gg->speed_aware && gg->arrival_filter && n > 2;
  rpl_sort_ints(g->members, n);
  int conflict = 0;
  for (int i = 0; i < n; i++) {
    gg_worker *w = &gg->w[g->members[i]];
    /* A conflict: a drawn member already has groups to serve. Divisions draw idle workers
     * only (their second, Intra group follows the Inter group by design, not a conflict). */
    if (division == 0 && g->members[i] != initiator && !worker_idle(w)) conflict = 1;
    if (gg_buf_push(w, g) != 0) {
      for (int k = 0; k < i; k++) gg_buf_remove(&gg->w[g->members[k]], g);
      free(g);
      return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
    }
  }
  gg_pend_append(gg, g);
  if (conflict) gg->st.conflicts++;
  for (int i = 0; i < n; i++) {
    if (arrived_for(&gg->w[g->members[i]], g)) gg_arm_deadline(gg, g);
    gg_undefer(gg, g->members[i]); /* a waiting member has its group */
  }
  gg_trace_group(gg, RPL_TRACE_CREATED, g, initiator, division);
  if (out) *out = g;
  /* Deferred members are waiting already: the group may be complete at once. */
  return gg_try_hand(gg, g, err);
}

/* Hands g to all members if each is waiting with g first in its buffer and unlocked. */
rpl_status gg_try_hand(rpl_gg *gg, gg_group *g, rpl_error *err) {
  if (!g || g->state != G_PENDING) return RPL_OK;
  for (int i = 0; i < g->n; i++) {
    const gg_worker *w = &gg->w[g->members[i]];
    if (!w->waiting || w->blen == 0 || w->buf[0] != g || w->locked) return RPL_OK;
  }
  g->state = G_HANDED;
  pend_unlink(gg, g);
  for (int i = 0; i < g->n; i++) {
    gg_worker *w = &gg->w[g->members[i]];
    gg_buf_remove(w, g);
    w->waiting = 0;
    w->locked = g->id;
    w->handed++;
    w->handed_at = gg->now;
    if (g->n == 1) {
      w->singletons++;
      if (++w->lonely > w->lonely_max) w->lonely_max = w->lonely;
    } else {
      w->lonely = 0;
      w->since = 0;
      w->missed_last = 0;
    }
    if (ev_push(gg, RPL_EV_GROUP, g->members[i], g, w->waiting_round, -1, RPL_REASON_NONE) != 0)
      return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  }
  gg->st.groups_handed++;
  if (g->n == 1) gg->st.singletons_handed++;
  gg_trace_group(gg, RPL_TRACE_HANDED, g, -1, 0);
  group_maybe_free(g);
  return RPL_OK;
}

static rpl_status group_cancel(rpl_gg *gg, gg_group *g, int culprit, rpl_reason reason,
                               rpl_error *err) {
  rpl_status st = RPL_OK;
  g->state = G_CANCELLED;
  pend_unlink(gg, g);
  g->refs++; /* keep g alive while members let go */
  for (int i = 0; i < g->n; i++) {
    int m = g->members[i];
    gg_worker *w = &gg->w[m];
    int pos = gg_buf_remove(w, g);
    if (pos == 0 && w->waiting) {
      w->waiting = 0;
      if (m != culprit) {
        w->cancels++;
        if (ev_push(gg, RPL_EV_CANCEL, m, g, w->waiting_round, culprit, reason) != 0)
          st = rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
      }
    }
  }
  gg->st.groups_cancelled++;
  gg_trace_group(gg, RPL_TRACE_CANCELLED, g, culprit, 0);
  g->refs--;
  group_maybe_free(g);
  return st;
}

/* ---- workers' events ------------------------------------------------------------------------- */

static rpl_status check_worker(const rpl_gg *gg, int w, const char *what, rpl_error *err) {
  if (w < 0 || w >= gg->n)
    return rpl_fail(err, RPL_ERR_INVALID, "gg %s: worker %d out of range [0, %d)", what,
                    w, gg->n);
  return RPL_OK;
}

/* check_worker, and w has not left the job (RPL_ERR_CLOSED): what may bring it back in. */
static rpl_status check_not_left(const rpl_gg *gg, int w, const char *what, rpl_error *err) {
  rpl_status st = check_worker(gg, w, what, err);
  if (st == RPL_OK && gg->w[w].state == RPL_WORKER_LEFT)
    return rpl_fail(err, RPL_ERR_CLOSED, "gg %s: worker %d has left the job", what, w);
  return st;
}

static int gone(uint8_t s) { return s == RPL_WORKER_LEFT || s == RPL_WORKER_DEAD; }

static void set_state(rpl_gg *gg, gg_worker *w, rpl_worker_state s) {
  if (w->state == RPL_WORKER_LIVE && s != RPL_WORKER_LIVE) gg->nlive--;
  if (w->state != RPL_WORKER_LIVE && s == RPL_WORKER_LIVE) gg->nlive++;
  gg->ngone += gone((uint8_t)s) - gone(w->state);
  if (gone((uint8_t)s) != gone(w->state))
    rpl_whatif_out(gg->whatif, (int)(w - gg->w), gone((uint8_t)s));
  w->state = (uint8_t)s;
  gg->c_dirty = 1; /* the bulk's median is over the workers not gone */
}

/* Every event may change who is available to the deferred requests: re-check them; and a
 * request may be the second arrival of a group past its deadline. */
static rpl_status settle(rpl_gg *gg, rpl_status st, rpl_error *err) {
  if (st == RPL_OK && gg->speed_aware) st = gg_evict_late(gg, err);
  if (st != RPL_OK || gg->dq_len == 0) return st;
  return gg_serve_deferred(gg, err);
}

rpl_status rpl_gg_request(rpl_gg *gg, int w, uint64_t round, rpl_error *err) {
  rpl_status st = check_not_left(gg, w, "request", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  if (gg->first_request_at < 0) gg->first_request_at = gg->now;
  if (me->state == RPL_WORKER_FENCED) me->unfenced_at = gg->now;
  if (me->state != RPL_WORKER_LIVE) set_state(gg, me, RPL_WORKER_LIVE);
  if (me->waiting && me->waiting_round == round) return RPL_OK; /* a repeat */
  me->late = 0;
  if (me->locked) {
    me->locked = 0; /* asking again means the previous group is over */
    gg->st.implicit_dones++;
  }
  if (!me->counted || me->last_round != round) {
    me->c++;
    gg->c_dirty = 1;
    me->counted = 1;
    me->last_round = round;
    gg->st.requests++;
    /* The partner wait's time scale: steps measured from the group handed to the next request,
     * so that time spent waiting in the GG does not feed back into the wait. */
    if (me->handed_at >= 0 && gg->now > me->handed_at) {
      double dt = gg->now - me->handed_at;
      gg->interval = gg->interval > 0 ? gg->interval + (dt - gg->interval) / 16 : dt;
      me->iv = me->iv > 0 ? me->iv + (dt - me->iv) / 4 : dt;
      me->pace = me->pace > 0 ? me->pace + (dt - me->pace) / 16 : dt;
    }
    if (me->free_at >= 0 && me->free_at >= me->handed_at && gg->now >= me->free_at) {
      double dt = gg->now - me->free_at;
      /* Up fast, down slowly: a straggler's first slow step counts at once (5x: 2.3x the
       * bulk), while a single noisy step of 2-3x moves the average less than GG_BEHIND. */
      double weight = dt > me->comp ? 1.0 / 3 : 1.0 / 8;
      me->comp = me->comp > 0 ? me->comp + (dt - me->comp) * weight : dt;
      rpl_whatif_step(gg->whatif, w, dt, gg->now);
    }
  }
  if (gg->policy == RPL_POLICY_STATIC) {
    me->waiting = 1;
    me->waiting_round = round;
    return gg_request_static(gg, w, round, err);
  }
  if (gg_period_pass(gg, me)) {
    me->passes++;
    me->handed_at = me->free_at = gg->now; /* its steps are measured from this answer */
    gg->st.passes++;
    if (ev_push(gg, RPL_EV_PASS, w, NULL, round, -1, RPL_REASON_NONE) != 0)
      return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
    return RPL_OK; /* w stays idle and is not waiting: nobody's availability changed */
  }
  me->waiting = 1;
  me->waiting_round = round;
  if (me->blen > 0 && !me->locked) gg_arm_deadline(gg, me->buf[0]);
  st = me->blen == 0 ? gg_serve(gg, w, err) : gg_try_hand(gg, me->buf[0], err);
  return settle(gg, st, err);
}

rpl_status rpl_gg_done(rpl_gg *gg, int w, uint64_t group_id, rpl_error *err) {
  rpl_status st = check_worker(gg, w, "done", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  if (me->locked && me->locked == group_id) {
    me->locked = 0;
    me->free_at = gg->now;
    if (me->waiting && me->blen > 0) {
      gg_arm_deadline(gg, me->buf[0]);
      st = gg_try_hand(gg, me->buf[0], err);
    }
    return settle(gg, st, err); /* it may be idle now: a partner for the deferred */
  }
  gg->st.stale_dones++;
  return RPL_OK;
}

/* Cancels every pending group containing w. */
static rpl_status remove_from_schedule(rpl_gg *gg, int w, rpl_reason reason, rpl_error *err) {
  rpl_status st = RPL_OK;
  gg_group *g = gg->pend_head;
  while (g) {
    gg_group *next = g->next;
    if (group_has(g, w)) {
      rpl_status s2 = group_cancel(gg, g, w, reason, err);
      if (s2 != RPL_OK) st = s2;
    }
    g = next;
  }
  gg->w[w].waiting = 0;
  gg_undefer(gg, w);
  return settle(gg, st, err); /* a partner less: some deferred may stop waiting */
}

rpl_status rpl_gg_fence(rpl_gg *gg, int w, rpl_error *err) {
  rpl_status st = check_not_left(gg, w, "fence", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  if (me->state != RPL_WORKER_FENCED) me->fenced_at = gg->now;
  me->free_at = -1.0; /* an exact collective is no compute step */
  set_state(gg, me, RPL_WORKER_FENCED);
  return remove_from_schedule(gg, w, RPL_REASON_FENCED, err);
}

rpl_status rpl_gg_unfence(rpl_gg *gg, int w, rpl_error *err) {
  rpl_status st = check_not_left(gg, w, "unfence", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  if (me->state == RPL_WORKER_FENCED) {
    me->unfenced_at = gg->now;
    set_state(gg, me, RPL_WORKER_LIVE);
  }
  return settle(gg, RPL_OK, err); /* back in: a partner for the deferred */
}

rpl_status rpl_gg_leave(rpl_gg *gg, int w, rpl_error *err) {
  rpl_status st = check_worker(gg, w, "leave", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  set_state(gg, me, RPL_WORKER_LEFT);
  me->locked = 0;
  return remove_from_schedule(gg, w, RPL_REASON_LEFT, err);
}

rpl_status rpl_gg_dead(rpl_gg *gg, int w, rpl_error *err) {
  rpl_status st = check_worker(gg, w, "dead", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  if (me->state == RPL_WORKER_LEFT) return RPL_OK; /* gone already */
  set_state(gg, me, RPL_WORKER_DEAD);
  me->locked = 0;
  return remove_from_schedule(gg, w, RPL_REASON_DEAD, err);
}

int rpl_gg_poll(rpl_gg *gg, rpl_gg_event *ev, int *members, int cap) {
  if (gg->ev_pos >= gg->ev_len) return 0;
  gg_event *e = &gg->ev[gg->ev_pos++];
  gg_group *g = e->group;
  memset(ev, 0, sizeof *ev);
  ev->kind = (rpl_event_kind)e->kind;
  ev->worker = e->worker;
  ev->round = e->round;
  ev->culprit = e->culprit;
  ev->reason = (rpl_reason)e->reason;
  ev->period = e->period;
  if (!g) return 1; /* PASS */
  ev->group_id = g->id;
  if (e->kind == RPL_EV_GROUP) {
    ev->nmembers = g->n;
    int k = g->n < cap ? g->n : cap;
    if (members && k > 0) memcpy(members, g->members, sizeof(int) * (size_t)k);
  }
  g->refs--;
  group_maybe_free(g);
  return 1;
}

/* ---- introspection --------------------------------------------------------------------------- */

rpl_status rpl_gg_worker(const rpl_gg *gg, int w, rpl_gg_worker_info *out, rpl_error *err) {
  rpl_status st = check_worker(gg, w, "worker", err);
  if (st != RPL_OK) return st;
  const gg_worker *x = &gg->w[w];
  out->state = (rpl_worker_state)x->state;
  out->host = rpl_layout_host(gg->layout, w);
  out->requests = x->c;
  out->waiting = x->waiting;
  out->waiting_round = x->waiting_round;
  out->buffered = x->blen;
  out->head_group = x->blen ? x->buf[0]->id : 0;
  out->locked_group = x->locked;
  out->handed = x->handed;
  out->cancels = x->cancels;
  out->singletons = x->singletons;
  out->lonely = x->lonely;
  out->lonely_max = x->lonely_max;
  out->deferred = x->deferred;
  out->passes = x->passes;
  out->step = x->comp;
  return RPL_OK;
}

void rpl_gg_get_stats(const rpl_gg *gg, rpl_gg_stats *out) { *out = gg->st; }
rpl_policy rpl_gg_policy(const rpl_gg *gg) { return gg->policy; }
int rpl_gg_workers(const rpl_gg *gg) { return gg->n; }
int rpl_gg_group_size(const rpl_gg *gg) { return gg->group_size; }
int rpl_gg_c_thres(const rpl_gg *gg) { return gg->c_thres; }
int rpl_gg_inter_intra(const rpl_gg *gg) { return gg->inter_intra; }
int rpl_gg_period_max(const rpl_gg *gg) { return gg->period_max; }
const rpl_layout *rpl_gg_layout(const rpl_gg *gg) { return gg->layout; }
const rpl_whatif *rpl_gg_whatif(const rpl_gg *gg) { return gg->whatif; }

void rpl_gg_foreach_pending(const rpl_gg *gg,
                            int (*fn)(void *ctx, uint64_t group_id, const int *members, int n,
                                      int arrived),
                            void *ctx) {
  for (const gg_group *g = gg->pend_head; g; g = g->next) {
    int arrived = 0;
    for (int i = 0; i < g->n; i++) {
      const gg_worker *x = &gg->w[g->members[i]];
      arrived += x->waiting && x->blen > 0 && x->buf[0] == g;
    }
    if (fn(ctx, g->id, g->members, g->n, arrived)) return;
  }
}
