/*
 * gg_sim: a discrete-event simulator that drives the real Group Generator policies
 * (csrc/sched, no coordinator I/O) with simulated workers, to compare policies and pick knobs.
 *
 * Model (times in units of one normal compute step):
 *   - a worker computes for 1.0 x U(0.95, 1.05) x its slowdown, then asks for a group;
 *   - every message (request, fence, unfence) reaches the GG after `gg_lat`, a handed group or
 *     a cancel reaches the worker after `gg_lat`; a cancelled worker asks again at once;
 *   - a group of g members reduces for alpha + beta * 2(g-1)/g, beta doubled if it spans hosts;
 *   - with --jitter J, every message and every member's end of a reduction comes U(0, J) later
 *     (noise of a busy machine: members say done apart, requests spread);
 *   - then every member reports done and computes again;
 *   - with --request-timeout T, a request not answered within T compute steps is given up, as
 *     the client does at its round timeout: the worker fences and unfences (dropping its
 *     place in every group), its round is skipped, and it computes on; a group the GG hands it
 *     later is not run, and its other members fail that round at their timeout;
 *   - with --overlap (wrap()'s default, ripples_pg.overlap), a worker sends its request and
 *     computes its next step at once; the round (its wait for partners, the reduction, the
 *     done) runs meanwhile, and the worker waits for it only if its next step ends first;
 *   - a request the GG's adaptive period passes (--period-max) ends the worker's round when
 *     the answer arrives (after `gg_lat`): no reduction, no done; it computes again;
 *   - with --exact-every K, after every K-th partial round the worker enters an exact
 *     collective: it fences (dynamic policies only, as the client does), waits for every
 *     worker to arrive (a global barrier), then for --exact-cost (default alpha: a small
 *     all-reduce such as a metric; it does not average the vectors below), and unfences --
 *     when the collective ends, or with --late-unfence (the first client) only through its
 *     next request. Then it computes again;
 *   - the GG's clock is the simulated time, one step = --step-ms milliseconds: it is advanced
 *     before every message, as the coordinator does, and at the next deadline the GG reports
 *     (rpl_gg_next_deadline), so waits for partners, the isolation bound's holds and the
 *     arrival filter act as in the coordinator.
 * Scenarios: homog; slow2 / slow5 (worker 0 always 2x / 5x slower); random (every worker is
 * 5x slower in a step with probability 1/n); --slow-factor F replaces the 5 of both; stall
 * (worker 0 stalls once, --stall S steps long, in its step 20: it comes back far behind); trace
 * (--trace FILE, a table from benchmarks/traces: worker w computes f[t][w] in its step t, as
 * benchmarks/trace_replay.py reads it -- column w mod columns, row t mod rows, each row divided
 * by its minimum over the columns used; no other noise).
 * "allreduce" is the global-barrier baseline.
 * Reported per run: rounds per worker per unit of simulated time, mean time a round waits for
 * its members (request -> group handed), conflicts per 1000 groups, singletons (share of
 * groups; share of rounds, over all workers and for the worst worker; longest run of groups of
 * one of a worker), passes (share of rounds the adaptive period passed), and consensus:
 * simulated time until the spread of a random vector averaged by the groups falls to 1e-3 and
 * 1e-6 of its start (the averaging the groups would do to models, without gradients).
 * Rounds count passed ones: rounds/worker/t is then steps per unit of time.
 *
 *   gg_sim [--workers N] [--per-host L] [--policy P|all] [--scenario S|all] [--rounds R]
 *          [--jitter J] [--slow-factor F] [--trace FILE]
 *          [--group-size G] [--c-thres C] [--inter-intra] [--seed S] [--json]
 *          [--exact-every K] [--exact-cost C] [--late-unfence] [--step-ms MS]
 *          [--partner-wait-ms MS] [--max-isolated M] [--arrival-filter 0|-1]
 *          [--speed-aware 0|-1] [--period-max P] [--old-policy]
 *          [--overlap] [--gg-stats]   (the GG's counters per run, on stderr)
 *   gg_sim --whatif --trace FILE [--workers N] [--rounds R]
 *          the trace through the what-if accounting alone (rpl_whatif): every worker computes
 *          its R steps at its own pace, nobody waits, and the accounting's numbers are printed
 *          as JSON beside trace_replay.py's ideal (tests/test_whatif.py compares them).
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpl_sched.h"

#define DIM 4

enum {
  EV_COMPUTE,   /* compute finished: the request travels to the GG */
  EV_REDUCE,    /* reduce finished: done, then compute or an exact collective */
  EV_REQUEST,   /* a request reaches the GG */
  EV_DEADLINE,  /* a wait in the GG ends (rpl_gg_next_deadline) */
  EV_FENCE,     /* a fence reaches the GG */
  EV_UNFENCE,   /* an unfence reaches the GG */
  EV_EXACT_END, /* the exact collective ends for this worker */
  EV_PASSED,    /* a pass reaches the worker: its round ends (no reduction, no done) */
  EV_TIMEOUT    /* --request-timeout: the worker gives its request up (gid: which one) */
};

typedef struct {
  double t;
  int worker;
  int kind;
  uint64_t gid;
  double gg_t; /* EV_DEADLINE: the deadline on the GG's clock (seconds) */
} sim_ev;

typedef struct {
  sim_ev *a;
  int n, cap;
} heap;

static void heap_push(heap *h, sim_ev e) {
  if (h->n == h->cap) {
    h->cap = h->cap ? 2 * h->cap : 1024;
    h->a = realloc(h->a, sizeof *h->a * (size_t)h->cap);
  }
  int i = h->n++;
  while (i > 0) {
    int p = (i - 1) / 2;
    if (h->a[p].t <= e.t) break;
    h->a[i] = h->a[p];
    i = p;
  }
  h->a[i] = e;
}

static sim_ev heap_pop(heap *h) {
  sim_ev top = h->a[0], last = h->a[--h->n];
  int i = 0;
  for (;;) {
    int l = 2 * i + 1, r = l + 1, m = i;
    double mt = last.t;
    if (l < h->n && h->a[l].t < mt) { m = l; mt = h->a[l].t; }
    if (r < h->n && h->a[r].t < mt) m = r;
    if (m == i) break;
    h->a[i] = h->a[m];
    i = m;
  }
  if (h->n > 0) h->a[i] = last;
  return top;
}

static uint64_t rs;
static double urand(void) {
  rs = rs * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(rs >> 11) * (1.0 / 9007199254740992.0);
}

typedef struct {
  int workers, per_host, rounds, group_size, c_thres, inter_intra, json, gg_stats;
  uint64_t seed;
  double gg_lat, alpha, beta;
  double jitter;              /* extra delay U(0, jitter) on every message and reduce end */
  double slow_factor;         /* slow5 and random: the slow compute's factor (default 5) */
  int exact_every;            /* an exact collective after every K-th partial round; 0 = none */
  double exact_cost;          /* its duration after the last worker arrives; < 0 = alpha */
  int late_unfence;           /* unfence only through the next request (the first client) */
  double step_ms;             /* one compute step on the GG's clock */
  int partner_wait_ms, max_isolated, arrival_filter; /* rpl_gg_config; 0 = default */
  int speed_aware;            /* rpl_gg_config; 0 = on (default), negative = the previous rules */
  int period_max;             /* rpl_gg_config; 0 = default, 1 or negative = every request */
  const double *trace;        /* --trace: rows x workers factors (row-major), NULL if none */
  int trace_rows;
  int overlap;                /* rounds behind the next step's compute (--overlap) */
  int whatif;                 /* --whatif: the trace through the accounting alone */
  double stall;               /* stall: the one stall's length in compute steps */
  double request_timeout;     /* a request not answered within this gives up; 0 = never */
} params;

typedef struct {
  double rounds_per_time, mean_wait, conflicts_per_k, singleton_frac, t_1e3, t_1e6, sim_time;
  double slowest_rounds_per_time;
  double median_rounds_per_time;     /* the median worker's rounds per unit of time */
  double single_share, single_worst; /* groups of one per round: all workers, worst worker */
  unsigned run_max;                  /* longest run of groups of one of a worker */
  double pass_share;                 /* rounds the adaptive period passed, all workers */
  rpl_gg_stats gg;                   /* the GG's counters (--gg-stats) */
  double w0_grouped;                 /* worker 0: share of its rounds in a group of 2+ */
  double w0_wait_max;                /* worker 0: its longest request -> group handed */
  uint64_t w0_rounds;                /* worker 0's rounds */
  uint64_t timeouts, failed;         /* --request-timeout: requests given up, rounds failed */
} result;

enum { SC_HOMOG, SC_SLOW2, SC_SLOW5, SC_RANDOM, SC_STALL, SC_TRACE, SC_COUNT };
static const char *sc_names[] = {"homog", "slow2", "slow5", "random", "stall", "trace"};

/* stall: worker 0 stalls once, for --stall steps (default 40), in its step STALL_AT. */
#define STALL_AT 20

/* Worker w's compute in its step k (0-based). */
static double compute_time(const params *p, int sc, int w, uint64_t k) {
  if (sc == SC_TRACE) return p->trace[(k % (uint64_t)p->trace_rows) * (uint64_t)p->workers + w];
  double t = 0.95 + 0.1 * urand();
  if ((sc == SC_SLOW2 && w == 0)) t *= 2;
  if ((sc == SC_SLOW5 && w == 0)) t *= p->slow_factor;
  if (sc == SC_RANDOM && urand() < 1.0 / p->workers) t *= p->slow_factor;
  if (sc == SC_STALL && w == 0 && k == STALL_AT) t += p->stall; /* once, then even again */
  return t;
}

/* Reads a factor table (a table of benchmarks/traces: '#' lines, a header, then one row of
 * positive numbers per step) into p->trace for p->workers workers: column w mod columns, each
 * row divided by its minimum over them. Returns 0, or -1 with a message on stderr. */
static int load_trace(params *p, const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "gg_sim: --trace %s: cannot open it\n", path);
    return -1;
  }
  char line[1 << 14];
  int cols = 0, rows = 0, cap = 0, rc = 0;
  double *tab = NULL, row[1024];
  while (rc == 0 && fgets(line, sizeof line, f)) {
    if (line[0] == '#' || line[0] == '\n') continue;
    if (cols == 0) { /* the header: count the columns */
      cols = 1;
      for (const char *c = line; *c; c++) cols += *c == ',';
      if (cols > (int)(sizeof row / sizeof *row)) rc = -1;
      continue;
    }
    int k = 0;
    char *c = line, *end;
    double lo = 0;
    while (k < cols) {
      row[k] = strtod(c, &end);
      if (end == c || !(row[k] > 0)) break;
      k++;
      c = end + (*end == ',');
    }
    if (k != cols) {
      fprintf(stderr, "gg_sim: --trace %s: row %d needs %d positive numbers\n", path,
              rows + 1, cols);
      rc = -1;
      break;
    }
    if (rows == cap) {
      cap = cap ? 2 * cap : 256;
      tab = realloc(tab, sizeof *tab * (size_t)cap * (size_t)p->workers);
    }
    for (int w = 0; w < p->workers; w++)
      if (w == 0 || row[w % cols] < lo) lo = row[w % cols];
    for (int w = 0; w < p->workers; w++)
      tab[(size_t)rows * (size_t)p->workers + (size_t)w] = row[w % cols] / lo;
    rows++;
  }
  fclose(f);
  if (rc == 0 && rows == 0) {
    fprintf(stderr, "gg_sim: --trace %s: no rows (or more than %zu columns)\n", path,
            sizeof row / sizeof *row);
    rc = -1;
  }
  if (rc != 0) {
    free(tab);
    return -1;
  }
  p->trace = tab;
  p->trace_rows = rows;
  return 0;
}

/* The trace's ideal speed-up over all-reduce over the steps all-reduce runs (--rounds, the
 * rows looped; trace_replay.py's ideal_speedup): the sum of every step's slowest worker over
 * the harmonic mean of the workers' totals. */
static double trace_ideal(const params *p) {
  double ddp = 0, inv = 0;
  for (int k = 0; k < p->rounds; k++) {
    const double *row = p->trace + (size_t)(k % p->trace_rows) * (size_t)p->workers;
    double mx = 0;
    for (int w = 0; w < p->workers; w++)
      if (row[w] > mx) mx = row[w];
    ddp += mx;
  }
  for (int w = 0; w < p->workers; w++) {
    double own = 0;
    for (int k = 0; k < p->rounds; k++)
      own += p->trace[(size_t)(k % p->trace_rows) * (size_t)p->workers + (size_t)w];
    inv += 1.0 / own;
  }
  return ddp * inv / p->workers;
}

/* --whatif: each worker computes its --rounds steps of the trace at its own pace (reported in
 * the order they end, so fast workers run ahead as they would with nobody waiting) into an
 * rpl_whatif, whose numbers are printed as JSON with trace_ideal's. */
static int run_whatif(const params *p) {
  rpl_whatif *a = NULL;
  rpl_error err = {0};
  double *t = calloc((size_t)p->workers, sizeof *t);
  uint64_t *k = calloc((size_t)p->workers, sizeof *k);
  if (!t || !k || rpl_whatif_create(p->workers, &a, &err) != RPL_OK) {
    fprintf(stderr, "gg_sim: %s\n", err.msg[0] ? err.msg : "out of memory");
    free(t);
    free(k);
    return 1;
  }
  for (;;) {
    int next = -1;
    for (int w = 0; w < p->workers; w++) {
      if (k[w] >= (uint64_t)p->rounds) continue;
      double end = t[w] + p->trace[(size_t)(k[w] % (uint64_t)p->trace_rows) * (size_t)p->workers +
                                   (size_t)w];
      if (next < 0 || end < t[next] + p->trace[(size_t)(k[next] % (uint64_t)p->trace_rows) *
                                                   (size_t)p->workers + (size_t)next])
        next = w;
    }
    if (next < 0) break;
    double f = p->trace[(size_t)(k[next] % (uint64_t)p->trace_rows) * (size_t)p->workers +
                        (size_t)next];
    t[next] += f;
    k[next]++;
    rpl_whatif_step(a, next, f, t[next]);
  }
  rpl_whatif_summary s;
  rpl_whatif_get(a, &s);
  printf("{\"workers\":%d,\"rounds\":%d,\"trace_ideal_speedup\":%.17g,\"gain\":%.17g,"
         "\"allreduce_step\":%.17g,\"free_step\":%.17g,\"waste\":%.17g,\"saved\":%.17g,"
         "\"steps\":%llu,\"job_steps\":%llu,\"cost_s\":[",
         p->workers, p->rounds, trace_ideal(p), s.gain, s.allreduce_step, s.free_step, s.waste,
         s.saved, (unsigned long long)s.steps, (unsigned long long)s.job_steps);
  for (int w = 0; w < p->workers; w++) {
    rpl_whatif_worker_info wi;
    rpl_whatif_worker(a, w, &wi, &err);
    printf("%s%.17g", w ? "," : "", wi.cost_s);
  }
  printf("]}\n");
  rpl_whatif_destroy(a);
  free(t);
  free(k);
  return 0;
}

static double spread(double (*x)[DIM], int n) {
  double mean[DIM] = {0}, s = 0;
  for (int w = 0; w < n; w++)
    for (int d = 0; d < DIM; d++) mean[d] += x[w][d] / n;
  for (int w = 0; w < n; w++)
    for (int d = 0; d < DIM; d++) s += (x[w][d] - mean[d]) * (x[w][d] - mean[d]);
  return s;
}

static double reduce_time(const params *p, const int *m, int g) {
  if (g <= 1) return 0;
  int cross = 0;
  for (int i = 1; i < g; i++) cross |= m[i] / p->per_host != m[0] / p->per_host;
  return p->alpha + p->beta * (cross ? 2.0 : 1.0) * 2.0 * (g - 1) / g;
}

static double exact_cost(const params *p) { return p->exact_cost < 0 ? p->alpha : p->exact_cost; }

static int run_allreduce(const params *p, int sc, result *r) {
  int n = p->workers;
  double t = 0;
  int *all = malloc(sizeof(int) * (size_t)n);
  for (int i = 0; i < n; i++) all[i] = i;
  double waits = 0;
  for (int k = 0; k < p->rounds; k++) {
    double mx = 0, sum = 0;
    for (int w = 0; w < n; w++) {
      double c = compute_time(p, sc, w, (uint64_t)k);
      sum += c;
      if (c > mx) mx = c;
    }
    waits += mx * n - sum;
    t += mx + reduce_time(p, all, n);
    if (p->exact_every > 0 && (k + 1) % p->exact_every == 0) t += exact_cost(p);
  }
  free(all);
  memset(r, 0, sizeof *r);
  r->sim_time = t;
  r->rounds_per_time = p->rounds / t;
  r->slowest_rounds_per_time = r->median_rounds_per_time = r->rounds_per_time;
  r->mean_wait = waits / ((double)n * p->rounds);
  r->t_1e3 = r->t_1e6 = t / p->rounds; /* one global average reaches consensus */
  return 0;
}

/* ---- the simulated job around one GG ------------------------------------------------------ */

typedef struct {
  const params *p;
  int sc, n;
  int fences;                  /* the client fences only for dynamic schedules */
  rpl_gg *gg;
  heap h;
  double now;
  double deadline_ev;          /* time of the earliest EV_DEADLINE queued, < 0 if none */
  double(*x)[DIM];
  double s0, next_check, t_1e3, t_1e6;
  uint64_t *round;
  double *asked;
  double *sent;                /* arrival of each worker's last message at the GG: in order */
  int *members;
  int arrived;                 /* workers inside the current exact collective */
  double waits;
  uint64_t done_rounds, min_done;
  uint64_t passes;             /* rounds that ended with a pass */
  uint64_t *computed;          /* --overlap: steps each worker has started */
  uint8_t *inflight, *blocked; /* --overlap: a round in flight; its next step ended first */
  uint8_t *req_open;           /* --request-timeout: its request is waiting for an answer */
  uint64_t *req_tok;           /* ... and which request it is */
  uint64_t timeouts, failed;   /* requests given up; rounds of a group with such a member */
  uint64_t w0_grouped;         /* worker 0's rounds in a group of two or more */
  double w0_wait_max;          /* worker 0's longest wait for its group */
} sim;

static void push(sim *s, double t, int w, int kind, uint64_t gid) {
  heap_push(&s->h, (sim_ev){t, w, kind, gid, 0});
}

/* A message of w to the GG, sent now: it arrives after gg_lat (+ jitter), after w's previous
 * one (a worker's messages keep their order, as over its socket). */
static void send_msg(sim *s, int w, int kind) {
  double t = s->now + s->p->gg_lat + (s->p->jitter > 0 ? s->p->jitter * urand() : 0);
  if (t <= s->sent[w]) t = s->sent[w] + 1e-9;
  s->sent[w] = t;
  push(s, t, w, kind, 0);
}

static void check_consensus(sim *s) {
  if (s->now < s->next_check || s->t_1e6 >= 0) return;
  double sp = spread(s->x, s->n) / s->s0;
  if (s->t_1e3 < 0 && sp <= 1e-3) s->t_1e3 = s->now;
  if (s->t_1e6 < 0 && sp <= 1e-6) s->t_1e6 = s->now;
  s->next_check = s->now + 0.25;
}

/* Whether a member of the group just handed (s->members) has given its request up. */
static int stale_member(sim *s, int n) {
  for (int i = 0; i < n; i++)
    if (!s->req_open[s->members[i]]) return 1;
  return 0;
}

/* Delivers what the GG produced: groups start reducing (and average the vectors once per
 * group), cancelled workers ask again. Then queues an event at the GG's next deadline. */
static void drain(sim *s) {
  const params *p = s->p;
  rpl_gg_event ev;
  uint64_t last_gid = 0, poison_gid = 0;
  int handed = 0, poisoned = 0;
  while (rpl_gg_poll(s->gg, &ev, s->members, s->n)) {
    if (ev.kind == RPL_EV_CANCEL) {
      if (p->request_timeout > 0 && !s->req_open[ev.worker]) continue; /* given up already */
      push(s, s->now + 2 * p->gg_lat, ev.worker, EV_REQUEST, 0);
      continue;
    }
    if (p->request_timeout > 0 && ev.kind == RPL_EV_GROUP && ev.group_id != poison_gid) {
      poison_gid = ev.group_id; /* a group's members' events come together: judge it once */
      poisoned = stale_member(s, ev.nmembers);
    }
    if (p->request_timeout > 0 && !s->req_open[ev.worker]) continue; /* given up: dropped */
    if (p->request_timeout > 0 && ev.kind == RPL_EV_GROUP && poisoned) {
      /* A member gave its request up and will not come (the client drops the late answer):
       * the others wait for it in the exchange until the round's timeout, and fail it. */
      s->req_open[ev.worker] = 0;
      s->failed++;
      push(s, s->now + p->gg_lat + p->request_timeout, ev.worker, EV_REDUCE, ev.group_id);
      continue;
    }
    if (p->request_timeout > 0) s->req_open[ev.worker] = 0;
    if (ev.kind == RPL_EV_PASS) { /* a no-op round: it ends once the answer arrives */
      s->waits += s->now + p->gg_lat - s->asked[ev.worker];
      push(s, s->now + p->gg_lat, ev.worker, EV_PASSED, 0);
      continue;
    }
    double dur = reduce_time(p, s->members, ev.nmembers);
    if (p->jitter > 0) dur += p->jitter * urand(); /* members end (and say done) apart */
    s->waits += s->now + p->gg_lat - s->asked[ev.worker];
    if (ev.worker == 0) {
      double wt = s->now + p->gg_lat - s->asked[0];
      if (wt > s->w0_wait_max) s->w0_wait_max = wt;
      s->w0_grouped += ev.nmembers > 1;
    }
    push(s, s->now + p->gg_lat + dur, ev.worker, EV_REDUCE, ev.group_id);
    if (ev.group_id != last_gid) { /* members' events come together: average once */
      last_gid = ev.group_id;
      handed = 1;
      double avg[DIM] = {0};
      for (int i = 0; i < ev.nmembers; i++)
        for (int d = 0; d < DIM; d++) avg[d] += s->x[s->members[i]][d] / ev.nmembers;
      for (int i = 0; i < ev.nmembers; i++) memcpy(s->x[s->members[i]], avg, sizeof avg);
    }
  }
  if (handed) check_consensus(s);
  double d = rpl_gg_next_deadline(s->gg);
  if (d < 0) return;
  double t = d * 1000.0 / p->step_ms;
  if (t < s->now) t = s->now;
  if (s->deadline_ev >= 0 && s->deadline_ev <= t) return;
  heap_push(&s->h, (sim_ev){t, -1, EV_DEADLINE, 0, d});
  s->deadline_ev = t;
}

/* w's step is computed: it asks for its round; with --overlap it computes its next step
 * meanwhile. */
static void start_round(sim *s, int w) {
  const params *p = s->p;
  send_msg(s, w, EV_REQUEST);
  s->asked[w] = s->now;
  if (p->request_timeout > 0) {
    s->req_open[w] = 1;
    push(s, s->now + p->request_timeout, w, EV_TIMEOUT, ++s->req_tok[w]);
  }
  if (!p->overlap) return;
  s->inflight[w] = 1;
  push(s, s->now + compute_time(p, s->sc, w, ++s->computed[w]), w, EV_COMPUTE, 0);
}

/* Done with a partial round: compute again, or enter the exact collective (a barrier). With
 * --overlap the next step is computing already: start the next round if it ended. */
static void after_round(sim *s, int w) {
  const params *p = s->p;
  if (p->overlap) {
    s->inflight[w] = 0;
    if (s->blocked[w]) {
      s->blocked[w] = 0;
      start_round(s, w);
    }
    return;
  }
  if (p->exact_every <= 0 || s->round[w] % (uint64_t)p->exact_every != 0) {
    push(s, s->now + compute_time(p, s->sc, w, s->round[w]), w, EV_COMPUTE, 0);
    return;
  }
  if (s->fences) send_msg(s, w, EV_FENCE);
  if (++s->arrived < s->n) return;
  s->arrived = 0; /* the last one is in: everyone leaves together */
  for (int v = 0; v < s->n; v++) push(s, s->now + exact_cost(p), v, EV_EXACT_END, 0);
}

static void update_min_done(sim *s, int w) {
  if (w != 0 && s->round[w] > s->min_done + 1) return;
  uint64_t mn = UINT64_MAX;
  for (int v = 0; v < s->n; v++)
    if (s->round[v] < mn) mn = s->round[v];
  s->min_done = mn;
}

/* A partial round of w ended (reduced, alone or passed). */
static void end_round(sim *s, int w) {
  s->round[w]++;
  s->done_rounds++;
  update_min_done(s, w);
  after_round(s, w);
}

/* One event. The GG's clock is advanced before every message, as the coordinator does. */
static int step(sim *s, sim_ev e) {
  const params *p = s->p;
  rpl_error err;
  rpl_status st = RPL_OK;
  int w = e.worker;
  s->now = e.t;
  double clock = e.kind == EV_DEADLINE ? e.gg_t : s->now * p->step_ms / 1000.0;
  switch (e.kind) {
    case EV_COMPUTE:
      if (p->overlap && s->inflight[w]) { /* the last round is not over: wait for it */
        s->blocked[w] = 1;
        return 0;
      }
      start_round(s, w);
      return 0;
    case EV_PASSED: /* nothing goes to the GG: a pass needs no done */
      s->passes++;
      end_round(s, w);
      return 0;
    case EV_EXACT_END:
      if (s->fences && !p->late_unfence) send_msg(s, w, EV_UNFENCE);
      push(s, s->now + compute_time(p, s->sc, w, s->round[w]), w, EV_COMPUTE, 0);
      return 0;
    case EV_DEADLINE:
      if (s->deadline_ev == e.t) s->deadline_ev = -1;
      break;
    case EV_TIMEOUT: /* as the client: drop its place in every group, and move on */
      if (!s->req_open[w] || s->req_tok[w] != e.gid) return 0;
      s->req_open[w] = 0;
      s->timeouts++;
      send_msg(s, w, EV_FENCE);
      send_msg(s, w, EV_UNFENCE);
      end_round(s, w);
      return 0;
    default: break;
  }
  st = rpl_gg_advance(s->gg, clock, &err);
  if (st == RPL_OK) {
    switch (e.kind) {
      case EV_REDUCE:
        st = rpl_gg_done(s->gg, w, e.gid, &err);
        end_round(s, w);
        break;
      case EV_REQUEST: st = rpl_gg_request(s->gg, w, s->round[w], &err); break;
      case EV_FENCE: st = rpl_gg_fence(s->gg, w, &err); break;
      case EV_UNFENCE: st = rpl_gg_unfence(s->gg, w, &err); break;
      default: break;
    }
  }
  if (st != RPL_OK) {
    fprintf(stderr, "gg_sim: %s\n", err.msg);
    return -1;
  }
  drain(s);
  return 0;
}

static void collect(sim *s, result *r) {
  rpl_gg_stats st;
  rpl_gg_get_stats(s->gg, &st);
  memset(r, 0, sizeof *r);
  r->sim_time = s->now;
  r->rounds_per_time = (double)s->done_rounds / s->n / s->now;
  uint64_t mn = UINT64_MAX, singles = 0, handed = 0;
  for (int w = 0; w < s->n; w++) {
    if (s->round[w] < mn) mn = s->round[w];
    rpl_gg_worker_info info;
    rpl_error err;
    if (rpl_gg_worker(s->gg, w, &info, &err) != RPL_OK) continue;
    singles += info.singletons;
    handed += info.handed;
    double share = info.handed ? (double)info.singletons / (double)info.handed : 0;
    if (share > r->single_worst) r->single_worst = share;
    if (info.lonely_max > r->run_max) r->run_max = info.lonely_max;
  }
  r->single_share = handed ? (double)singles / (double)handed : 0;
  r->pass_share = s->done_rounds ? (double)s->passes / (double)s->done_rounds : 0;
  r->slowest_rounds_per_time = (double)mn / s->now;
  {
    uint64_t *rr = malloc(sizeof *rr * (size_t)s->n);
    for (int w = 0; w < s->n; w++) rr[w] = s->round[w];
    for (int i = 1; i < s->n; i++) /* insertion sort: n is small or the run is long anyway */
      for (int j = i; j > 0 && rr[j - 1] > rr[j]; j--) {
        uint64_t t = rr[j];
        rr[j] = rr[j - 1];
        rr[j - 1] = t;
      }
    r->median_rounds_per_time = (double)rr[(s->n - 1) / 2] / s->now;
    free(rr);
  }
  r->mean_wait = s->done_rounds ? s->waits / (double)s->done_rounds : 0;
  r->conflicts_per_k =
      st.groups_created ? 1000.0 * (double)st.conflicts / (double)st.groups_created : 0;
  r->singleton_frac =
      st.groups_handed ? (double)st.singletons_handed / (double)st.groups_handed : 0;
  r->t_1e3 = s->t_1e3;
  r->t_1e6 = s->t_1e6;
  r->gg = st;
  r->w0_grouped = s->round[0] ? (double)s->w0_grouped / (double)s->round[0] : 0;
  r->w0_wait_max = s->w0_wait_max;
  r->w0_rounds = s->round[0];
  r->timeouts = s->timeouts;
  r->failed = s->failed;
}

static int run_policy(const params *p, rpl_policy pol, int sc, result *r) {
  int n = p->workers;
  int *labels = malloc(sizeof(int) * (size_t)n);
  for (int w = 0; w < n; w++) labels[w] = w / p->per_host;
  rpl_gg_config cfg = {0};
  cfg.policy = pol;
  cfg.nworkers = n;
  cfg.host_of = labels;
  cfg.group_size = p->group_size;
  cfg.c_thres = p->c_thres;
  cfg.inter_intra = p->inter_intra;
  cfg.partner_wait_ms = p->partner_wait_ms;
  cfg.max_isolated = p->max_isolated;
  cfg.arrival_filter = p->arrival_filter;
  cfg.speed_aware = p->speed_aware;
  cfg.period_max = p->period_max;
  cfg.seed = p->seed;
  sim s = {0};
  rpl_error err;
  if (rpl_gg_create(&cfg, &s.gg, &err) != RPL_OK) {
    fprintf(stderr, "gg_sim: %s\n", err.msg);
    free(labels);
    return -1;
  }
  s.p = p;
  s.sc = sc;
  s.n = n;
  s.fences = pol != RPL_POLICY_STATIC;
  s.deadline_ev = -1;
  s.t_1e3 = s.t_1e6 = -1;
  s.x = malloc(sizeof *s.x * (size_t)n);
  for (int w = 0; w < n; w++)
    for (int d = 0; d < DIM; d++) s.x[w][d] = urand();
  s.s0 = spread(s.x, n);
  s.round = calloc((size_t)n, sizeof *s.round);
  s.asked = calloc((size_t)n, sizeof *s.asked);
  s.sent = calloc((size_t)n, sizeof *s.sent);
  s.members = malloc(sizeof(int) * (size_t)n);
  s.computed = calloc((size_t)n, sizeof *s.computed);
  s.req_open = calloc((size_t)n, 1);
  s.req_tok = calloc((size_t)n, sizeof *s.req_tok);
  s.inflight = calloc((size_t)n, 1);
  s.blocked = calloc((size_t)n, 1);
  for (int w = 0; w < n; w++) push(&s, compute_time(p, sc, w, 0), w, EV_COMPUTE, 0);
  uint64_t target = (uint64_t)p->rounds * (uint64_t)n;
  int rc = 0;
  while (s.h.n > 0 && s.min_done < (uint64_t)p->rounds && s.done_rounds < 4 * target && rc == 0)
    rc = step(&s, heap_pop(&s.h));
  if (rc == 0 && s.min_done < (uint64_t)p->rounds && s.done_rounds < 4 * target) {
    fprintf(stderr, "gg_sim: %s/%s stalled at t=%.2f (slowest worker at round %llu)\n",
            rpl_policy_name(pol), sc_names[sc], s.now, (unsigned long long)s.min_done);
    rc = -1;
  }
  if (rc == 0) collect(&s, r);
  rpl_gg_destroy(s.gg);
  free(s.x);
  free(s.round);
  free(s.asked);
  free(s.sent);
  free(s.members);
  free(s.computed);
  free(s.req_open);
  free(s.req_tok);
  free(s.inflight);
  free(s.blocked);
  free(s.h.a);
  free(labels);
  return rc;
}

/* One row: a line of the table, or an object of the JSON list. */
static void report(const params *p, const char *pol, int sc, const result *r, int first,
                   int gg_stats) {
  if (p->json)
    printf("%s\n {\"policy\":\"%s\",\"scenario\":\"%s\",\"workers\":%d,\"per_host\":%d,"
           "\"group_size\":%d,\"c_thres\":%d,\"exact_every\":%d,\"late_unfence\":%d,"
           "\"partner_wait_ms\":%d,\"max_isolated\":%d,\"arrival_filter\":%d,"
           "\"period_max\":%d,\"speed_aware\":%d,"
           "\"jitter\":%g,\"slow_factor\":%g,"
           "\"step_ms\":%g,\"rounds_per_worker_per_time\":%.5f,"
           "\"slowest_rounds_per_time\":%.5f,\"median_rounds_per_time\":%.5f,"
           "\"mean_wait_per_round\":%.5f,"
           "\"conflicts_per_1000_groups\":%.2f,\"singleton_fraction\":%.4f,"
           "\"singleton_share_rounds\":%.4f,\"singleton_share_worst\":%.4f,"
           "\"singleton_run_max\":%u,\"pass_share_rounds\":%.4f,"
           "\"consensus_time_1e3\":%.3f,\"consensus_time_1e6\":%.3f,\"sim_time\":%.2f,"
           "\"trace_ideal_speedup\":%.4f,\"overlap\":%d,\"worker0_grouped_share\":%.4f,"
           "\"worker0_wait_max\":%.3f,\"worker0_rounds\":%llu,\"timeouts\":%llu,"
           "\"failed_rounds\":%llu}",
           first ? "" : ",", pol, sc_names[sc], p->workers, p->per_host, p->group_size,
           p->c_thres, p->exact_every, p->late_unfence, p->partner_wait_ms, p->max_isolated,
           p->arrival_filter, p->period_max, p->speed_aware, p->jitter, p->slow_factor, p->step_ms,
           r->rounds_per_time, r->slowest_rounds_per_time, r->median_rounds_per_time,
           r->mean_wait, r->conflicts_per_k,
           r->singleton_frac, r->single_share, r->single_worst, r->run_max, r->pass_share,
           r->t_1e3, r->t_1e6, r->sim_time, sc == SC_TRACE ? trace_ideal(p) : 0.0, p->overlap,
           r->w0_grouped, r->w0_wait_max, (unsigned long long)r->w0_rounds,
           (unsigned long long)r->timeouts, (unsigned long long)r->failed);
  else
    printf("%-9s %-7s %6d %10.4f %10.4f %6.2f %9.4f %9.2f %8.4f %7.4f %7.4f %4u %6.4f %9.2f "
           "%9.2f\n",
           pol, sc_names[sc], p->workers, r->rounds_per_time, r->slowest_rounds_per_time,
           r->slowest_rounds_per_time > 0 ? r->median_rounds_per_time / r->slowest_rounds_per_time
                                          : 0,
           r->mean_wait, r->conflicts_per_k, r->singleton_frac, r->single_share,
           r->single_worst, r->run_max, r->pass_share, r->t_1e3, r->t_1e6);
  fflush(stdout);
  if (gg_stats)
    fprintf(stderr,
            "  gg: requests %llu deferred %llu wait_expired %llu isolation_holds %llu "
            "joins %llu late %llu filtered %llu cancelled %llu passes %llu period_drops %llu "
            "period %u late_dropped %llu\n",
            (unsigned long long)r->gg.requests, (unsigned long long)r->gg.deferred,
            (unsigned long long)r->gg.wait_expired, (unsigned long long)r->gg.isolation_holds,
            (unsigned long long)r->gg.joins, (unsigned long long)r->gg.late,
            (unsigned long long)r->gg.filtered, (unsigned long long)r->gg.groups_cancelled,
            (unsigned long long)r->gg.passes, (unsigned long long)r->gg.period_drops,
            (unsigned)r->gg.period, (unsigned long long)r->gg.late_dropped);
}

static void usage(void) {
  fprintf(stderr,
          "usage: gg_sim [--workers N] [--per-host L] [--policy P|all|allreduce] "
          "[--scenario homog|slow2|slow5|random|all] [--rounds R] [--group-size G] "
          "[--c-thres C] [--inter-intra] [--seed S] [--gg-lat T] [--alpha A] [--beta B] "
          "[--jitter J] [--slow-factor F] [--stall S] [--request-timeout T] [--trace FILE] "
          "[--exact-every K] [--exact-cost C] [--late-unfence] [--step-ms MS] "
          "[--partner-wait-ms MS] [--max-isolated M] [--arrival-filter 0|-1] "
          "[--speed-aware 0|-1] [--period-max P] [--old-policy] [--overlap] [--json] "
          "[--gg-stats]\n"
          "       gg_sim --whatif --trace FILE [--workers N] [--rounds R]\n"
          "  --old-policy = --partner-wait-ms -1 --max-isolated -1 --arrival-filter -1 "
          "--period-max 1 --late-unfence (the first implementation)\n");
}

/* The options that take a number: each sets one field of params, read as an int (atoi), a
 * double (atof) or, for the seed, an unsigned 64-bit integer in any base strtoull reads. */
typedef struct {
  const char *flag;
  size_t off;
  char kind; /* 'i' int, 'd' double, 'u' uint64_t */
} num_opt;
#define NUM_OPT(flag, field, kind) {flag, offsetof(params, field), kind}
static const num_opt k_num_opts[] = {
    NUM_OPT("--workers", workers, 'i'),
    NUM_OPT("--per-host", per_host, 'i'),
    NUM_OPT("--rounds", rounds, 'i'),
    NUM_OPT("--group-size", group_size, 'i'),
    NUM_OPT("--c-thres", c_thres, 'i'),
    NUM_OPT("--seed", seed, 'u'),
    NUM_OPT("--gg-lat", gg_lat, 'd'),
    NUM_OPT("--jitter", jitter, 'd'),
    NUM_OPT("--slow-factor", slow_factor, 'd'),
    NUM_OPT("--stall", stall, 'd'),
    NUM_OPT("--request-timeout", request_timeout, 'd'),
    NUM_OPT("--alpha", alpha, 'd'),
    NUM_OPT("--beta", beta, 'd'),
    NUM_OPT("--exact-every", exact_every, 'i'),
    NUM_OPT("--exact-cost", exact_cost, 'd'),
    NUM_OPT("--step-ms", step_ms, 'd'),
    NUM_OPT("--partner-wait-ms", partner_wait_ms, 'i'),
    NUM_OPT("--max-isolated", max_isolated, 'i'),
    NUM_OPT("--arrival-filter", arrival_filter, 'i'),
    NUM_OPT("--speed-aware", speed_aware, 'i'),
    NUM_OPT("--period-max", period_max, 'i'),
};

static const num_opt *find_num_opt(const char *flag) {
  for (size_t k = 0; k < sizeof k_num_opts / sizeof *k_num_opts; k++)
    if (!strcmp(flag, k_num_opts[k].flag)) return &k_num_opts[k];
  return NULL;
}

static void set_num_opt(params *p, const num_opt *o, const char *v) {
  char *field = (char *)p + o->off;
  if (o->kind == 'i') *(int *)field = atoi(v);
  else if (o->kind == 'd') *(double *)field = atof(v);
  else *(uint64_t *)field = strtoull(v, NULL, 0);
}

/* The flags that take no number or a name; returns 0, or 2 after the usage on a bad one. */
static int parse_args(int argc, char **argv, params *p, const char **policy,
                      const char **scenario, const char **trace) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
    const num_opt *o = find_num_opt(a);
    if (o) {
      set_num_opt(p, o, v);
      i++;
    } else if (!strcmp(a, "--policy")) *policy = v, i++;
    else if (!strcmp(a, "--scenario")) *scenario = v, i++;
    else if (!strcmp(a, "--trace")) *trace = v, i++;
    else if (!strcmp(a, "--late-unfence")) p->late_unfence = 1;
    else if (!strcmp(a, "--old-policy")) {
      p->partner_wait_ms = p->max_isolated = p->arrival_filter = -1;
      p->period_max = 1; /* it averaged at every request */
      p->late_unfence = 1;
    } else if (!strcmp(a, "--inter-intra")) p->inter_intra = 1;
    else if (!strcmp(a, "--json")) p->json = 1;
    else if (!strcmp(a, "--gg-stats")) p->gg_stats = 1;
    else if (!strcmp(a, "--overlap")) p->overlap = 1;
    else if (!strcmp(a, "--whatif")) p->whatif = 1;
    else {
      usage();
      return 2;
    }
  }
  return 0;
}

int main(int argc, char **argv) {
  params p = {.workers = 16, .per_host = 4, .rounds = 200, .seed = 1, .gg_lat = 0.002,
              .alpha = 0.02, .beta = 0.1, .exact_cost = -1, .step_ms = 100, .slow_factor = 5,
              .stall = 40};
  const char *policy = "all", *scenario = "all", *trace = NULL;
  if (parse_args(argc, argv, &p, &policy, &scenario, &trace)) return 2;
  if (p.overlap && p.exact_every > 0) {
    fprintf(stderr, "gg_sim: --overlap does not model exact collectives (--exact-every)\n");
    return 2;
  }
  if (p.workers < 2 || p.per_host < 1 || p.rounds < 1 || p.exact_every < 0 || p.step_ms <= 0) {
    fprintf(stderr, "gg_sim: need --workers >= 2, --per-host >= 1, --rounds >= 1, "
                    "--exact-every >= 0, --step-ms > 0\n");
    return 2;
  }
  if (trace) {
    if (p.workers > 4096) {
      fprintf(stderr, "gg_sim: --trace needs --workers <= 4096\n");
      return 2;
    }
    if (load_trace(&p, trace) != 0) return 2;
    if (p.whatif) {
      int rc = run_whatif(&p);
      free((void *)p.trace);
      return rc;
    }
    if (!strcmp(scenario, "all")) scenario = "trace";
  } else if (!strcmp(scenario, "trace") || p.whatif) {
    fprintf(stderr, "gg_sim: --scenario trace and --whatif need --trace FILE\n");
    return 2;
  }
  const char *pols[] = {"allreduce", "static", "random", "smart", "smart+ii", "adpsgd"};
  int first = 1;
  if (p.json) printf("[");
  else
    printf("%-9s %-7s %6s %10s %10s %6s %9s %9s %8s %7s %7s %4s %6s %9s %9s\n", "policy",
           "scen", "n", "rnd/w/t", "slowest", "med/sl", "wait/rnd", "confl/1k", "single", "1/rnd", "worst1", "run",
           "pass", "t(1e-3)", "t(1e-6)");
  for (size_t pi = 0; pi < sizeof pols / sizeof *pols; pi++) {
    if (strcmp(policy, "all") && strcmp(policy, pols[pi])) continue;
    for (int sc = 0; sc < SC_COUNT; sc++) {
      if (strcmp(scenario, "all") && strcmp(scenario, sc_names[sc])) continue;
      if (sc == SC_TRACE && !p.trace) continue; /* "all": the synthetic scenarios */
      if (sc == SC_STALL && strcmp(scenario, "stall")) continue; /* only when named */
      rs = p.seed * 0x9e3779b97f4a7c15ull + (uint64_t)sc * 7919 + 1;
      result r;
      params q = p;
      int rc;
      if (pi == 0) rc = run_allreduce(&q, sc, &r);
      else {
        rpl_policy pol = RPL_POLICY_STATIC;
        if (!strcmp(pols[pi], "random")) pol = RPL_POLICY_RANDOM;
        if (!strncmp(pols[pi], "smart", 5)) pol = RPL_POLICY_SMART;
        if (!strcmp(pols[pi], "adpsgd")) pol = RPL_POLICY_ADPSGD;
        if (!strcmp(pols[pi], "smart+ii")) q.inter_intra = 1;
        rc = run_policy(&q, pol, sc, &r);
      }
      if (rc != 0) return 1;
      report(&p, pols[pi], sc, &r, first, p.gg_stats && pi > 0);
      first = 0;
    }
  }
  if (p.json) printf("\n]\n");
  free((void *)p.trace);
  return 0;
}
