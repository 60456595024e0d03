/* What-if accounting (issue 50): from each worker's compute steps, the time all-reduce would
 * take for the same work and the time if nobody waited -- benchmarks/trace_replay.py's ideal,
 * measured online. I/O-free and clock-free like the GG that feeds it (rpl_sched.h, 2b).
 *
 * Steps are aligned by their index in each worker's own sequence: all-reduce's step t waits for
 * the slowest of every worker's step t. Slot t of a ring holds the largest two computes reported
 * for step t and who had the largest; once every worker in the job has reported step t (or the
 * fastest is RPL_WHATIF_WINDOW steps ahead) it is folded into the sums and the ring moves on. A
 * worker missing from a slot folded early counts with its mean step, the best guess for a step
 * it has not computed yet (exact for a steady straggler). Memory: O(window + workers). */
#include <math.h>
#include <stdlib.h>

#include "sched_internal.h"

/* A forced fold refreshes the laggards' largest mean at most this many folds apart (O(n)). */
#define WHATIF_LAG_REFRESH 64

typedef struct whatif_slot {
  double max, second;
  int arg;   /* who computed max; -1 none */
  int count; /* workers that reported this step */
} whatif_slot;

struct rpl_whatif {
  int n, gone;
  uint32_t cap;
  whatif_slot *ring;
  uint64_t base;       /* step index of the oldest unfolded slot */
  uint64_t folded;     /* slots folded with a step in them (base, less any empty one) */
  uint64_t *count;     /* [n] steps reported (its mean's) */
  uint64_t *idx;       /* [n] the index its next step aligns with (moves to the job's step when
                          it comes back in) */
  double *sum;         /* [n] their compute */
  double *cost;        /* [n] seconds all-reduce would have waited for it (folded steps) */
  unsigned char *out;  /* [n] left the job */
  uint64_t steps;
  /* Sum over workers of 1 / mean step (those with one), kept up to date at each step so that
   * reading the summary is O(1); recomputed every max(n, 1024) steps against drift. */
  double inv_sum;
  int known;
  uint64_t since_sum;
  double allreduce;    /* sum over folded steps of the slowest compute */
  double cost_total;   /* sum of the workers' costs */
  double first_t, last_t; /* clock at the start of the first step reported, at the last report */
  /* Forced folds: the largest two means of workers behind the window's base. */
  double lag_max, lag_second;
  int lag_arg;
  uint64_t lag_at;     /* base when computed; lag_arg == -2: never */
};

static void slot_reset(whatif_slot *s) {
  s->max = s->second = 0.0;
  s->arg = -1;
  s->count = 0;
}

static void slot_put(whatif_slot *s, int w, double v) {
  if (s->arg < 0 || v > s->max) {
    s->second = s->arg < 0 ? 0.0 : s->max;
    s->max = v;
    s->arg = w;
  } else if (v >= s->second) {
    s->second = v; /* a tie with max too: nobody alone made the step longer */
  }
}

rpl_status rpl_whatif_create(int nworkers, rpl_whatif **out, rpl_error *err) {
  *out = NULL;
  if (nworkers < 1 || nworkers > RPL_SCHED_MAX_WORKERS)
    return rpl_fail(err, RPL_ERR_INVALID, "whatif: nworkers %d out of range [1, %d]", nworkers,
                    RPL_SCHED_MAX_WORKERS);
  rpl_whatif *a = calloc(1, sizeof *a);
  if (!a) return rpl_fail(err, RPL_ERR_NOMEM, "whatif: out of memory");
  a->n = nworkers;
  a->cap = RPL_WHATIF_WINDOW;
  a->ring = malloc(sizeof *a->ring * a->cap);
  a->count = calloc((size_t)nworkers, sizeof *a->count);
  a->idx = calloc((size_t)nworkers, sizeof *a->idx);
  a->sum = calloc((size_t)nworkers, sizeof *a->sum);
  a->cost = calloc((size_t)nworkers, sizeof *a->cost);
  a->out = calloc((size_t)nworkers, 1);
  if (!a->ring || !a->count || !a->idx || !a->sum || !a->cost || !a->out) {
    rpl_whatif_destroy(a);
    return rpl_fail(err, RPL_ERR_NOMEM, "whatif: out of memory");
  }
  for (uint32_t i = 0; i < a->cap; i++) slot_reset(&a->ring[i]);
  a->first_t = a->last_t = -1.0;
  a->lag_arg = -2;
  *out = a;
  return RPL_OK;
}

void rpl_whatif_destroy(rpl_whatif *a) {
  if (!a) return;
  free(a->ring);
  free(a->count);
  free(a->idx);
  free(a->sum);
  free(a->cost);
  free(a->out);
  free(a);
}

static double mean_of(const rpl_whatif *a, int w) {
  return a->count[w] ? a->sum[w] / (double)a->count[w] : 0.0;
}

/* The largest two means among workers in the job that have not reported step `base`. */
static void lag_refresh(rpl_whatif *a) {
  a->lag_max = a->lag_second = 0.0;
  a->lag_arg = -1;
  a->lag_at = a->base;
  for (int w = 0; w < a->n; w++) {
    if (a->out[w] || a->idx[w] > a->base || a->count[w] == 0) continue;
    double m = mean_of(a, w);
    if (a->lag_arg < 0 || m > a->lag_max) {
      a->lag_second = a->lag_arg < 0 ? 0.0 : a->lag_max;
      a->lag_max = m;
      a->lag_arg = w;
    } else if (m > a->lag_second) {
      a->lag_second = m;
    }
  }
}

static void fold_oldest(rpl_whatif *a, int forced) {
  whatif_slot *s = &a->ring[a->base % a->cap];
  if (forced && s->count < a->n - a->gone) {
    if (a->lag_arg == -2 || a->base - a->lag_at >= WHATIF_LAG_REFRESH) lag_refresh(a);
    if (a->lag_arg >= 0 && a->idx[a->lag_arg] <= a->base && !a->out[a->lag_arg]) {
      slot_put(s, a->lag_arg, a->lag_max);
      if (s->arg == a->lag_arg && a->lag_second > s->second) s->second = a->lag_second;
    }
  }
  if (s->arg >= 0) {
    a->folded++;
    a->allreduce += s->max;
    if (s->max > s->second) {
      a->cost[s->arg] += s->max - s->second;
      a->cost_total += s->max - s->second;
    }
  }
  slot_reset(s);
  a->base++;
}

static void fold_ready(rpl_whatif *a) {
  int need = a->n - a->gone;
  while (need > 0 && a->ring[a->base % a->cap].count >= need) fold_oldest(a, 0);
}

static double inv_mean(const rpl_whatif *a, int w) {
  double m = mean_of(a, w);
  return m > 0 ? 1.0 / m : 0.0;
}

static void inv_recompute(rpl_whatif *a) {
  a->inv_sum = 0.0;
  a->known = 0;
  for (int w = 0; w < a->n; w++) {
    double v = inv_mean(a, w);
    a->inv_sum += v;
    a->known += v > 0;
  }
  a->since_sum = 0;
}

void rpl_whatif_step(rpl_whatif *a, int w, double step, double now) {
  if (!a || w < 0 || w >= a->n || a->out[w] || !(step >= 0) || !isfinite(step)) return;
  double before = inv_mean(a, w);
  uint64_t k = a->idx[w]++;
  a->count[w]++;
  a->sum[w] += step;
  a->steps++;
  double after = inv_mean(a, w);
  a->inv_sum += after - before;
  a->known += (after > 0) - (before > 0);
  if (++a->since_sum >= (uint64_t)(a->n > 1024 ? a->n : 1024)) inv_recompute(a);
  if (a->first_t < 0 || now - step < a->first_t) a->first_t = now - step;
  if (now > a->last_t) a->last_t = now;
  if (k < a->base) return; /* its slot went with its mean already */
  while (k >= a->base + a->cap) fold_oldest(a, 1);
  whatif_slot *s = &a->ring[k % a->cap];
  slot_put(s, w, step);
  s->count++;
  fold_ready(a);
}

void rpl_whatif_out(rpl_whatif *a, int w, int out) {
  if (!a || w < 0 || w >= a->n || !a->out[w] == !out) return;
  a->out[w] = out ? 1 : 0;
  a->gone += out ? 1 : -1;
  /* Back in: it joins at the job's step, not at the steps folded while it was out. */
  if (!out && a->idx[w] < a->base) a->idx[w] = a->base;
  fold_ready(a);
}

void rpl_whatif_get(const rpl_whatif *a, rpl_whatif_summary *out) {
  rpl_whatif_summary r = {0};
  r.steps = a->steps;
  r.job_steps = a->folded;
  r.cost_s = a->cost_total;
  double inv = a->inv_sum;
  int known = a->known;
  if (a->folded > 0 && known > 0 && inv > 0) {
    r.allreduce_step = a->allreduce / (double)a->folded;
    r.free_step = (double)known / inv;
    if (r.allreduce_step > 0) {
      r.gain = r.allreduce_step / r.free_step;
      /* The same work (every step measured) at each pace, in worker steps of the whole job. */
      double work = (double)a->steps / known;
      r.allreduce_s = work * r.allreduce_step;
      r.free_s = work * r.free_step;
      r.waste = 1.0 - r.free_step / r.allreduce_step;
      if (r.waste < 0) r.waste = 0; /* a slot's max is never below a mean: rounding only */
    }
  }
  if (a->last_t > a->first_t && a->first_t >= 0) r.elapsed_s = a->last_t - a->first_t;
  if (r.allreduce_s > 0 && r.elapsed_s > 0) r.saved = 1.0 - r.elapsed_s / r.allreduce_s;
  *out = r;
}

rpl_status rpl_whatif_worker(const rpl_whatif *a, int w, rpl_whatif_worker_info *out,
                             rpl_error *err) {
  if (w < 0 || w >= a->n)
    return rpl_fail(err, RPL_ERR_INVALID, "whatif: worker %d out of range [0, %d)", w, a->n);
  out->steps = a->count[w];
  out->mean_step = mean_of(a, w);
  out->cost_s = a->cost[w];
  return RPL_OK;
}
