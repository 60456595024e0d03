/* The adaptive period of the Group Generator, driven on its own clock (no wall time):
 *   - off by default: every request gets a group, never a PASS;
 *   - with equal speeds the period rises to period_max, a worker averages every period_max-th
 *     request (never more than period_max - 1 passes in a row), the groups that do form have
 *     two or more members, and a worker with a group generated for it is never passed;
 *   - one worker slowed: the period falls back to 1 within a few requests of the others
 *     (before the slowed worker's first slow step ends), and nobody is passed
 *     while it stays slow; back at speed, the period rises again;
 *   - the static policy ignores the period (a fixed schedule). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpl_sched.h"

#include "check.h"

#define NW 4

static uint64_t rng_state;
static int rnd(int n) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (int)((rng_state >> 33) % (uint64_t)n);
}

/* What one simulated run saw, per worker and in total. */
typedef struct {
  uint64_t requests[NW], passes[NW], groups[NW], averaged[NW];
  int pass_run_max[NW];       /* most passes in a row */
  uint64_t passes_while_slow; /* PASS answers while the slowed worker was slow (after drop) */
  uint64_t slow_passes;       /* PASS answers to the slowed worker once known slow */
  int slow_pass_run;          /* ... most of them in a row */
  uint64_t period_max_seen;   /* largest period the GG reported in an event */
  int drop_requests;          /* requests (all workers) from the slow-down to the period's fall */
  int drop_ticks;             /* ticks from the slow-down to the period's fall */
  int drop_tick;              /* the tick of the fall */
  int slow_end;               /* the tick the slowed worker's first slow step ends */
  int recovered;              /* the period rose again after the worker was back at speed */
  rpl_gg_stats st;
} outcome;

/* Workers compute for `step` ticks (+0..1 of jitter), ask, reduce for 2 ticks in a group of two
 * or more (a group of one or a PASS ends at once), report done, compute again. Worker 3 computes
 * `slow` times longer from tick slow_from to slow_until. One tick is one millisecond of the
 * GG's clock. */
static void run(rpl_policy policy, int period_max, int slow, int slow_from, int slow_until,
                uint64_t seed, int speed_aware, outcome *o) {
  rpl_gg_config cfg = {0};
  cfg.policy = policy;
  cfg.speed_aware = speed_aware;
  cfg.nworkers = NW;
  cfg.group_size = 3;
  cfg.period_max = period_max;
  cfg.seed = seed;
  rpl_gg *gg;
  OK(rpl_gg_create(&cfg, &gg, &e_));
  rng_state = seed;
  memset(o, 0, sizeof *o);
  const int step = 6, ticks = 6000;
  int next_ask[NW], done_at[NW], waiting[NW] = {0}, run_len[NW] = {0}, buffered_at_ask[NW];
  uint64_t round[NW] = {0}, gid[NW] = {0};
  for (int w = 0; w < NW; w++) next_ask[w] = w, done_at[w] = -1;
  int dropped = 0, counting = 0;
  for (int tick = 0; tick <= ticks; tick++) {
    OK(rpl_gg_advance(gg, tick * 0.001, &e_));
    for (int k = 0; k < NW; k++) {
      int w = (k + tick) % NW; /* no worker always last within a tick */
      int mult = (w == 3 && tick >= slow_from && tick < slow_until) ? slow : 1;
      if (done_at[w] == tick) {
        OK(rpl_gg_done(gg, w, gid[w], &e_));
        done_at[w] = -1;
        next_ask[w] = tick + step * mult + rnd(2);
        if (mult > 1 && o->slow_end == 0) o->slow_end = next_ask[w];
      }
      if (!waiting[w] && done_at[w] < 0 && tick >= next_ask[w]) {
        rpl_gg_worker_info info;
        OK(rpl_gg_worker(gg, w, &info, &e_));
        buffered_at_ask[w] = info.buffered;
        waiting[w] = 1;
        o->requests[w]++;
        if (counting) o->drop_requests++;
        OK(rpl_gg_request(gg, w, round[w], &e_));
      }
    }
    rpl_gg_event ev;
    int mm[NW];
    while (rpl_gg_poll(gg, &ev, mm, NW)) {
      int w = ev.worker;
      REQUIRE(ev.kind != RPL_EV_CANCEL, "nobody fences here");
      REQUIRE(ev.round == round[w], "answer for round %llu, asked %llu",
              (unsigned long long)ev.round, (unsigned long long)round[w]);
      if ((uint64_t)ev.period > o->period_max_seen) o->period_max_seen = (uint64_t)ev.period;
      int mult = (w == 3 && tick >= slow_from && tick < slow_until) ? slow : 1;
      waiting[w] = 0;
      round[w]++;
      if (ev.kind == RPL_EV_PASS) {
        REQUIRE(ev.group_id == 0 && ev.period >= 2, "a pass has no group and a period of 2+");
        REQUIRE(buffered_at_ask[w] == 0, "worker %d passed with a group generated for it", w);
        o->passes[w]++;
        if (dropped && tick < slow_until) o->passes_while_slow++;
        /* from the end of its second slow step on, the slowed worker is a known straggler */
        if (w == 3 && slow > 1 && tick >= slow_from + 2 * slow * step && tick < slow_until) {
          o->slow_passes++;
          if (run_len[w] + 1 > o->slow_pass_run) o->slow_pass_run = run_len[w] + 1;
        }
        if (++run_len[w] > o->pass_run_max[w]) o->pass_run_max[w] = run_len[w];
        next_ask[w] = tick + step * mult + rnd(2);
        if (mult > 1 && o->slow_end == 0) o->slow_end = next_ask[w];
        continue;
      }
      o->groups[w]++;
      gid[w] = ev.group_id;
      if (ev.nmembers > 1) {
        o->averaged[w]++;
        run_len[w] = 0;
      }
      done_at[w] = tick + 1 + (ev.nmembers > 1 ? 2 : 0);
    }
    rpl_gg_stats st;
    rpl_gg_get_stats(gg, &st);
    if (tick == slow_from && slow > 1) counting = 1;
    if (counting && st.period == 1) {
      counting = 0;
      o->drop_ticks = tick - slow_from;
      o->drop_tick = tick;
      dropped = 1;
    }
    if (tick > slow_until + 40 * step && st.period > 1) o->recovered = 1;
  }
  rpl_gg_get_stats(gg, &o->st);
  /* Answers nobody polled (passes among them) are freed with the GG. */
  for (int w = 0; w < NW; w++)
    if (!waiting[w] && done_at[w] < 0) OK(rpl_gg_request(gg, w, round[w], &e_));
  rpl_gg_destroy(gg);
}

static void test_off_by_default(void) {
  outcome o;
  run(RPL_POLICY_SMART, 0, 1, 0, 0, 1, 0, &o);
  for (int w = 0; w < NW; w++)
    REQUIRE(o.passes[w] == 0 && o.requests[w] - o.groups[w] <= 1, /* the last may be in flight */
            "worker %d: %llu passes, %llu groups for %llu requests", w,
            (unsigned long long)o.passes[w], (unsigned long long)o.groups[w],
            (unsigned long long)o.requests[w]);
  REQUIRE(o.st.passes == 0 && o.st.period == 1 && o.period_max_seen == 1, "period stays 1");
}

static void calm_case(rpl_policy policy, int period_max) {
  for (uint64_t seed = 1; seed <= 5; seed++) {
    outcome o;
    run(policy, period_max, 1, 0, 0, seed, 0, &o);
    REQUIRE(o.st.period == (uint32_t)period_max && o.period_max_seen == (uint64_t)period_max,
            "%s: period %u at the end, %llu at most, want %d", rpl_policy_name(policy),
            o.st.period, (unsigned long long)o.period_max_seen, period_max);
    for (int w = 0; w < NW; w++) {
      /* The job averages about every period_max-th request: most requests pass. A worker
       * late for a due group (smart) passes it too and is due again with that group: never
       * twice in a row, so at most 2 period_max - 1 passes in a row. */
      double share = (double)o.passes[w] / (double)o.requests[w];
      double want = 1.0 - 1.0 / period_max;
      REQUIRE(share > want - 0.2 && share <= 1.0 - 0.5 / period_max,
              "%s seed %llu worker %d: %.2f passed, about %.2f wanted", rpl_policy_name(policy),
              (unsigned long long)seed, w, share, want);
      REQUIRE(o.pass_run_max[w] <= 2 * period_max - 1, "worker %d: %d passes in a row", w,
              o.pass_run_max[w]);
      REQUIRE(o.averaged[w] * (uint64_t)(2 * period_max) + 20 >= o.requests[w],
              "worker %d averaged %llu times in %llu requests", w,
              (unsigned long long)o.averaged[w], (unsigned long long)o.requests[w]);
    }
    REQUIRE(o.st.period_drops == 0, "%s: the period fell %llu times at equal speeds",
            rpl_policy_name(policy), (unsigned long long)o.st.period_drops);
  }
}

/* One worker 5x slower from tick 2000 to 4000. Speed-aware (the default), the straggler gets a
 * group at every request once it is known slow while the others keep their period; with the
 * previous rules (speed_aware < 0) the period falls by the end of its first slow step and
 * nobody passes while it is slow. */
static void slowed_case(rpl_policy policy, int speed_aware) {
  for (uint64_t seed = 1; seed <= 5; seed++) {
    outcome o;
    run(policy, 4, 5, 2000, 4000, seed, speed_aware, &o);
    if (speed_aware >= 0) {
      /* The bulk keeps its period; once known slow, the straggler passes only where nobody is
       * due to average with it, never twice in a row. */
      REQUIRE(o.slow_pass_run <= 1 && o.passes[0] + o.passes[1] + o.passes[2] > 3 * 200,
              "%s seed %llu: the straggler passed %llu times while slow (%d in a row); the "
              "others %llu", rpl_policy_name(policy), (unsigned long long)seed,
              (unsigned long long)o.slow_passes, o.slow_pass_run,
              (unsigned long long)(o.passes[0] + o.passes[1] + o.passes[2]));
      REQUIRE(o.recovered, "%s: no period at equal speeds again", rpl_policy_name(policy));
      continue;
    }
    REQUIRE(o.st.period_drops >= 1, "%s: the period never fell", rpl_policy_name(policy));
    /* Falls by the end of the slowed worker's first slow step (5 x 6 ticks): it is overdue
     * after 4 of the bulk's steps, in which the others ask about 4 times each (a few more
     * when a late member is dropped from a group instead of waited for). */
    REQUIRE(o.drop_requests > 0 && o.slow_end > 0 && o.drop_tick <= o.slow_end,
            "%s seed %llu: the period fell %d ticks (%d requests) after the slow-down, at tick "
            "%d, the first slow step ended at %d", rpl_policy_name(policy),
            (unsigned long long)seed, o.drop_ticks, o.drop_requests, o.drop_tick, o.slow_end);
    /* Each worker's request in flight at the fall may still be answered by the old period. */
    REQUIRE(o.passes_while_slow <= NW, "%s: %llu passes while a worker was 5x slow",
            rpl_policy_name(policy), (unsigned long long)o.passes_while_slow);
    REQUIRE(o.recovered, "%s: the period did not rise again at equal speeds",
            rpl_policy_name(policy));
  }
}

static void test_static_ignores_period(void) {
  outcome o;
  run(RPL_POLICY_STATIC, 4, 1, 0, 0, 3, 0, &o);
  REQUIRE(o.st.passes == 0 && o.st.period == 1, "static passed %llu rounds",
          (unsigned long long)o.st.passes);
}

static void test_bounds(void) {
  rpl_gg_config cfg = {0};
  cfg.policy = RPL_POLICY_SMART;
  cfg.nworkers = 2;
  cfg.period_max = RPL_GG_MAX_PERIOD + 1;
  rpl_gg *gg = NULL;
  rpl_error err;
  REQUIRE(rpl_gg_create(&cfg, &gg, &err) == RPL_ERR_INVALID && strstr(err.msg, "period_max"),
          "period_max out of range: %s", err.msg);
  cfg.period_max = -3;
  OK(rpl_gg_create(&cfg, &gg, &e_));
  REQUIRE(rpl_gg_period_max(gg) == 1, "negative = every request");
  rpl_gg_destroy(gg);
}

int main(void) {
  test_bounds();
  test_off_by_default();
  calm_case(RPL_POLICY_SMART, 4);
  calm_case(RPL_POLICY_SMART, 2);
  calm_case(RPL_POLICY_RANDOM, 4);
  slowed_case(RPL_POLICY_SMART, 0);
  slowed_case(RPL_POLICY_RANDOM, 0);
  slowed_case(RPL_POLICY_SMART, -1);
  test_static_ignores_period();
  return report("test_sched_period");
}
