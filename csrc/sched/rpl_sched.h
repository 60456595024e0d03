/*
 * rpl_sched.h - the one public header of the Group Generator (GG): who averages with whom.
 *
 * Three layers, each usable alone:
 *   1. Worker layout and the static schedule (paper Fig. 9-10): pure functions, run inside
 *      every worker, no coordinator.
 *   2. The dynamic group generator `rpl_gg` (random, smart, adpsgd, and static for simulation):
 *      a state machine with no I/O and no clock. Callers feed it what workers do (request,
 *      done, fence, unfence, leave, dead) and drain the events it produces (a group handed to a
 *      worker, a request cancelled). The coordinator service and the simulator both drive it.
 *   3. The wire protocol (encode/parse, no I/O: rpl_sched_proto.h, which this header includes)
 *      and the worker-side client (libzmq).
 *
 * Ownership: every object is created by a *_create function and freed by its *_destroy; inputs
 * are copied, so callers keep ownership of what they pass in. No global state: every random
 * choice comes from the object's own generator, seeded by the caller.
 *
 * Errors: functions return an rpl_status and fill the caller's rpl_error (from ripples.h).
 */
#ifndef RPL_SCHED_H
#define RPL_SCHED_H

#include <stddef.h>
#include <stdint.h>

#include "ripples.h"
#include "rpl_sched_proto.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Upper bound on workers a layout, a GG or a protocol message may describe. */
#define RPL_SCHED_MAX_WORKERS 65536

/* ---- 1. Layout and static schedule -------------------------------------------------------- */

/* Which host each rank runs on. Hosts are numbered densely 0..H-1 in the order of their lowest
 * rank; a rank's local index is its position among its host's ranks in rank order. */
typedef struct rpl_layout rpl_layout;

/* host_of[rank] holds any integer label per rank (equal labels = same host); NULL means all
 * ranks on one host. */
rpl_status rpl_layout_create(int nworkers, const int *host_of, rpl_layout **out, rpl_error *err);
/* nworkers ranks on hosts of per_host ranks each (the last host may be smaller). */
rpl_status rpl_layout_create_uniform(int nworkers, int per_host, rpl_layout **out,
                                     rpl_error *err);
void rpl_layout_destroy(rpl_layout *layout);
int rpl_layout_workers(const rpl_layout *layout);
int rpl_layout_hosts(const rpl_layout *layout);
int rpl_layout_host(const rpl_layout *layout, int rank);       /* dense host index */
int rpl_layout_local(const rpl_layout *layout, int rank);      /* local index on its host */
int rpl_layout_host_size(const rpl_layout *layout, int host);
int rpl_layout_rank(const rpl_layout *layout, int host, int local); /* -1 if out of range */

/* The static schedule repeats every RPL_STATIC_PERIOD rounds. */
#define RPL_STATIC_PERIOD 4

/* The group of `rank` in `round`: sorted members (including rank) in members[0..*n), and a
 * group id that every member computes identically (unique over rounds, never 0). Fails with
 * RPL_ERR_INVALID if cap is too small (*n then holds the size needed). The rule (L = size of
 * the rank's host, j = local index, H = hosts, see csrc/sched/README.md):
 *   phase 0: j=0 with local worker 0 of every host; j=1 alone; j>=2 pairs (2,3),(4,5),...
 *            (an unpaired last one is alone)
 *   phase 1, 3: all workers of the host
 *   phase 2: the "cross" worker (j=1, or j=0 when L=1) with the cross worker of the opposite
 *            host on the ring (h <-> h+H/2; with H odd the last host's cross worker is alone);
 *            the others pair by mirror j <-> L-1-j, and the mirror of the cross worker is alone.
 * With L=4 this is exactly the paper's Figure 10. */
rpl_status rpl_static_group(const rpl_layout *layout, int rank, uint64_t round, int *members,
                            int cap, int *n, uint64_t *group_id, rpl_error *err);

/* ---- 2. Dynamic group generator ----------------------------------------------------------- */

typedef enum {
  RPL_POLICY_STATIC = 0, /* the static schedule, matched by round (simulation, CLI) */
  RPL_POLICY_RANDOM = 1, /* paper Fig. 8: random group with the requester; lock vector */
  RPL_POLICY_SMART = 2,  /* paper 5.1-5.3: Global Division + slowdown filter (+ inter_intra) */
  RPL_POLICY_ADPSGD = 3, /* AD-PSGD baseline: random pairs, serialised per worker */
  RPL_POLICY_COUNT = 4
} rpl_policy;

const char *rpl_policy_name(rpl_policy policy); /* "static", "random", "smart", "adpsgd" */
rpl_status rpl_policy_parse(const char *name, rpl_policy *out, rpl_error *err);

#define RPL_GG_DEFAULT_GROUP_SIZE 3
/* Default of the slowdown filter, chosen with benchmarks/gg_sim (see benchmarks/gg_sim.md). */
#define RPL_GG_DEFAULT_C_THRES 4
/* Default isolation bound: consecutive groups of one a worker may get while others live. */
#define RPL_GG_DEFAULT_MAX_ISOLATED 2
/* The adaptive partner wait (partner_wait_ms = 0): 1.5 x the median worker's step when
 * speed_aware (the default), else 1.5 x the recent mean interval between requests; within
 * [MIN, MAX]; FIRST until a step is known. Seconds of the GG's clock (rpl_gg_advance). */
#define RPL_GG_MIN_PARTNER_WAIT 0.002
#define RPL_GG_MAX_PARTNER_WAIT 0.5
#define RPL_GG_FIRST_PARTNER_WAIT 0.02
/* Default of period_max: every request averages (the paper; partial_all_reduce as a primitive
 * keeps that meaning). Training loops opt in: ripples_pg.wrap() sets its own bound, chosen with
 * benchmarks/train.py (docs/benchmarks.md, "No straggler"). */
#define RPL_GG_DEFAULT_PERIOD_MAX 1
#define RPL_GG_MAX_PERIOD (1 << 20) /* bound on period_max */

typedef enum {
  RPL_TRACE_CREATED = 1,   /* a group was generated (appended to its members' buffers) */
  RPL_TRACE_HANDED = 2,    /* every member asked for it: handed to all members at once */
  RPL_TRACE_CANCELLED = 3, /* cancelled before it was handed */
  RPL_TRACE_DIVISION = 4,  /* a Global Division starts (members = its participants) */
  RPL_TRACE_JOINED = 5,    /* an isolated worker (initiator) joined a pending group */
  RPL_TRACE_DROPPED = 6    /* smart: members late past the group's deadline were dropped
                              (members = those left, all waiting; handed next) */
} rpl_trace_kind;

typedef enum {
  RPL_PHASE_PLAIN = 0,  /* random, adpsgd, smart without inter_intra */
  RPL_PHASE_INTER = 1,  /* inter_intra: heads across hosts, or non-heads within a host */
  RPL_PHASE_INTRA = 2,  /* inter_intra: all participants of one host */
  RPL_PHASE_STATIC = 3
} rpl_phase;

/* What a trace callback sees. Pointers are valid only during the callback. */
typedef struct rpl_gg_trace {
  rpl_trace_kind kind;
  uint64_t group_id;      /* 0 for DIVISION */
  const int *members;     /* sorted */
  int nmembers;
  rpl_phase phase;
  int heads;              /* INTER: 1 if this is a group of head workers */
  int initiator;          /* DIVISION and CREATED: the requester that caused it */
  uint64_t division;      /* CREATED by a division / DIVISION: its sequence number, else 0 */
} rpl_gg_trace;

typedef struct rpl_gg_config {
  rpl_policy policy;
  int nworkers;           /* 1 .. RPL_SCHED_MAX_WORKERS */
  const int *host_of;     /* host label per rank (copied); NULL = one host */
  int group_size;         /* 0 = RPL_GG_DEFAULT_GROUP_SIZE; adpsgd always uses 2 */
  int c_thres;            /* smart: admit w into i's division iff c_i - c_w < c_thres;
                             0 = RPL_GG_DEFAULT_C_THRES, negative = no filter */
  int inter_intra;        /* smart: two groups per worker per division (paper 5.2) */
  /* Groups must stay groups (docs/design.md §3). A requester for whom fewer than group_size
   * members are available, while others are about to be (busy in a group, or fenced inside an exact
   * collective), waits for them at most this long before it gets a smaller group: 0 = the
   * adaptive default (RPL_GG_*_PARTNER_WAIT), > 0 = fixed milliseconds, < 0 = never waits.
   * Waiting needs the clock: the caller must call rpl_gg_advance. */
  int partner_wait_ms;
  /* After this many consecutive groups of one a worker gets no more while other live workers
   * exist: it waits, outside the slowdown filter, until it is placed into the next group
   * formed (or joins a pending one). 0 = RPL_GG_DEFAULT_MAX_ISOLATED, negative = no bound. */
  int max_isolated;
  /* smart, beyond the paper: a division leaves out an idle worker that is not expected to ask
   * within the partner wait (from its measured interval between requests), so that nobody
   * waits for a straggler; it is taken in once it asks. 0 = on, negative = off (the paper's
   * division: every idle worker that passes the slowdown filter). Needs the clock. */
  int arrival_filter;
  /* smart, beyond the paper: speed-aware matchmaking (csrc/sched/README.md). The arrival
   * filter's window is the bulk's compute step (median and spread of the workers' measured
   * compute steps, leaving the GG -> asking again), the partner wait the median worker's step,
   * the slowdown filter's speed the compute step; and a pending group whose members have not
   * all asked by its deadline (from the same window) drops the late ones when two or more are
   * waiting. A straggler joins faster workers' groups when it is ready and is never waited for
   * beyond that bound, at any step length. 0 = on, negative = off (the previous estimates:
   * group handed -> next request, within the partner wait; kept to reproduce the lockstep a
   * straggler could hold the job in at short steps, benchmarks/gg_sim.md). */
  int speed_aware;
  /* Adaptive period (random, smart, adpsgd; not static): while every live worker keeps the
   * bulk's pace -- its compute step (leaving the GG -> asking again) within 2x the median,
   * none computing for 4 median steps -- for one request of each, a worker averages only
   * every period_max-th request: the GG answers the others at once with RPL_EV_PASS (no
   * group, no lock). A worker that falls behind sets the period back to 1 at the next request
   * anyone makes. A worker whose group is already generated, or with partners waiting for it,
   * is never passed. 0 = RPL_GG_DEFAULT_PERIOD_MAX (off), 1 or negative = average at every
   * request (the paper). Needs the clock (rpl_gg_advance): without it the period stays 1. */
  int period_max;
  uint64_t seed;
  /* Optional observer (tests, simulator); called synchronously, must not call back in. */
  void (*trace)(void *ctx, const rpl_gg_trace *t);
  void *trace_ctx;
} rpl_gg_config;

typedef struct rpl_gg rpl_gg;

rpl_status rpl_gg_create(const rpl_gg_config *cfg, rpl_gg **out, rpl_error *err);
void rpl_gg_destroy(rpl_gg *gg);

/* Why a request was cancelled, or why a worker is out of the schedule. */
typedef enum {
  RPL_REASON_NONE = 0,
  RPL_REASON_FENCED = 1,
  RPL_REASON_LEFT = 2,
  RPL_REASON_DEAD = 3
} rpl_reason;
const char *rpl_reason_name(rpl_reason reason);

/* The GG's clock, in seconds (any origin, never going back): deadlines of requests waiting
 * for partners are measured on it. Advancing hands out the requests whose wait is over. A GG
 * never advanced has time 0 for ever: waits then end only through other workers' events. */
rpl_status rpl_gg_advance(rpl_gg *gg, double now, rpl_error *err);
/* Seconds of the clock at which the next wait ends, or a negative value if none is pending:
 * when the caller should call rpl_gg_advance next. */
double rpl_gg_next_deadline(const rpl_gg *gg);

/* Worker `w` asks for the group of its round `round` (its count of partial calls so far,
 * from 0). The answer comes as an RPL_EV_GROUP event, possibly later, once every member has
 * asked for that group, or once a short wait for partners ends (partner_wait_ms). A request
 * while fenced unfences; a request from a worker declared
 * dead revives it; a request from a worker that left fails with RPL_ERR_CLOSED. A repeated
 * request while one is outstanding only updates nothing and succeeds. */
rpl_status rpl_gg_request(rpl_gg *gg, int w, uint64_t round, rpl_error *err);
/* `w` finished group `group_id`: releases its lock. A done for another group is counted as
 * stale and ignored. */
rpl_status rpl_gg_done(rpl_gg *gg, int w, uint64_t group_id, rpl_error *err);
/* Cancels every not-yet-handed group that contains `w` (members waiting on one get an
 * RPL_EV_CANCEL and must ask again) and keeps `w` out of new groups until it unfences
 * (fence), for ever (leave), or until it shows up again (dead). An outstanding request of w
 * is dropped. */
rpl_status rpl_gg_fence(rpl_gg *gg, int w, rpl_error *err);
rpl_status rpl_gg_unfence(rpl_gg *gg, int w, rpl_error *err);
rpl_status rpl_gg_leave(rpl_gg *gg, int w, rpl_error *err);
rpl_status rpl_gg_dead(rpl_gg *gg, int w, rpl_error *err);

/* GROUP: the group of a request. CANCEL: a waiting request lost its group, ask again. PASS:
 * the adaptive period answers the request with no group (a no-op round, no done needed). */
typedef enum { RPL_EV_GROUP = 1, RPL_EV_CANCEL = 2, RPL_EV_PASS = 3 } rpl_event_kind;

typedef struct rpl_gg_event {
  rpl_event_kind kind;
  int worker;             /* whom to tell */
  uint64_t group_id;      /* 0 for PASS */
  uint64_t round;         /* the round of the request this answers */
  int nmembers;           /* GROUP: full member count (members copied up to cap) */
  int period;             /* GROUP, PASS: the adaptive period when it was answered (1 = every
                             request averages) */
  int culprit;            /* CANCEL: the worker whose fence/leave/death cancelled it */
  rpl_reason reason;      /* CANCEL */
} rpl_gg_event;

/* Pops the oldest pending event: returns 1 and fills *ev (and members[0..min(n,cap))), or 0. */
int rpl_gg_poll(rpl_gg *gg, rpl_gg_event *ev, int *members, int cap);

typedef enum {
  RPL_WORKER_LIVE = 0,
  RPL_WORKER_FENCED = 1,
  RPL_WORKER_LEFT = 2,
  RPL_WORKER_DEAD = 3
} rpl_worker_state;
const char *rpl_worker_state_name(rpl_worker_state s);

typedef struct rpl_gg_worker_info {
  rpl_worker_state state;
  int host;               /* dense host index */
  uint64_t requests;      /* c_w: rounds requested so far (the slowdown filter's counter) */
  int waiting;            /* a request is outstanding */
  uint64_t waiting_round;
  int buffered;           /* groups in its Group Buffer */
  uint64_t head_group;    /* first group in the buffer, 0 if none */
  uint64_t locked_group;  /* handed and not yet done, 0 if none (the lock vector) */
  uint64_t handed;        /* groups handed to it */
  uint64_t cancels;       /* requests of it cancelled */
  uint64_t singletons;    /* groups of one handed to it */
  uint32_t lonely;        /* groups of one since its last group of two or more */
  uint32_t lonely_max;    /* longest such run */
  int deferred;           /* its request waits for partners */
  uint64_t passes;        /* requests answered with PASS (the adaptive period) */
  double step;            /* its compute step (done or pass -> next request), 0 = unknown */
} rpl_gg_worker_info;

rpl_status rpl_gg_worker(const rpl_gg *gg, int w, rpl_gg_worker_info *out, rpl_error *err);

typedef struct rpl_gg_stats {
  uint64_t requests;
  uint64_t groups_created;
  uint64_t groups_handed;
  uint64_t groups_cancelled;
  uint64_t singletons_handed;  /* groups of one (no partner available) */
  uint64_t divisions;          /* smart: Global Divisions */
  uint64_t filtered;           /* smart: idle workers kept out of a division by c_thres */
  uint64_t conflicts;          /* groups created with a member that was not idle */
  uint64_t implicit_dones;     /* requests that arrived while still locked */
  uint64_t stale_dones;
  uint64_t pending;            /* groups created and not yet handed or cancelled */
  uint64_t deferred;           /* requests that waited for partners */
  uint64_t wait_expired;       /* ... whose wait ended before enough partners came */
  uint64_t isolation_holds;    /* waits prolonged by the isolation bound */
  uint64_t joins;              /* isolated workers added to a pending group */
  uint64_t late;               /* smart: idle workers left out of a division, not due yet */
  uint64_t passes;             /* requests answered with PASS by the adaptive period */
  uint64_t period_drops;       /* times the period fell back to 1 (a worker fell behind) */
  uint32_t period;             /* the adaptive period now (1 = every request averages) */
  uint64_t late_dropped;       /* smart: members dropped from a pending group past its
                                  deadline (speed_aware) */
} rpl_gg_stats;

void rpl_gg_get_stats(const rpl_gg *gg, rpl_gg_stats *out);
rpl_policy rpl_gg_policy(const rpl_gg *gg);
int rpl_gg_workers(const rpl_gg *gg);
int rpl_gg_group_size(const rpl_gg *gg);
int rpl_gg_c_thres(const rpl_gg *gg);    /* effective value; negative = off */
int rpl_gg_inter_intra(const rpl_gg *gg);
int rpl_gg_period_max(const rpl_gg *gg); /* effective bound; 1 = the period is off */
const rpl_layout *rpl_gg_layout(const rpl_gg *gg);

/* Visits pending groups in generation order; stops early if fn returns non-zero. `arrived`
 * is how many members are waiting with it at the head of their buffer. */
void rpl_gg_foreach_pending(const rpl_gg *gg,
                            int (*fn)(void *ctx, uint64_t group_id, const int *members, int n,
                                      int arrived),
                            void *ctx);

/* ---- 2b. What-if accounting ------------------------------------------------------------------ */

/* What stragglers cost the job, from the compute steps of its workers: the time all-reduce would
 * take for the same work (every step as long as its slowest worker's), the time if nobody waited
 * (each worker at its own pace: benchmarks/trace_replay.py's ideal), and the time the job took.
 * Worker w's steps are numbered in the order they are reported; step t of all-reduce is the
 * slowest of every worker's step t. The dynamic GG keeps one (rpl_gg_whatif), fed with the
 * compute step it measures at each request; it can be used alone (gg_sim --whatif-table).
 * Steps further than RPL_WHATIF_WINDOW apart are aligned with the late worker's mean step. */
#define RPL_WHATIF_WINDOW 1024

typedef struct rpl_whatif rpl_whatif;

typedef struct rpl_whatif_summary {
  uint64_t steps;        /* worker steps reported, all workers */
  uint64_t job_steps;    /* all-reduce steps accounted: step indices every worker reached */
  double allreduce_step; /* all-reduce's mean step: the slowest compute of a step, averaged
                            over job_steps; 0 = unknown */
  double free_step;      /* nobody waits: the harmonic mean of the workers' mean steps */
  double gain;           /* allreduce_step / free_step (>= 1); 0 = unknown */
  double waste;          /* 1 - free_step / allreduce_step: all-reduce's share spent waiting */
  double allreduce_s;    /* steps / workers x allreduce_step: all-reduce's time for this work */
  double free_s;         /* ... the same at free_step */
  double elapsed_s;      /* the job's time for it: first step's start to the last report */
  double saved;          /* 1 - elapsed_s / allreduce_s: the share of all-reduce's time saved
                            (at most waste, less the rounds' costs); 0 = unknown */
  double cost_s;         /* the workers' cost_s summed (rpl_whatif_worker_info) */
} rpl_whatif_summary;

typedef struct rpl_whatif_worker_info {
  uint64_t steps;
  double mean_step;      /* its mean compute step, 0 = none */
  double cost_s;         /* all-reduce's waiting it alone caused: over the accounted steps where
                            it was slowest, its lead over the second slowest */
} rpl_whatif_worker_info;

rpl_status rpl_whatif_create(int nworkers, rpl_whatif **out, rpl_error *err);
void rpl_whatif_destroy(rpl_whatif *a);
/* Worker w's next step computed for `step` seconds, reported at clock `now` (seconds). Negative
 * or non-finite steps and unknown workers are ignored. */
void rpl_whatif_step(rpl_whatif *a, int w, double step, double now);
/* w left the job (out = 1; its steps so far still count), or came back (0): all-reduce's steps
 * wait only for the workers in the job, and one back in joins at the job's current step. */
void rpl_whatif_out(rpl_whatif *a, int w, int out);
void rpl_whatif_get(const rpl_whatif *a, rpl_whatif_summary *out);
rpl_status rpl_whatif_worker(const rpl_whatif *a, int w, rpl_whatif_worker_info *out,
                             rpl_error *err);
/* The GG's own accounting (never NULL for a GG that was created). */
const rpl_whatif *rpl_gg_whatif(const rpl_gg *gg);

/* ---- 3a. Wire protocol: rpl_sched_proto.h (included above) --------------------------------- */

/* ---- 3b. Worker-side client (libzmq) ------------------------------------------------------- */

typedef struct rpl_gg_client_config {
  const char *endpoint;     /* e.g. "tcp://10.0.0.1:29600"; a comma-separated list names the
                               failover order: the primary, then standby coordinators */
  const char *token_hex;    /* the job's token */
  int rank;
  int nworkers;             /* checked against the coordinator's */
  int host_label;           /* sent for status; -1 = unknown */
  int timeout_ms;           /* hello, leave and status replies; 0 = 10000 */
  int request_timeout_ms;   /* waiting for a group; 0 = 300000 */
  int heartbeat_ms;         /* heartbeat period; 0 = 1000; negative = no heartbeat thread */
  void *zmq_context;        /* optional shared context (not owned); NULL = own context */
} rpl_gg_client_config;

typedef struct rpl_gg_client rpl_gg_client;

/* Connects and says HELLO (waiting up to timeout_ms): fails with RPL_ERR_PEER naming the
 * endpoint if the coordinator does not answer, RPL_ERR_INVALID on a wrong token or world size.
 * Starts the heartbeat thread ("rpl-gg-beat"). */
rpl_status rpl_gg_client_create(const rpl_gg_client_config *cfg, rpl_gg_client **out,
                                rpl_error *err);

/* The group of this worker's round `round`: blocks until the coordinator hands it (asking
 * again by itself after a cancellation) or request_timeout_ms passes (RPL_ERR_TIMEOUT; the
 * client then fences and unfences so nobody waits on it). members must hold nworkers ints.
 * When the adaptive period passes the round, *group_id is 0 and the group is this worker
 * alone (a no-op round; no done to send). */
rpl_status rpl_gg_client_request(rpl_gg_client *c, uint64_t round, int *members, int cap,
                                 int *n, uint64_t *group_id, rpl_error *err);
/* Nonzero once the coordinator is lost (heartbeats unanswered for dead_ms, or it no longer
 * knows this worker) and until this client registers again. Never blocks: any thread. */
int rpl_gg_client_lost(rpl_gg_client *c);
/* Reports group done (status 0 = reduced, else failed); fire-and-forget. */
rpl_status rpl_gg_client_done(rpl_gg_client *c, uint64_t group_id, uint32_t status,
                              rpl_error *err);
/* Fire-and-forget: messages from one client are processed in order, so a fence is in effect
 * for everything this worker asks afterwards. Neither waits for a request of this client that
 * is waiting for its group (another thread's): it is then skipped, since the coordinator counts
 * a worker that asks as available (the request unfenced it). */
rpl_status rpl_gg_client_fence(rpl_gg_client *c, rpl_error *err);
rpl_status rpl_gg_client_unfence(rpl_gg_client *c, rpl_error *err);
/* Tells the coordinator this worker is gone for good and waits for its ACK. */
rpl_status rpl_gg_client_leave(rpl_gg_client *c, rpl_error *err);
/* Stops the heartbeat thread and closes the sockets (no leave: call leave first). */
void rpl_gg_client_destroy(rpl_gg_client *c);

typedef struct rpl_gg_client_stats {
  uint64_t requests;
  uint64_t cancels;         /* requests cancelled by the coordinator and re-sent */
  uint64_t heartbeats_sent;
  uint64_t heartbeats_acked;
  uint32_t heartbeat_ms;    /* the heartbeat period in use (the coordinator's, bounded, or the
                               client's own if shorter); 0 before registering */
  uint32_t dead_ms;         /* heartbeats unanswered this long lose the coordinator (bounded) */
  double wait_s;            /* total time blocked in rpl_gg_client_request */
  uint64_t passes;          /* rounds the coordinator passed (the adaptive period) */
  uint32_t period;          /* the adaptive period in the coordinator's last answer (0 before
                               the first) */
  uint64_t failovers;       /* times the client registered again after losing its
                               coordinator (with the next endpoint of its list, or the same
                               one restarted) */
} rpl_gg_client_stats;
/* Never blocks: atomics only (safe while another thread waits in rpl_gg_client_request). */
void rpl_gg_client_get_stats(rpl_gg_client *c, rpl_gg_client_stats *out);

/* One-shot STATUS query (no client needed): fills *json (malloc'd, NUL-terminated, caller
 * frees) with the coordinator's state. */
rpl_status rpl_gg_query_status(const char *endpoint, const char *token_hex, int timeout_ms,
                               char **json, rpl_error *err);
/* The same for rank `rank`'s summary (its step and slowdown, and the slowest ranks':
 * coordinator/PROTOCOL.md, "Status document"), a few hundred bytes whatever the job's size.
 * `endpoints` may be a failover list: the first coordinator that serves the rank answers
 * (one that does not, a standby before failover, refuses with NOT_REGISTERED), each tried
 * for up to timeout_ms. */
rpl_status rpl_gg_query_rank_status(const char *endpoints, const char *token_hex, int rank,
                                    int timeout_ms, char **json, rpl_error *err);

#ifdef __cplusplus
}
#endif

#endif /* RPL_SCHED_H */
