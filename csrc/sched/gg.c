/*
 * The dynamic Group Generator: a state machine over plain structs, no I/O, no clock.
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
 * Groups must stay groups (DESIGN 3): a worker in a group of one averages with nobody, so
 * before generating for a requester whose buffer is empty the GG checks how many partners
 * it could get now. If fewer than group_size, and others are about to be available (busy in a
 * group, or still fenced in the exact collective the requester has just left -- not in one
 * entered since, which may be waiting for the requester), the request is *deferred*: it
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
 * live worker's compute step measured and within GG_BEHIND of the bulk's, none computing for
 * GG_OVERDUE bulk steps -- a worker with nothing generated for it and nobody waiting
 * for partners is answered PASS at once, period_max - 1 times out of period_max. The first
 * worker due starts a group or division as above; the others' next requests take their
 * groups from their buffers, so the job averages together every period_max steps. A request
 * that finds the job not calm sets the period to 1 before it is served.
 */
#include <stdlib.h>
#include <string.h>

#include "sched_internal.h"

enum { G_PENDING = 0, G_HANDED = 1, G_CANCELLED = 2 };

/* The slowdown filter takes a worker behind for a straggler only if its measured step is this
 * many times the bulk's (chance drift is a few percent; a straggler is slower by its factor). */
#define GG_SLOWER 1.5
/* The adaptive period counts a worker as falling behind once its compute step is GG_BEHIND
 * times the bulk's, or it has computed GG_OVERDUE of the bulk's steps without asking (a 5x
 * straggler is seen four steps into its slow one). Looser than the slowdown filter: steps of a
 * few milliseconds on loaded cores vary by 2x from step to step (measured: 4 workers on 2
 * cores, 5 ms steps), and every false alarm costs period_max steps of averaging. */
#define GG_BEHIND 2.0
#define GG_OVERDUE 4.0
/* Speed-aware admission (smart): a division admits an idle, computing worker only if it is
 * expected to ask within the arrival window -- GG_WINDOW_STEP of the bulk's compute step plus
 * GG_WINDOW_SPREAD median deviations of the workers' steps, never more than one bulk step. The
 * window is the fast workers' own: a straggler computing is never waited for; it joins a group
 * once it is ready (waiting), which makes nobody wait. */
#define GG_WINDOW_STEP 0.5
#define GG_WINDOW_SPREAD 2.0
/* A pending smart group whose members have not all asked by this many arrival windows after it
 * was generated (or the partner wait, if longer) drops its late members, as long as two of its
 * members are waiting: an arrival predicted wrongly (a worker slowed just now) costs the fast
 * members a bounded wait, not the straggler's step. */
#define GG_EVICT_WINDOWS 2.0

typedef struct gg_group {
  uint64_t id;
  uint64_t key;                /* static: the schedule's group id for matching; else 0 */
  int n;
  int cap;                     /* room in members[] (isolated workers may join) */
  int refs;                    /* buffer entries + queued events */
  uint8_t state;
  uint8_t phase;
  uint8_t heads;
  uint8_t evictable;           /* smart, speed_aware, 3+ members: late members may be dropped */
  double deadline;             /* ... after this, armed when its first member is ready (< 0) */
  struct gg_group *prev, *next; /* pending list, generation order */
  int members[];               /* sorted */
} gg_group;

typedef struct gg_worker {
  uint8_t state;               /* rpl_worker_state */
  uint8_t waiting;
  uint8_t counted;             /* has made a counted request (last_round valid) */
  uint64_t waiting_round;
  uint64_t last_round;
  uint64_t c;                  /* requests counted, the slowdown filter's c_w */
  uint64_t locked;
  uint64_t handed;
  uint64_t cancels;
  uint64_t singletons;
  uint32_t lonely, lonely_max; /* groups of one in a row; the longest such run */
  uint8_t deferred;            /* waiting for partners: no group generated yet */
  uint8_t held;                /* ... and past its wait, held by the isolation bound */
  double deadline;             /* when the deferral (or the hold) ends */
  double handed_at;            /* clock when its last group was handed, < 0 before */
  double fenced_at;            /* clock when it last fenced */
  double unfenced_at;          /* clock when it last came out of a fence, < 0 before */
  double iv;                   /* EWMA of its step: group handed -> next request, 0 = unknown */
  double pace;                 /* the same, averaged longer (the slowdown filter's speed) */
  uint32_t since;              /* requests passed since its last group of two or more */
  double free_at;              /* clock when it last left the GG (done, pass), < 0 unknown */
  double comp;                 /* EWMA of free_at -> next request: its compute alone, 0 = unknown */
  uint8_t late;                /* dropped from a group for lateness: admitted again only once
                                  it asks (speed_aware) */
  uint64_t passes;
  gg_group **buf;
  int blen, bcap;
} gg_worker;

typedef struct gg_event {
  uint8_t kind;
  uint8_t reason;
  int worker;
  int culprit;
  int period;                  /* GROUP, PASS: the period when it was answered */
  uint64_t round;
  gg_group *group;
} gg_event;

struct rpl_gg {
  rpl_policy policy;
  int n;
  int group_size;
  int c_thres;                 /* negative = off */
  int inter_intra;
  double partner_wait;         /* seconds; 0 = adaptive, negative = never wait */
  int max_isolated;            /* negative = no bound */
  int arrival_filter;
  int speed_aware;             /* smart: the arrival window and late members dropped (below) */
  int period_max;              /* 1 = no adaptive period */
  int period;                  /* the adaptive period now */
  int calm;                    /* requests in a row that found the job calm */
  double now;                  /* the clock (rpl_gg_advance) */
  double interval;             /* EWMA of intervals between requests, 0 = unknown */
  int *dq, dq_len;             /* deferred workers, in order of deferral [n] */
  int ngone;                   /* workers left or dead */
  uint64_t rng;
  rpl_layout *layout;
  gg_worker *w;
  int nlive;
  uint64_t next_id;
  uint64_t next_division;
  gg_group *pend_head, *pend_tail;
  gg_event *ev;
  size_t ev_len, ev_cap, ev_pos;
  int *scratch_a, *scratch_b;  /* [n] */
  uint64_t *scratch_c;         /* [n], for bulk_refresh */
  uint64_t c_med;              /* the bulk's count and step (bulk_refresh) while !c_dirty */
  double pace_med;
  double comp_med, comp_mad;   /* median compute step of the live workers and its median
                                  absolute deviation, 0 = unknown (bulk_refresh) */
  double iv_med;               /* median step from a group handed to the next request */
  int c_dirty;
  int *host_cnt;               /* [hosts + 1] */
  rpl_gg_stats st;
  void (*trace)(void *ctx, const rpl_gg_trace *t);
  void *trace_ctx;
};

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

/* ---- small containers ------------------------------------------------------------------- */

static int buf_push(gg_worker *w, gg_group *g) {
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
static int buf_remove(gg_worker *w, gg_group *g) {
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

static int group_has(const gg_group *g, int w) {
  int lo = 0, hi = g->n - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    if (g->members[mid] == w) return 1;
    if (g->members[mid] < w) lo = mid + 1;
    else hi = mid - 1;
  }
  return 0;
}

static void trace_group(rpl_gg *gg, rpl_trace_kind kind, const gg_group *g, int initiator,
                        uint64_t division) {
  if (!gg->trace) return;
  rpl_gg_trace t = {kind, g->id, g->members, g->n, (rpl_phase)g->phase, g->heads, initiator,
                    division};
  gg->trace(gg->trace_ctx, &t);
}

/* ---- lifecycle ------------------------------------------------------------------------- */

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
  gg->scratch_c = malloc(sizeof(uint64_t) * (size_t)gg->n);
  gg->c_dirty = 1;
  gg->host_cnt = calloc((size_t)rpl_layout_hosts(gg->layout) + 1, sizeof(int));
  gg->dq = malloc(sizeof(int) * (size_t)gg->n);
  if (!gg->w || !gg->scratch_a || !gg->scratch_b || !gg->scratch_c || !gg->host_cnt || !gg->dq) {
    rpl_gg_destroy(gg);
    return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  }
  for (int i = 0; i < gg->n; i++)
    gg->w[i].handed_at = gg->w[i].unfenced_at = gg->w[i].free_at = -1.0;
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
  free(gg->scratch_a);
  free(gg->scratch_b);
  free(gg->scratch_c);
  free(gg->host_cnt);
  free(gg->dq);
  rpl_layout_destroy(gg->layout);
  free(gg);
}

/* ---- groups -------------------------------------------------------------------------------- */

static void pend_unlink(rpl_gg *gg, gg_group *g) {
  if (g->prev) g->prev->next = g->next;
  else gg->pend_head = g->next;
  if (g->next) g->next->prev = g->prev;
  else gg->pend_tail = g->prev;
  g->prev = g->next = NULL;
  gg->st.pending--;
}

static int worker_idle(const gg_worker *w) { return w->blen == 0 && w->locked == 0; }

static void undefer(rpl_gg *gg, int w) {
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

static rpl_status try_hand(rpl_gg *gg, gg_group *g, rpl_error *err);
static double arrival_window(rpl_gg *gg);
static double partner_wait(rpl_gg *gg);
static int arrived_for(const gg_worker *x, const gg_group *g);
static void arm_deadline(rpl_gg *gg, gg_group *g);

/* Creates a group from members[0..n) (any order; sorted here), appends it to every member's
 * buffer and the pending list. */
static rpl_status group_create(rpl_gg *gg, const int *members, int n, rpl_phase phase,
                               int heads, uint64_t key, int initiator, uint64_t division,
                               gg_group **out, rpl_error *err) {
  int cap = n > 2 * gg->group_size ? n : 2 * gg->group_size; /* room for isolated joiners */
  gg_group *g = calloc(1, sizeof *g + sizeof(int) * (size_t)cap);
  if (!g) return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  g->id = gg->next_id++;
  g->key = key;
  g->n = n;
  g->cap = cap;
  g->phase = (uint8_t)phase;
  g->heads = (uint8_t)heads;
  g->deadline = -1.0;
  g->evictable = gg->policy == RPL_POLICY_SMART && gg->speed_aware && gg->arrival_filter && n > 2;
  memcpy(g->members, members, sizeof(int) * (size_t)n);
  rpl_sort_ints(g->members, n);
  int conflict = 0;
  for (int i = 0; i < n; i++) {
    gg_worker *w = &gg->w[g->members[i]];
    /* A conflict: a drawn member already has groups to serve. Divisions draw idle workers
     * only (their second, Intra group follows the Inter group by design, not a conflict). */
    if (division == 0 && g->members[i] != initiator && !worker_idle(w)) conflict = 1;
    if (buf_push(w, g) != 0) {
      for (int k = 0; k < i; k++) buf_remove(&gg->w[g->members[k]], g);
      free(g);
      return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
    }
  }
  g->prev = gg->pend_tail;
  if (gg->pend_tail) gg->pend_tail->next = g;
  else gg->pend_head = g;
  gg->pend_tail = g;
  gg->st.pending++;
  gg->st.groups_created++;
  if (conflict) gg->st.conflicts++;
  for (int i = 0; i < n; i++) {
    if (arrived_for(&gg->w[g->members[i]], g)) arm_deadline(gg, g);
    undefer(gg, g->members[i]); /* a waiting member has its group */
  }
  trace_group(gg, RPL_TRACE_CREATED, g, initiator, division);
  if (out) *out = g;
  /* Deferred members are waiting already: the group may be complete at once. */
  return try_hand(gg, g, err);
}

/* Hands g to all members if each is waiting with g first in its buffer and unlocked. */
static rpl_status try_hand(rpl_gg *gg, gg_group *g, rpl_error *err) {
  if (!g || g->state != G_PENDING) return RPL_OK;
  for (int i = 0; i < g->n; i++) {
    const gg_worker *w = &gg->w[g->members[i]];
    if (!w->waiting || w->blen == 0 || w->buf[0] != g || w->locked) return RPL_OK;
  }
  g->state = G_HANDED;
  pend_unlink(gg, g);
  for (int i = 0; i < g->n; i++) {
    gg_worker *w = &gg->w[g->members[i]];
    buf_remove(w, g);
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
    }
    if (ev_push(gg, RPL_EV_GROUP, g->members[i], g, w->waiting_round, -1, RPL_REASON_NONE) != 0)
      return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  }
  gg->st.groups_handed++;
  if (g->n == 1) gg->st.singletons_handed++;
  trace_group(gg, RPL_TRACE_HANDED, g, -1, 0);
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
    int pos = buf_remove(w, g);
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
  trace_group(gg, RPL_TRACE_CANCELLED, g, culprit, 0);
  g->refs--;
  group_maybe_free(g);
  return st;
}

/* Whether member x of g is waiting with g at the head of its buffer, unlocked: ready to go. */
static int arrived_for(const gg_worker *x, const gg_group *g) {
  return x->waiting && x->blen > 0 && x->buf[0] == g && !x->locked;
}

/* The first member ready for g starts its clock: the others get two arrival windows (or the
 * partner wait, if longer) to come. Measured from the first arrival, not from generation: a
 * division's second group (inter_intra's Intra) waits for its members' first ones. */
static void arm_deadline(rpl_gg *gg, gg_group *g) {
  if (!g || !g->evictable || g->deadline >= 0 || g->state != G_PENDING) return;
  double window = arrival_window(gg), wait = partner_wait(gg);
  if (window <= 0) return; /* no compute step measured yet: no prediction to have failed */
  g->deadline = gg->now + (GG_EVICT_WINDOWS * window > wait ? GG_EVICT_WINDOWS * window : wait);
}

/* Smart groups past their deadline drop the members that have not asked, if two or more have:
 * the admission predicted their arrivals within the arrival window, and a prediction that
 * failed (a worker slowed just now) must cost the others a bounded wait. A group with fewer
 * than two members waiting keeps everyone (dropping would leave a group of one). The dropped
 * members' buffers lose the group and nothing else, so every order still holds; they are served
 * afresh when they ask. */
static rpl_status evict_late(rpl_gg *gg, rpl_error *err) {
  rpl_status st = RPL_OK;
  gg_group *g = gg->pend_head;
  while (g && st == RPL_OK) {
    gg_group *next = g->next;
    if (g->deadline >= 0 && g->deadline <= gg->now) {
      int arrived = 0;
      for (int i = 0; i < g->n; i++) arrived += arrived_for(&gg->w[g->members[i]], g);
      if (arrived >= 2 && arrived < g->n) {
        int k = 0;
        for (int i = 0; i < g->n; i++) {
          int m = g->members[i];
          if (arrived_for(&gg->w[m], g)) {
            g->members[k++] = m;
          } else {
            buf_remove(&gg->w[m], g);
            gg->w[m].late = 1;
            gg->st.late_dropped++;
          }
        }
        g->n = k; /* still sorted */
        g->deadline = -1.0;
        trace_group(gg, RPL_TRACE_DROPPED, g, -1, 0);
        st = try_hand(gg, g, err); /* every member left is waiting: handed now */
      }
    }
    g = next;
  }
  return st;
}

/* ---- generation ----------------------------------------------------------------------------- */

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
 * most one, and creates them. */
static rpl_status partition_create(rpl_gg *gg, int *a, int n, rpl_phase phase, int heads,
                                   int initiator, uint64_t division, rpl_error *err) {
  if (n <= 0) return RPL_OK;
  int g = gg->group_size;
  int k = (n + g / 2) / g;
  if (k < 1) k = 1;
  for (int i = 0; i < k; i++) {
    int lo = (int)((int64_t)i * n / k), hi = (int)((int64_t)(i + 1) * n / k);
    rpl_status st = group_create(gg, a + lo, hi - lo, phase, heads, 0, initiator, division,
                                 NULL, err);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}

static rpl_status generate_random(rpl_gg *gg, int w, rpl_error *err) {
  int *m = gg->scratch_a;
  int k = draw_others(gg, w, gg->group_size - 1, m + 1);
  m[0] = w;
  return group_create(gg, m, k + 1, RPL_PHASE_PLAIN, 0, 0, w, 0, NULL, err);
}

/* Lower median of a[0..k), k > 0, by quickselect (reorders a). */
static uint64_t lower_median(uint64_t *a, int k) {
  int lo = 0, hi = k - 1, want = (k - 1) / 2;
  while (lo < hi) {
    uint64_t pivot = a[(lo + hi) / 2];
    int i = lo, j = hi;
    while (i <= j) {
      while (a[i] < pivot) i++;
      while (a[j] > pivot) j--;
      if (i <= j) {
        uint64_t t = a[i];
        a[i++] = a[j];
        a[j--] = t;
      }
    }
    if (want <= j) hi = j;
    else if (want >= i) lo = i;
    else break;
  }
  return a[want];
}

static int in_job(const gg_worker *x) {
  return x->state == RPL_WORKER_LIVE || x->state == RPL_WORKER_FENCED;
}

/* Lower median of the non-negative doubles a[0..k) (as bit patterns: non-negative doubles
 * order as their bits), 0 if k == 0. Reorders a. */
static double median_bits(uint64_t *a, int k) {
  if (k <= 0) return 0;
  uint64_t bits = lower_median(a, k);
  double d;
  memcpy(&d, &bits, sizeof d);
  return d;
}

/* Where the bulk of the job is: the lower medians of the request counts, of the long step
 * averages (pace) and of the compute steps (comp, with its median absolute deviation) and
 * handed -> request steps (iv) of the workers not gone; unknown steps (0) are left out of the
 * step medians. Recomputed when a count, a step or the set of workers changed (O(n)
 * selections). */
static void bulk_refresh(rpl_gg *gg) {
  if (!gg->c_dirty) return;
  uint64_t *a = gg->scratch_c;
  int k = 0;
  for (int r = 0; r < gg->n; r++)
    if (in_job(&gg->w[r])) a[k++] = gg->w[r].c;
  gg->c_med = k > 0 ? lower_median(a, k) : 0;
  k = 0;
  for (int r = 0; r < gg->n; r++)
    if (in_job(&gg->w[r])) memcpy(&a[k++], &gg->w[r].pace, sizeof(double));
  gg->pace_med = median_bits(a, k);
  k = 0;
  for (int r = 0; r < gg->n; r++)
    if (in_job(&gg->w[r]) && gg->w[r].comp > 0) memcpy(&a[k++], &gg->w[r].comp, sizeof(double));
  gg->comp_med = median_bits(a, k);
  k = 0;
  for (int r = 0; r < gg->n; r++) {
    if (!in_job(&gg->w[r]) || gg->w[r].comp <= 0) continue;
    double dev = gg->w[r].comp - gg->comp_med;
    if (dev < 0) dev = -dev;
    memcpy(&a[k++], &dev, sizeof(double));
  }
  gg->comp_mad = median_bits(a, k);
  k = 0;
  for (int r = 0; r < gg->n; r++)
    if (in_job(&gg->w[r]) && gg->w[r].iv > 0) memcpy(&a[k++], &gg->w[r].iv, sizeof(double));
  gg->iv_med = median_bits(a, k);
  gg->c_dirty = 0;
}

/* The arrival window (seconds, see GG_WINDOW_*), or a negative value while no compute step is
 * measured. */
static double arrival_window(rpl_gg *gg) {
  bulk_refresh(gg);
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
static int filtered_out(rpl_gg *gg, const gg_worker *i, const gg_worker *x) {
  if (gg->c_thres < 0 || i->c <= x->c || i->c - x->c < (uint64_t)gg->c_thres) return 0;
  bulk_refresh(gg);
  if (gg->c_med <= x->c || gg->c_med - x->c < (uint64_t)gg->c_thres) return 0;
  /* Speed is what a worker computes between rounds (not its waits, nor the reductions). */
  if (gg->speed_aware && x->comp > 0 && gg->comp_med > 0)
    return x->comp > GG_SLOWER * gg->comp_med;
  if (x->pace <= 0 || gg->pace_med <= 0) return 1; /* no clock: counts alone */
  return x->pace > GG_SLOWER * gg->pace_med;
}

static double partner_wait(rpl_gg *gg);

/* Arrival filter: an idle worker not expected to ask within the arrival window would make
 * the initiator's group wait for it -- a straggler computing. The window is the bulk's (see
 * GG_WINDOW_*), the same for every initiator: it does not grow with the coordinator's round
 * trip or with the straggler's own steps, which is what let a job settle into lockstep with a
 * straggler (everyone waited for it, so it never fell behind in requests and its arrivals
 * looked due). Before compute steps are measured: the old estimate (group handed -> next
 * request, within the partner wait or the initiator's step). Unknown intervals never exclude. */
static int not_due(rpl_gg *gg, const gg_worker *i, const gg_worker *x) {
  if (!gg->arrival_filter) return 0;
  if (gg->speed_aware && x->late) return 1;
  double eta = gg->speed_aware ? expected_arrival(x) : -1.0;
  double window = gg->speed_aware ? arrival_window(gg) : -1.0;
  if (eta >= 0 && window > 0) return eta - gg->now > window;
  if (x->iv <= 0 || x->handed_at < 0) return 0;
  window = partner_wait(gg);
  if (i->iv > window) window = i->iv;
  return x->handed_at + x->iv - gg->now > window;
}

/* The participants of a division started by w (w first) into p; returns how many. A deferred
 * worker is waiting already, so taking it in makes nobody wait: the filters do not apply to
 * it, nor to anyone when `widen` (w is isolated). NULL p only counts. */
static int division_participants(rpl_gg *gg, int w, int widen, int *p, uint64_t *nfiltered) {
  const gg_worker *me = &gg->w[w];
  int np = 0;
  if (p) p[np] = w;
  np++;
  for (int r = 0; r < gg->n; r++) {
    const gg_worker *x = &gg->w[r];
    if (r == w || x->state != RPL_WORKER_LIVE || !worker_idle(x)) continue;
    if (!widen && !x->deferred && filtered_out(gg, me, x)) {
      if (nfiltered) (*nfiltered)++;
      continue;
    }
    if (!widen && !x->deferred && not_due(gg, me, x)) {
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
  int np = division_participants(gg, w, widen, p, &gg->st.filtered);
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
      st = group_create(gg, by + lo, hi - lo, RPL_PHASE_INTRA, 0, 0, w, division, NULL, err);
  }
  return st;
}

static rpl_status request_static(rpl_gg *gg, int w, uint64_t round, rpl_error *err) {
  gg_worker *me = &gg->w[w];
  if (me->blen > 0) return try_hand(gg, me->buf[0], err);
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
      if (buf_push(me, g) != 0) return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
      return try_hand(gg, g, err);
    }
  }
  gg_group *g = NULL;
  /* Only the requester gets it now; the others join when they ask for the same round. */
  g = calloc(1, sizeof *g + sizeof(int) * (size_t)n);
  if (!g) return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  g->id = gg->next_id++;
  g->key = key;
  g->n = n;
  g->cap = n;
  g->phase = RPL_PHASE_STATIC;
  g->deadline = -1.0;
  memcpy(g->members, m, sizeof(int) * (size_t)n);
  if (buf_push(me, g) != 0) {
    free(g);
    return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
  }
  g->prev = gg->pend_tail;
  if (gg->pend_tail) gg->pend_tail->next = g;
  else gg->pend_head = g;
  gg->pend_tail = g;
  gg->st.pending++;
  gg->st.groups_created++;
  trace_group(gg, RPL_TRACE_CREATED, g, w, 0);
  return try_hand(gg, g, err);
}

/* ---- partners: the bounded wait and the isolation bound (see the top) ------------------------ */

/* The partner wait: about one step of the bulk (the median worker's group handed -> next
 * request), not the mean over requests, which a straggler in lockstep drags towards its own. */
static double partner_wait(rpl_gg *gg) {
  if (gg->partner_wait > 0) return gg->partner_wait;
  bulk_refresh(gg);
  double base = gg->speed_aware && gg->iv_med > 0 ? gg->iv_med : gg->interval;
  double w = base > 0 ? 1.5 * base : RPL_GG_FIRST_PARTNER_WAIT;
  return w < RPL_GG_MIN_PARTNER_WAIT ? RPL_GG_MIN_PARTNER_WAIT
                                     : w > RPL_GG_MAX_PARTNER_WAIT ? RPL_GG_MAX_PARTNER_WAIT : w;
}

static int is_isolated(const rpl_gg *gg, const gg_worker *x) {
  return gg->max_isolated >= 0 && x->lonely >= (uint32_t)gg->max_isolated;
}

/* How many members w's group would have if generated now (w included). */
static int available(rpl_gg *gg, int w, int widen) {
  if (gg->policy == RPL_POLICY_SMART) return division_participants(gg, w, widen, NULL, NULL);
  int others = gg->nlive - (gg->w[w].state == RPL_WORKER_LIVE ? 1 : 0);
  return 1 + (others < gg->group_size - 1 ? others : gg->group_size - 1);
}

/* Whether x (live, smart) is worth waiting for, at most `wait`: a worker of the bulk's speed
 * (or of unknown speed) is, it asks about one bulk step from now at most; a straggler is only if
 * it is computing and expected within the wait -- waiting for it otherwise is the lockstep the
 * arrival window avoids. */
static int arrives_within(rpl_gg *gg, const gg_worker *x, double wait) {
  if (!gg->speed_aware) return 1;
  bulk_refresh(gg);
  if (x->late) return 0;
  if (x->comp <= 0 || gg->comp_med <= 0 || x->comp <= GG_SLOWER * gg->comp_med) return 1;
  double eta = worker_idle(x) ? expected_arrival(x) : -1.0;
  return eta >= 0 && eta - gg->now <= wait;
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
                gg->now - me->unfenced_at < partner_wait(gg)) ||
               (gg->policy == RPL_POLICY_SMART && x->state == RPL_WORKER_LIVE &&
                (!worker_idle(x) || not_due(gg, me, x)) && /* the idle and due are in already */
                arrives_within(gg, x, partner_wait(gg)));
    if (soon && (widen || !filtered_out(gg, me, x))) return 1;
  }
  return 0;
}

static void defer(rpl_gg *gg, int w, double deadline) {
  gg->w[w].deferred = 1;
  gg->w[w].deadline = deadline;
  gg->dq[gg->dq_len++] = w;
  gg->st.deferred++;
}

static rpl_status generate(rpl_gg *gg, int w, int widen, rpl_error *err) {
  undefer(gg, w);
  return gg->policy == RPL_POLICY_SMART ? generate_division(gg, w, widen, err)
                                        : generate_random(gg, w, err);
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
  if (buf_push(&gg->w[w], best) != 0) {
    *st = rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
    return 1;
  }
  int i = best->n++;
  while (i > 0 && best->members[i - 1] > w) {
    best->members[i] = best->members[i - 1];
    i--;
  }
  best->members[i] = w;
  undefer(gg, w);
  gg->st.joins++;
  trace_group(gg, RPL_TRACE_JOINED, best, w, 0);
  *st = try_hand(gg, best, err);
  return 1;
}

/* w is waiting with an empty buffer: generate its group now, or let it wait for partners. */
static rpl_status serve(rpl_gg *gg, int w, rpl_error *err) {
  gg_worker *me = &gg->w[w];
  int isolated = is_isolated(gg, me);
  int active = gg->n - gg->ngone;
  int need = isolated ? 2 : gg->group_size < active ? gg->group_size : active;
  if (available(gg, w, isolated) >= need || !others_coming(gg, w, isolated))
    return generate(gg, w, isolated, err);
  if (!me->deferred) {
    if (gg->partner_wait < 0 && !isolated) return generate(gg, w, 0, err);
    defer(gg, w, gg->now + (gg->partner_wait < 0 ? 0 : partner_wait(gg)));
  }
  if (isolated) { /* isolated and alone while others are coming: join a pending group */
    rpl_status st = RPL_OK;
    if (join_pending(gg, w, &st, err)) return st;
  }
  if (me->deadline > gg->now) return RPL_OK;
  if (isolated && !me->held) {
    /* Hold on past the wait -- bounded, so that a worker nobody serves (the others stuck in
     * a long exact collective, say) still gets its no-op round before its request times out. */
    double hold = 4 * partner_wait(gg);
    me->held = 1;
    me->deadline = gg->now + hold;
    gg->st.isolation_holds++;
    return RPL_OK;
  }
  gg->st.wait_expired++; /* a smaller group, or one of one */
  return generate(gg, w, isolated, err);
}

/* Re-checks every deferred request after an event (or a clock step) changed who is available. */
static rpl_status serve_deferred(rpl_gg *gg, rpl_error *err) {
  rpl_status st = RPL_OK;
  /* serve() only ever removes entries (a generated or joined group takes its waiting members
   * out): start again from the front after each removal. */
  for (int i = 0; i < gg->dq_len && st == RPL_OK;) {
    int w = gg->dq[i], len = gg->dq_len;
    st = serve(gg, w, err);
    i = gg->dq_len != len ? 0 : i + 1;
  }
  return st;
}

rpl_status rpl_gg_advance(rpl_gg *gg, double now, rpl_error *err) {
  if (now > gg->now) gg->now = now;
  rpl_status st = evict_late(gg, err);
  return st != RPL_OK ? st : serve_deferred(gg, err);
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

static rpl_status check_worker(const rpl_gg *gg, int w, const char *what, rpl_error *err) {
  if (w < 0 || w >= gg->n)
    return rpl_fail(err, RPL_ERR_INVALID, "gg %s: worker %d out of range [0, %d)", what,
                    w, gg->n);
  return RPL_OK;
}

static int gone(uint8_t s) { return s == RPL_WORKER_LEFT || s == RPL_WORKER_DEAD; }

static void set_state(rpl_gg *gg, gg_worker *w, rpl_worker_state s) {
  if (w->state == RPL_WORKER_LIVE && s != RPL_WORKER_LIVE) gg->nlive--;
  if (w->state != RPL_WORKER_LIVE && s == RPL_WORKER_LIVE) gg->nlive++;
  gg->ngone += gone((uint8_t)s) - gone(w->state);
  w->state = (uint8_t)s;
  gg->c_dirty = 1; /* the bulk's median is over the workers not gone */
}

/* Every event may change who is available to the deferred requests: re-check them; and a
 * request may be the second arrival of a group past its deadline. */
static rpl_status settle(rpl_gg *gg, rpl_status st, rpl_error *err) {
  if (st == RPL_OK && gg->speed_aware) st = evict_late(gg, err);
  if (st != RPL_OK || gg->dq_len == 0) return st;
  return serve_deferred(gg, err);
}

/* ---- the adaptive period (see the top) ---------------------------------------------------- */

/* Whether every live worker keeps up: its compute step (from leaving the GG to asking again,
 * so neither reductions nor waits for groups count) is known and within GG_BEHIND of the
 * bulk's, and none has been computing for GG_OVERDUE bulk steps (a worker slowed just now is
 * seen before its slow step ends). Fenced workers are inside an exact collective with everyone:
 * they do not count. Needs the clock. O(n). */
static int job_calm(rpl_gg *gg) {
  if (gg->now <= 0) return 0;
  uint64_t *a = gg->scratch_c;
  int k = 0;
  for (int r = 0; r < gg->n; r++) {
    const gg_worker *x = &gg->w[r];
    if (x->state != RPL_WORKER_LIVE) continue;
    if (x->comp <= 0) return 0;
    memcpy(&a[k++], &x->comp, sizeof(double)); /* non-negative doubles order as their bits */
  }
  if (k == 0) return 0;
  uint64_t bits = lower_median(a, k);
  double med;
  memcpy(&med, &bits, sizeof med);
  for (int r = 0; r < gg->n; r++) {
    const gg_worker *x = &gg->w[r];
    if (x->state != RPL_WORKER_LIVE) continue;
    if (x->comp > GG_BEHIND * med) return 0;
    int computing = !x->waiting && !x->locked && x->free_at >= 0;
    if (computing && gg->now - x->free_at > GG_OVERDUE * med) return 0;
  }
  return 1;
}

/* Updates the period for a request of `me` and says whether to pass it. The period rises to
 * period_max only after a calm request from each worker in a row, so that one noisy step does
 * not flip it, and falls to 1 at the first request that finds a worker behind. */
static int period_pass(rpl_gg *gg, gg_worker *me) {
  if (gg->period_max <= 1) return 0;
  if (!job_calm(gg)) {
    if (gg->period > 1) gg->st.period_drops++;
    gg->period = 1;
    gg->calm = 0;
  } else if (gg->period == 1 && ++gg->calm >= gg->n - gg->ngone) {
    gg->period = gg->period_max;
  }
  gg->st.period = (uint32_t)gg->period;
  /* Never pass a worker others wait for: its group is generated (buffer), or partners wait. */
  return gg->period > 1 && me->blen == 0 && gg->dq_len == 0 && !is_isolated(gg, me) &&
         me->since + 1 < (uint32_t)gg->period;
}

rpl_status rpl_gg_request(rpl_gg *gg, int w, uint64_t round, rpl_error *err) {
  rpl_status st = check_worker(gg, w, "request", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  if (me->state == RPL_WORKER_LEFT)
    return rpl_fail(err, RPL_ERR_CLOSED, "gg request: worker %d has left the job", w);
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
      double w = dt > me->comp ? 1.0 / 3 : 1.0 / 8;
      me->comp = me->comp > 0 ? me->comp + (dt - me->comp) * w : dt;
    }
  }
  if (gg->policy == RPL_POLICY_STATIC) {
    me->waiting = 1;
    me->waiting_round = round;
    return request_static(gg, w, round, err);
  }
  if (period_pass(gg, me)) {
    me->since++;
    me->passes++;
    me->handed_at = me->free_at = gg->now; /* its steps are measured from this answer */
    gg->st.passes++;
    if (ev_push(gg, RPL_EV_PASS, w, NULL, round, -1, RPL_REASON_NONE) != 0)
      return rpl_fail(err, RPL_ERR_NOMEM, "gg: out of memory");
    return RPL_OK; /* w stays idle and is not waiting: nobody's availability changed */
  }
  me->waiting = 1;
  me->waiting_round = round;
  if (me->blen > 0 && !me->locked) arm_deadline(gg, me->buf[0]);
  st = me->blen == 0 ? serve(gg, w, err) : try_hand(gg, me->buf[0], err);
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
      arm_deadline(gg, me->buf[0]);
      st = try_hand(gg, me->buf[0], err);
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
  undefer(gg, w);
  return settle(gg, st, err); /* a partner less: some deferred may stop waiting */
}

rpl_status rpl_gg_fence(rpl_gg *gg, int w, rpl_error *err) {
  rpl_status st = check_worker(gg, w, "fence", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  if (me->state == RPL_WORKER_LEFT)
    return rpl_fail(err, RPL_ERR_CLOSED, "gg fence: worker %d has left the job", w);
  if (me->state != RPL_WORKER_FENCED) me->fenced_at = gg->now;
  me->free_at = -1.0; /* an exact collective is no compute step */
  set_state(gg, me, RPL_WORKER_FENCED);
  return remove_from_schedule(gg, w, RPL_REASON_FENCED, err);
}

rpl_status rpl_gg_unfence(rpl_gg *gg, int w, rpl_error *err) {
  rpl_status st = check_worker(gg, w, "unfence", err);
  if (st != RPL_OK) return st;
  gg_worker *me = &gg->w[w];
  if (me->state == RPL_WORKER_LEFT)
    return rpl_fail(err, RPL_ERR_CLOSED, "gg unfence: worker %d has left the job", w);
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

/* ---- introspection --------------------------------------------------------------------- */

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
