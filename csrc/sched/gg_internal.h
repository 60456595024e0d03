/* Private to the dynamic Group Generator's files (gg*.c): its state, the constants of its rules
 * and the functions one of those files calls in another. The model and its invariants are at
 * the top of gg.c. Not part of the public API (rpl_sched.h). */
#ifndef RPL_GG_INTERNAL_H
#define RPL_GG_INTERNAL_H

#include <stdlib.h>
#include <string.h>

#include "sched_internal.h"

enum { G_PENDING = 0, G_HANDED = 1, G_CANCELLED = 2 };

/* The slowdown filter takes a worker behind for a straggler only if its measured step is this
 * many times the bulk's (chance drift is a few percent; a straggler is slower by its factor). */
#define GG_SLOWER 1.5
/* The adaptive period counts a worker as a straggler once its compute step is GG_BEHIND times
 * the bulk's (speed-aware: passed only when nobody is due for it, the bulk keeps its period), and the job as not calm
 * while a worker has computed GG_OVERDUE of its expected steps without asking (a 5x straggler
 * is seen four steps into its slow one). Looser than the slowdown filter: steps of a
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
/* ... but while the job is calm (the adaptive period above 1), after this many arrival windows:
 * nobody but a known straggler is slow then, a member late for a due group was slowed in this
 * step only, and it is cheaper for it to average at the next due step than for the group to
 * wait for it (it passes once; a worker that missed its last due group is kept and waited for
 * as before, so a mildly slow worker still averages at least every 2 x period_max
 * requests). Chosen with gg_sim on the production traces (benchmarks/gg_sim_traces.py). */
#ifndef GG_CALM_EVICT_WINDOWS
#define GG_CALM_EVICT_WINDOWS 0.5
#endif

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
  uint8_t calm;                /* its deadline was armed in a calm job (GG_CALM_EVICT_WINDOWS) */
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
  uint8_t missed;              /* ... while the job was calm: its next request passes */
  uint8_t missed_last;         /* it missed a due group and has not averaged since: the next
                                  due group waits for it (never dropped twice in a row) */
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
  double calm_med;             /* the median compute step at the last test of calm */
  int speed_aware;             /* smart: the arrival window and late members dropped (below) */
  int period_max;              /* 1 = no adaptive period */
  int period;                  /* the adaptive period now */
  int calm;                    /* requests in a row that found the job calm */
  double now;                  /* the clock (rpl_gg_advance) */
  double first_request_at;     /* clock at the job's first request, < 0 before */
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
  double *scratch_c;           /* [n], for the medians (bulk_refresh, job_calm) */
  uint64_t c_med;              /* the bulk's count and step (bulk_refresh) while !c_dirty */
  double pace_med;
  double comp_med, comp_mad;   /* median compute step of the live workers and its median
                                  absolute deviation, 0 = unknown (bulk_refresh) */
  double iv_med;               /* median step from a group handed to the next request */
  int c_dirty;
  int *host_cnt;               /* [hosts + 1] */
  rpl_gg_stats st;
  rpl_whatif *whatif;           /* what stragglers cost (fed at each measured compute step) */
  void (*trace)(void *ctx, const rpl_gg_trace *t);
  void *trace_ctx;
};

static inline int worker_idle(const gg_worker *w) { return w->blen == 0 && w->locked == 0; }

/* Whether member x of g is waiting with g at the head of its buffer, unlocked: ready to go. */
static inline int arrived_for(const gg_worker *x, const gg_group *g) {
  return x->waiting && x->blen > 0 && x->buf[0] == g && !x->locked;
}

static inline int group_has(const gg_group *g, int w) {
  int lo = 0, hi = g->n - 1;
  while (lo <= hi) {
    int mid = (lo + hi) / 2;
    if (g->members[mid] == w) return 1;
    if (g->members[mid] < w) lo = mid + 1;
    else hi = mid - 1;
  }
  return 0;
}

static inline int is_isolated(const rpl_gg *gg, const gg_worker *x) {
  return gg->max_isolated >= 0 && x->lonely >= (uint32_t)gg->max_isolated;
}

/* Shared between the gg*.c files only: kept out of the extensions' exported symbols. */
#pragma GCC visibility push(hidden)

/* gg.c: buffers, the pending list, creating and handing groups. */
int gg_buf_push(gg_worker *w, gg_group *g);
int gg_buf_remove(gg_worker *w, gg_group *g);
void gg_trace_group(rpl_gg *gg, rpl_trace_kind kind, const gg_group *g, int initiator,
                    uint64_t division);
void gg_undefer(rpl_gg *gg, int w);
/* A new group of members[0..n) (as given) with room for cap, in no buffer yet; NULL when out
 * of memory. */
gg_group *gg_group_new(rpl_gg *gg, const int *members, int n, int cap, rpl_phase phase,
                       uint64_t key);
/* Appends g (in its members' buffers already) to the pending list, counted as created. */
void gg_pend_append(rpl_gg *gg, gg_group *g);
rpl_status gg_group_create(rpl_gg *gg, const int *members, int n, rpl_phase phase, int heads,
                           uint64_t key, int initiator, uint64_t division, gg_group **out,
                           rpl_error *err);
rpl_status gg_try_hand(rpl_gg *gg, gg_group *g, rpl_error *err);

/* gg_generate.c: what each policy generates. */
rpl_status gg_generate(rpl_gg *gg, int w, int widen, rpl_error *err);
rpl_status gg_request_static(rpl_gg *gg, int w, uint64_t round, rpl_error *err);
int gg_division_participants(rpl_gg *gg, int w, int widen, int *p, uint64_t *nfiltered);

/* gg_speed.c: measured speeds and what they decide. */
void gg_bulk_refresh(rpl_gg *gg);
int gg_filtered_out(rpl_gg *gg, const gg_worker *i, const gg_worker *x);
int gg_not_due(rpl_gg *gg, const gg_worker *i, const gg_worker *x);
int gg_stopped(rpl_gg *gg, const gg_worker *x);
int gg_arrives_within(rpl_gg *gg, const gg_worker *x, double wait);
void gg_arm_deadline(rpl_gg *gg, gg_group *g);
rpl_status gg_evict_late(rpl_gg *gg, rpl_error *err);
int gg_period_pass(rpl_gg *gg, gg_worker *me);

/* gg_partners.c: the bounded wait for partners and the isolation bound. */
double gg_partner_wait(rpl_gg *gg);
rpl_status gg_serve(rpl_gg *gg, int w, rpl_error *err);
rpl_status gg_serve_deferred(rpl_gg *gg, rpl_error *err);

#pragma GCC visibility pop

#endif /* RPL_GG_INTERNAL_H */
