/*
 * gg_sim: a discrete-event simulator that drives the real Group Generator policies
 * (csrc/sched, no coordinator I/O) with simulated workers, to compare policies and pick knobs.
 *
 * Model (times in units of one normal compute step):
 *   - a worker computes for 1.0 x U(0.95, 1.05) x its slowdown, then asks for a group;
 *   - the request reaches the GG after `gg_lat`, a handed group reaches members after `gg_lat`;
 *   - a group of g members reduces for alpha + beta * 2(g-1)/g, beta doubled if it spans hosts;
 *   - then every member reports done and computes again.
 * Scenarios: homog; slow2 / slow5 (worker 0 always 2x / 5x slower); random (every worker is
 * 5x slower in a step with probability 1/n). "allreduce" is the global-barrier baseline.
 * Reported per run: rounds per worker per unit of simulated time, mean time a round waits for
 * its members (request -> group handed), conflicts per 1000 groups, singletons, and consensus:
 * simulated time until the spread of a random vector averaged by the groups falls to 1e-3 and
 * 1e-6 of its start (the averaging the groups would do to models, without gradients).
 *
 *   gg_sim [--workers N] [--per-host L] [--policy P|all] [--scenario S|all] [--rounds R]
 *          [--group-size G] [--c-thres C] [--inter-intra] [--seed S] [--json]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpl_sched.h"

#define DIM 4

typedef struct {
  double t;
  int worker;
  int kind; /* 0 compute done, 1 reduce done, 2 group arrives at GG side (request) */
  uint64_t gid;
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
  int workers, per_host, rounds, group_size, c_thres, inter_intra, json;
  uint64_t seed;
  double gg_lat, alpha, beta;
} params;

typedef struct {
  double rounds_per_time, mean_wait, conflicts_per_k, singleton_frac, t_1e3, t_1e6, sim_time;
  double slowest_rounds_per_time;
} result;

enum { SC_HOMOG, SC_SLOW2, SC_SLOW5, SC_RANDOM, SC_COUNT };
static const char *sc_names[] = {"homog", "slow2", "slow5", "random"};

static double compute_time(const params *p, int sc, int w) {
  double t = 0.95 + 0.1 * urand();
  if ((sc == SC_SLOW2 && w == 0)) t *= 2;
  if ((sc == SC_SLOW5 && w == 0)) t *= 5;
  if (sc == SC_RANDOM && urand() < 1.0 / p->workers) t *= 5;
  return t;
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

static int run_allreduce(const params *p, int sc, result *r) {
  int n = p->workers;
  double t = 0;
  int *all = malloc(sizeof(int) * (size_t)n);
  for (int i = 0; i < n; i++) all[i] = i;
  double waits = 0;
  for (int k = 0; k < p->rounds; k++) {
    double mx = 0, sum = 0;
    for (int w = 0; w < n; w++) {
      double c = compute_time(p, sc, w);
      sum += c;
      if (c > mx) mx = c;
    }
    waits += mx * n - sum;
    t += mx + reduce_time(p, all, n);
  }
  free(all);
  memset(r, 0, sizeof *r);
  r->sim_time = t;
  r->rounds_per_time = p->rounds / t;
  r->slowest_rounds_per_time = r->rounds_per_time;
  r->mean_wait = waits / ((double)n * p->rounds);
  r->t_1e3 = r->t_1e6 = t / p->rounds; /* one global average reaches consensus */
  return 0;
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
  cfg.seed = p->seed;
  rpl_gg *gg;
  rpl_error err;
  if (rpl_gg_create(&cfg, &gg, &err) != RPL_OK) {
    fprintf(stderr, "gg_sim: %s\n", err.msg);
    return -1;
  }
  double(*x)[DIM] = malloc(sizeof *x * (size_t)n);
  for (int w = 0; w < n; w++)
    for (int d = 0; d < DIM; d++) x[w][d] = urand();
  double s0 = spread(x, n), next_check = 0;
  double t_1e3 = -1, t_1e6 = -1;
  uint64_t *round = calloc((size_t)n, sizeof *round);
  double *asked = calloc((size_t)n, sizeof *asked);
  int *members = malloc(sizeof(int) * (size_t)n);
  heap h = {0};
  for (int w = 0; w < n; w++) heap_push(&h, (sim_ev){compute_time(p, sc, w), w, 0, 0});
  double now = 0, waits = 0;
  uint64_t done_rounds = 0, target = (uint64_t)p->rounds * (uint64_t)n, handed_groups = 0;
  uint64_t min_done = 0;
  while (h.n > 0 && min_done < (uint64_t)p->rounds && done_rounds < 4 * target) {
    sim_ev e = heap_pop(&h);
    now = e.t;
    if (e.kind == 0) { /* compute finished: the request travels to the GG */
      heap_push(&h, (sim_ev){now + p->gg_lat, e.worker, 2, 0});
      asked[e.worker] = now;
      continue;
    }
    if (e.kind == 1) { /* reduce finished */
      rpl_gg_done(gg, e.worker, e.gid, &err);
      round[e.worker]++;
      done_rounds++;
      if (e.worker == 0 || round[e.worker] <= min_done + 1) {
        uint64_t mn = UINT64_MAX;
        for (int w = 0; w < n; w++)
          if (round[w] < mn) mn = round[w];
        min_done = mn;
      }
      heap_push(&h, (sim_ev){now + compute_time(p, sc, e.worker), e.worker, 0, 0});
      continue;
    }
    /* kind 2: the request reaches the GG */
    if (rpl_gg_request(gg, e.worker, round[e.worker], &err) != RPL_OK) {
      fprintf(stderr, "gg_sim: %s\n", err.msg);
      return -1;
    }
    rpl_gg_event ev;
    uint64_t last_gid = 0;
    while (rpl_gg_poll(gg, &ev, members, n)) {
      if (ev.kind != RPL_EV_GROUP) continue;
      double dur = reduce_time(p, members, ev.nmembers);
      waits += now + p->gg_lat - asked[ev.worker];
      heap_push(&h, (sim_ev){now + p->gg_lat + dur, ev.worker, 1, ev.group_id});
      if (ev.group_id != last_gid) { /* once per group: average the vectors */
        last_gid = ev.group_id;
        handed_groups++;
        double avg[DIM] = {0};
        for (int i = 0; i < ev.nmembers; i++)
          for (int d = 0; d < DIM; d++) avg[d] += x[members[i]][d] / ev.nmembers;
        for (int i = 0; i < ev.nmembers; i++) memcpy(x[members[i]], avg, sizeof avg);
      }
    }
    if (now >= next_check && t_1e6 < 0) {
      double s = spread(x, n) / s0;
      if (t_1e3 < 0 && s <= 1e-3) t_1e3 = now;
      if (t_1e6 < 0 && s <= 1e-6) t_1e6 = now;
      next_check = now + 0.25;
    }
  }
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  memset(r, 0, sizeof *r);
  r->sim_time = now;
  r->rounds_per_time = (double)done_rounds / n / now;
  uint64_t mn = UINT64_MAX;
  for (int w = 0; w < n; w++)
    if (round[w] < mn) mn = round[w];
  r->slowest_rounds_per_time = (double)mn / now;
  r->mean_wait = done_rounds ? waits / (double)st.groups_handed / 1.0 : 0;
  r->mean_wait = done_rounds ? waits / (double)done_rounds : 0;
  r->conflicts_per_k = st.groups_created ? 1000.0 * (double)st.conflicts / (double)st.groups_created : 0;
  r->singleton_frac = st.groups_handed ? (double)st.singletons_handed / (double)st.groups_handed : 0;
  r->t_1e3 = t_1e3;
  r->t_1e6 = t_1e6;
  (void)handed_groups;
  rpl_gg_destroy(gg);
  free(x);
  free(round);
  free(asked);
  free(members);
  free(h.a);
  free(labels);
  return 0;
}

int main(int argc, char **argv) {
  params p = {16, 4, 200, 0, 0, 0, 0, 1, 0.002, 0.02, 0.1};
  const char *policy = "all", *scenario = "all";
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
    if (!strcmp(a, "--workers")) p.workers = atoi(v), i++;
    else if (!strcmp(a, "--per-host")) p.per_host = atoi(v), i++;
    else if (!strcmp(a, "--rounds")) p.rounds = atoi(v), i++;
    else if (!strcmp(a, "--group-size")) p.group_size = atoi(v), i++;
    else if (!strcmp(a, "--c-thres")) p.c_thres = atoi(v), i++;
    else if (!strcmp(a, "--seed")) p.seed = strtoull(v, NULL, 0), i++;
    else if (!strcmp(a, "--policy")) policy = v, i++;
    else if (!strcmp(a, "--scenario")) scenario = v, i++;
    else if (!strcmp(a, "--gg-lat")) p.gg_lat = atof(v), i++;
    else if (!strcmp(a, "--alpha")) p.alpha = atof(v), i++;
    else if (!strcmp(a, "--beta")) p.beta = atof(v), i++;
    else if (!strcmp(a, "--inter-intra")) p.inter_intra = 1;
    else if (!strcmp(a, "--json")) p.json = 1;
    else {
      fprintf(stderr, "usage: gg_sim [--workers N] [--per-host L] [--policy P|all|allreduce] "
                      "[--scenario homog|slow2|slow5|random|all] [--rounds R] [--group-size G] "
                      "[--c-thres C] [--inter-intra] [--seed S] [--gg-lat T] [--alpha A] "
                      "[--beta B] [--json]\n");
      return 2;
    }
  }
  if (p.workers < 2 || p.per_host < 1 || p.rounds < 1) {
    fprintf(stderr, "gg_sim: need --workers >= 2, --per-host >= 1, --rounds >= 1\n");
    return 2;
  }
  const char *pols[] = {"allreduce", "static", "random", "smart", "smart+ii", "adpsgd"};
  int first = 1;
  if (p.json) printf("[");
  else
    printf("%-9s %-7s %6s %10s %10s %9s %9s %8s %9s %9s\n", "policy", "scen", "n", "rnd/w/t",
           "slowest", "wait/rnd", "confl/1k", "single", "t(1e-3)", "t(1e-6)");
  for (size_t pi = 0; pi < sizeof pols / sizeof *pols; pi++) {
    if (strcmp(policy, "all") && strcmp(policy, pols[pi])) continue;
    for (int sc = 0; sc < SC_COUNT; sc++) {
      if (strcmp(scenario, "all") && strcmp(scenario, sc_names[sc])) continue;
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
      if (p.json)
        printf("%s\n {\"policy\":\"%s\",\"scenario\":\"%s\",\"workers\":%d,\"per_host\":%d,"
               "\"group_size\":%d,\"c_thres\":%d,\"rounds_per_worker_per_time\":%.5f,"
               "\"slowest_rounds_per_time\":%.5f,\"mean_wait_per_round\":%.5f,"
               "\"conflicts_per_1000_groups\":%.2f,\"singleton_fraction\":%.4f,"
               "\"consensus_time_1e3\":%.3f,\"consensus_time_1e6\":%.3f,\"sim_time\":%.2f}",
               first ? "" : ",", pols[pi], sc_names[sc], p.workers, p.per_host, p.group_size,
               p.c_thres, r.rounds_per_time, r.slowest_rounds_per_time, r.mean_wait,
               r.conflicts_per_k, r.singleton_frac, r.t_1e3, r.t_1e6, r.sim_time);
      else
        printf("%-9s %-7s %6d %10.4f %10.4f %9.4f %9.2f %8.4f %9.2f %9.2f\n", pols[pi],
               sc_names[sc], p.workers, r.rounds_per_time, r.slowest_rounds_per_time, r.mean_wait,
               r.conflicts_per_k, r.singleton_frac, r.t_1e3, r.t_1e6);
      first = 0;
      fflush(stdout);
    }
  }
  if (p.json) printf("\n]\n");
  return 0;
}
