/* The what-if accounting (rpl_whatif, issue 50) on tables small enough to work out by hand;
 * the stored traces against benchmarks/trace_replay.py are ctest gg_sim_whatif.
 *   - nothing known before every worker has a step: no gain, no division by zero;
 *   - even workers: gain 1, waste 0, nobody costs anything;
 *   - a table by hand: all-reduce's step is the mean of each step's slowest, the free step the
 *     harmonic mean of the means, each slowest worker costs its lead over the second;
 *   - a worker far ahead (past the window) folds the others' steps at their mean;
 *   - a worker that leaves stops holding the steps it has not reached, and one that comes back
 *     joins at the job's step;
 *   - bad input (negative, NaN, unknown worker) is ignored; one worker wastes nothing. */
#include <math.h>
#include <stdio.h>

#include "rpl_sched.h"

#include "check.h"

static int close_to(double a, double b) { return fabs(a - b) <= 1e-12 * (fabs(b) + 1e-300); }

static rpl_whatif *make(int n) {
  rpl_whatif *a = NULL;
  OK(rpl_whatif_create(n, &a, &e_));
  return a;
}

static void test_empty(void) {
  rpl_whatif *a = make(3);
  rpl_whatif_summary s;
  rpl_whatif_get(a, &s);
  CHECK(s.gain == 0 && s.waste == 0 && s.saved == 0 && s.allreduce_step == 0,
        "nothing measured: gain %g waste %g saved %g", s.gain, s.waste, s.saved);
  rpl_whatif_step(a, 0, 0.1, 0.1);
  rpl_whatif_step(a, 1, 0.1, 0.1);
  rpl_whatif_get(a, &s);
  CHECK(s.job_steps == 0 && s.gain == 0, "a step worker 2 has not reached is not accounted");
  CHECK(isfinite(s.saved), "saved %g", s.saved);
  rpl_whatif_destroy(a);
  rpl_error e;
  CHECK(rpl_whatif_create(0, &a, &e) == RPL_ERR_INVALID && a == NULL, "0 workers refused");
}

static void test_even(void) {
  rpl_whatif *a = make(4);
  for (int t = 0; t < 50; t++)
    for (int w = 0; w < 4; w++) rpl_whatif_step(a, w, 0.2, 0.2 * (t + 1));
  rpl_whatif_summary s;
  rpl_whatif_get(a, &s);
  CHECK(s.job_steps == 50 && s.steps == 200, "steps %llu job %llu",
        (unsigned long long)s.steps, (unsigned long long)s.job_steps);
  CHECK(close_to(s.gain, 1.0) && s.waste < 1e-12, "even: gain %g waste %g", s.gain, s.waste);
  CHECK(close_to(s.allreduce_s, 10.0) && close_to(s.elapsed_s, 10.0) && fabs(s.saved) < 1e-12,
        "even: all-reduce %g s, elapsed %g s, saved %g", s.allreduce_s, s.elapsed_s, s.saved);
  for (int w = 0; w < 4; w++) {
    rpl_whatif_worker_info wi;
    OK(rpl_whatif_worker(a, w, &wi, &e_));
    CHECK(wi.cost_s == 0 && close_to(wi.mean_step, 0.2), "worker %d cost %g", w, wi.cost_s);
  }
  rpl_whatif_destroy(a);
}

static void test_by_hand(void) {
  /* steps x workers; worker 2 reports last, so every step waits for it to be folded */
  static const double f[3][3] = {{1, 2, 4}, {3, 1, 1}, {1, 1, 2}};
  rpl_whatif *a = make(3);
  for (int t = 0; t < 3; t++)
    for (int w = 0; w < 3; w++) rpl_whatif_step(a, w, f[t][w], 10.0 + t);
  rpl_whatif_summary s;
  rpl_whatif_get(a, &s);
  double ar = (4.0 + 3.0 + 2.0) / 3, m0 = 5.0 / 3, m1 = 4.0 / 3, m2 = 7.0 / 3;
  double free_step = 3.0 / (1 / m0 + 1 / m1 + 1 / m2);
  CHECK(s.job_steps == 3 && close_to(s.allreduce_step, ar), "all-reduce step %g, want %g",
        s.allreduce_step, ar);
  CHECK(close_to(s.free_step, free_step), "free step %g, want %g", s.free_step, free_step);
  CHECK(close_to(s.gain, ar / free_step) && close_to(s.waste, 1 - free_step / ar),
        "gain %g waste %g", s.gain, s.waste);
  CHECK(close_to(s.allreduce_s, 3 * ar), "all-reduce's time for 9 worker steps: %g",
        s.allreduce_s);
  double want[3] = {3.0 - 1.0, 0.0, (4.0 - 2.0) + (2.0 - 1.0)};
  for (int w = 0; w < 3; w++) {
    rpl_whatif_worker_info wi;
    OK(rpl_whatif_worker(a, w, &wi, &e_));
    CHECK(close_to(wi.cost_s + 1.0, want[w] + 1.0), "worker %d costs %g, want %g", w, wi.cost_s,
          want[w]);
  }
  CHECK(close_to(s.cost_s, want[0] + want[2]), "total cost %g", s.cost_s);
  rpl_whatif_worker_info wi;
  rpl_error e;
  CHECK(rpl_whatif_worker(a, 3, &wi, &e) == RPL_ERR_INVALID, "worker 3 of 3 refused");
  rpl_whatif_destroy(a);
}

static void test_far_ahead(void) {
  /* worker 0 steps 0.1 s, worker 1 a steady 0.5 s: worker 0 runs more than a window ahead */
  rpl_whatif *a = make(2);
  double t0 = 0, t1 = 0;
  for (int i = 0; i < 5 * RPL_WHATIF_WINDOW; i++) {
    rpl_whatif_step(a, 0, 0.1, t0 += 0.1);
    if (i % 5 == 4) rpl_whatif_step(a, 1, 0.5, t1 += 0.5);
  }
  rpl_whatif_summary s;
  rpl_whatif_get(a, &s);
  CHECK(s.job_steps >= 4 * RPL_WHATIF_WINDOW - 1, "folded %llu steps",
        (unsigned long long)s.job_steps);
  CHECK(close_to(s.allreduce_step, 0.5), "all-reduce step %g, want the straggler's 0.5",
        s.allreduce_step);
  double free_step = 2.0 / (10.0 + 2.0);
  CHECK(close_to(s.free_step, free_step) && close_to(s.waste, 1 - free_step / 0.5),
        "free step %g waste %g", s.free_step, s.waste);
  /* nobody waited: the job's time is the free time of its work, so saved = waste */
  CHECK(fabs(s.saved - s.waste) < 1e-9, "saved %g, waste %g", s.saved, s.waste);
  rpl_whatif_worker_info w1;
  OK(rpl_whatif_worker(a, 1, &w1, &e_));
  CHECK(close_to(w1.cost_s, 0.4 * (double)s.job_steps), "the straggler costs %g", w1.cost_s);
  rpl_whatif_destroy(a);
}

static void test_gone(void) {
  rpl_whatif *a = make(3);
  for (int t = 0; t < 10; t++) {
    rpl_whatif_step(a, 0, 0.1, 0.1 * (t + 1));
    rpl_whatif_step(a, 1, 0.2, 0.2 * (t + 1));
    if (t < 4) rpl_whatif_step(a, 2, 1.0, 1.0 * (t + 1));
  }
  rpl_whatif_summary s;
  rpl_whatif_get(a, &s);
  CHECK(s.job_steps == 4, "steps wait for worker 2: %llu", (unsigned long long)s.job_steps);
  rpl_whatif_out(a, 2, 1);
  rpl_whatif_out(a, 2, 1); /* twice is once */
  rpl_whatif_step(a, 2, 1.0, 5.0); /* a late report of a worker gone is not accounted */
  rpl_whatif_get(a, &s);
  CHECK(s.steps == 24, "a gone worker's report is ignored: %llu steps",
        (unsigned long long)s.steps);
  CHECK(s.job_steps == 10, "gone: the others' steps fold: %llu",
        (unsigned long long)s.job_steps);
  CHECK(close_to(s.allreduce_step, (4 * 1.0 + 6 * 0.2) / 10), "all-reduce step %g",
        s.allreduce_step);
  /* Back (a dead worker's request takes it back): the next steps wait for it again. */
  rpl_whatif_out(a, 2, 0);
  rpl_whatif_step(a, 0, 0.1, 2.0);
  rpl_whatif_step(a, 1, 0.2, 2.0);
  rpl_whatif_get(a, &s);
  CHECK(s.job_steps == 10, "step 10 waits for worker 2 back: %llu",
        (unsigned long long)s.job_steps);
  rpl_whatif_step(a, 2, 0.5, 2.0);
  rpl_whatif_get(a, &s);
  CHECK(s.job_steps == 11 && close_to(s.allreduce_step, (4 * 1.0 + 6 * 0.2 + 0.5) / 11),
        "worker 2's step after its return is step 10: %llu steps, all-reduce step %g",
        (unsigned long long)s.job_steps, s.allreduce_step);
  rpl_whatif_destroy(a);
}

static void test_bad_input_and_one(void) {
  rpl_whatif *a = make(2);
  rpl_whatif_step(a, 0, -1.0, 1.0);
  rpl_whatif_step(a, 0, NAN, 1.0);
  rpl_whatif_step(a, 0, INFINITY, 1.0);
  rpl_whatif_step(a, 2, 1.0, 1.0);
  rpl_whatif_step(a, -1, 1.0, 1.0);
  rpl_whatif_step(NULL, 0, 1.0, 1.0);
  rpl_whatif_summary s;
  rpl_whatif_get(a, &s);
  CHECK(s.steps == 0, "bad steps ignored: %llu", (unsigned long long)s.steps);
  rpl_whatif_destroy(a);
  a = make(1);
  for (int t = 0; t < 5; t++) rpl_whatif_step(a, 0, 0.1 * (t + 1), 1.0 + t);
  rpl_whatif_get(a, &s);
  CHECK(close_to(s.gain, 1.0) && s.waste < 1e-12, "one worker: gain %g", s.gain);
  rpl_whatif_destroy(a);
}

int main(void) {
  test_empty();
  test_even();
  test_by_hand();
  test_far_ahead();
  test_gone();
  test_bad_input_and_one();
  return report("test_whatif");
}
