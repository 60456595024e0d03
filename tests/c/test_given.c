/*
 * test_given.c - partial rounds over a group the caller gives (rpl_comm_partial_give), and the
 * last round's outcome (rpl_comm_partial_last).
 *
 * Four ranks as threads, the static schedule underneath: a given round averages exactly the
 * members given (three of four here, the fourth alone), asks no schedule, and leaves the next
 * round to the schedule at the next round number; invalid groups, a second give and a give
 * while a round is queued are refused with a message naming why. Also rpl_comm_fence_alone:
 * refused while a round is queued, and rounds go on after it. And rpl_comm_partial_group: a
 * round's group while the round is in flight, none for a round not started (timeout) or one
 * whose group a later round's replaced.
 */
#include <math.h>
#include <string.h>

#include "harness.h"
#include "ripples.h"
#include "sched/rpl_sched.h"

#define N 4
#define LEN 300 /* above the harness's small-message threshold: ring paths run */

static double input(int r, int i) { return (double)(r * 1000 + i % 13) * 0.25; }

static int give(rpl_comm *c, const int *m, int n, uint64_t gid, const char *want) {
  rpl_error err = {RPL_OK, ""};
  rpl_status st = rpl_comm_partial_give(c, m, n, gid, &err);
  if (!want) {
    CHECK(st == RPL_OK, "give: %s", err.msg);
    return st == RPL_OK;
  }
  CHECK(st == RPL_ERR_INVALID && strstr(err.msg, want), "want '%s', got %s: %s", want,
        rpl_status_name(st), err.msg);
  return 0;
}

static rpl_status round_avg(rpl_comm *c, double *x, rpl_redop op) {
  rpl_buf b = {x, LEN, RPL_FLOAT64};
  rpl_op_desc d = {.kind = RPL_OP_PARTIAL_ALLREDUCE, .redop = op, .in = &b, .nin = 1};
  rpl_error err;
  rpl_status st = run_op(c, d, &err);
  CHECK(st == RPL_OK, "round: %s", err.msg);
  return st;
}

/* x must hold the mean over members[0..n) of the inputs. */
static void check_mean(const double *x, const int *members, int n, const char *what) {
  int bad = 0;
  for (int i = 0; i < LEN; i++) {
    double mean = 0;
    for (int k = 0; k < n; k++) mean += input(members[k], i) / n;
    bad += fabs(x[i] - mean) > 1e-9 * (1 + fabs(mean));
  }
  CHECK(bad == 0, "%s: %d elements are not the members' mean", what, bad);
}

/* The last round: its number, id, members, and whether it moved data and was given. */
static void check_last(rpl_comm *c, uint64_t round, uint64_t gid, const int *m, int n,
                       int moved, int given) {
  rpl_round_outcome o;
  int got[N];
  REQUIRE(rpl_comm_partial_last(c, &o, got, N) == 1, "a last round");
  CHECK(o.round == round && o.group_id == gid && o.status == RPL_OK && o.nmembers == n &&
            o.moved == moved && o.given == given,
        "last: round %llu gid %llu status %d n %d moved %d given %d",
        (unsigned long long)o.round, (unsigned long long)o.group_id, o.status, o.nmembers,
        o.moved, o.given);
  for (int k = 0; k < n && k < o.nmembers; k++) CHECK(got[k] == m[k], "last member %d", k);
  rpl_trace_entry e; /* the trace says the same */
  REQUIRE(rpl_comm_trace(c, round, &e, 1) == 1, "trace entry %llu", (unsigned long long)round);
  CHECK(e.round == o.round && e.group_id == o.group_id && e.nmembers == o.nmembers &&
            memcmp(e.members, got, sizeof(int) * (size_t)n) == 0,
        "trace and last differ");
}

/* rpl_comm_partial_group: round `round` has this group (waiting up to 10 s for it). */
static void check_group(rpl_comm *c, uint64_t round, uint64_t gid, const int *m, int n,
                        int given) {
  rpl_round_outcome o;
  int got[N];
  int rc = rpl_comm_partial_group(c, round, 10, &o, got, N);
  REQUIRE(rc == 1, "round %llu's group: rc %d", (unsigned long long)round, rc);
  CHECK(o.round == round && o.group_id == gid && o.nmembers == n && o.given == given &&
            o.status == RPL_OK && o.moved == 0,
        "group: round %llu gid %llu n %d given %d", (unsigned long long)o.round,
        (unsigned long long)o.group_id, o.nmembers, o.given);
  for (int k = 0; k < n && k < o.nmembers; k++) CHECK(got[k] == m[k], "group member %d", k);
}

static void refusals(rpl_comm *c, int r) {
  int m4[N + 1] = {0, 1, 2, 3, 3};
  give(c, m4, 0, 5, "1 to 4");
  give(c, m4, N + 1, 5, "1 to 4");
  int out[2] = {r, N};
  give(c, out, 2, 5, "out of range");
  int neg[2] = {-1, r};
  give(c, neg, 2, 5, "out of range");
  int unsorted[2] = {r == 0 ? 1 : r, r == 0 ? 0 : 0};
  give(c, unsorted, 2, 5, "sorted and distinct");
  int dup[2] = {r, r};
  give(c, dup, 2, 5, "sorted and distinct");
  int other[1] = {(r + 1) % N};
  give(c, other, 1, 5, "not among");
  int pair[2] = {r < 2 ? r : 0, r < 2 ? 2 : r};
  give(c, pair, 2, 0, "nonzero group id");
}

/* rpl_comm_partial_expect, from round 4: a round submitted before its group is known waits
 * for the give; one whose give never comes fails at its deadline, and the late give is
 * refused; the schedule's rounds go on after. */
static void expected_rounds(rpl_comm *c, int r) {
  rpl_error err = {RPL_OK, ""};
  double x[LEN];
  int pair[2] = {r < 2 ? 0 : 2, r < 2 ? 1 : 3};
  for (int i = 0; i < LEN; i++) x[i] = input(r, i);
  OK(rpl_comm_partial_expect(c, &e_));
  rpl_status st = rpl_comm_partial_expect(c, &err);
  CHECK(st == RPL_ERR_INVALID && strstr(err.msg, "already has or expects"), "expect twice: %s",
        err.msg);
  rpl_buf b = {x, LEN, RPL_FLOAT64};
  rpl_op_desc d = {.kind = RPL_OP_PARTIAL_ALLREDUCE, .redop = RPL_AVG, .in = &b, .nin = 1};
  req q;
  submit(c, d, &q);
  st = rpl_comm_partial_expect(c, &err);
  CHECK(st == RPL_ERR_INVALID && strstr(err.msg, "still queued or running"),
        "expect with a round queued: %s", err.msg);
  sleep_s(0.05); /* the round is waiting for its group by now, most likely: give it late */
  give(c, pair, 2, 300 + (uint64_t)pair[0], NULL);
  CHECK(wait_for(&q, 30) == 0 && q.st == RPL_OK, "expected round: %s", q.err.msg);
  req_free(&q);
  check_mean(x, pair, 2, "a round given its group after it was submitted");
  check_last(c, 4, 300 + (uint64_t)pair[0], pair, 2, 1, 1);

  /* Round 5: expected, never given: it fails at its own (short) deadline. */
  OK(rpl_comm_partial_expect(c, &e_));
  d.timeout_s = 0.2;
  st = run_op(c, d, &err);
  CHECK(st == RPL_ERR_TIMEOUT && strstr(err.msg, "was not given before its deadline"),
        "an expected round without a give: %s: %s", rpl_status_name(st), err.msg);
  int one[1] = {r};
  give(c, one, 1, 0, "already ended without it");
  give(c, one, 1, 0, NULL); /* refused once; then a give is a give again */
  d.timeout_s = 0;
  round_avg(c, x, RPL_AVG); /* round 6 takes that group of one */
  check_last(c, 6, 0, one, 1, 0, 1);
}

static void body_given(job *j, rpl_comm *c) {
  int r = j->rank;
  int one[1] = {r};
  give(c, one, 1, 0, "not enabled");
  OK(rpl_comm_fence_alone(c, &e_)); /* partial rounds off: nothing to leave */
  rpl_domain *dom;
  OK(rpl_domain_create(&dom, &e_));
  rpl_partial_config pc = {.schedule = "static", .trace = 1, .timeout_s = 20, .domain = dom};
  OK(rpl_comm_enable_partial(c, &pc, &e_));
  rpl_round_outcome o;
  int got[N];
  CHECK(rpl_comm_partial_last(c, &o, got, N) == 0, "no last round before the first");
  CHECK(rpl_comm_partial_group(c, 0, 0.01, &o, got, N) == -1, "no group before the first");
  refusals(c, r);

  /* Round 0: ranks 0-2 given one group, rank 3 alone; rank 0 gives twice. */
  static const int three[3] = {0, 1, 2};
  double x[LEN];
  for (int i = 0; i < LEN; i++) x[i] = input(r, i);
  if (r < 3) give(c, three, 3, 77, NULL);
  else give(c, one, 1, 0, NULL);
  if (r == 0) give(c, three, 3, 78, "id 77, 3 members");
  round_avg(c, x, RPL_AVG);
  if (r < 3) {
    check_mean(x, three, 3, "given round of three");
    check_last(c, 0, 77, three, 3, 1, 1);
  } else {
    check_mean(x, one, 1, "given group of one");
    check_last(c, 0, 0, one, 1, 0, 1);
  }

  /* Round 1: the schedule again, at round number 1. */
  for (int i = 0; i < LEN; i++) x[i] = input(r, i);
  round_avg(c, x, RPL_AVG);
  int sched[N], n = 0;
  uint64_t gid = 0;
  rpl_layout *l;
  OK(rpl_layout_create(N, NULL, &l, &e_));
  OK(rpl_static_group(l, r, 1, sched, N, &n, &gid, &e_));
  rpl_layout_destroy(l);
  check_mean(x, sched, n, "the schedule's round after a given one");
  check_last(c, 1, gid, sched, n, n > 1, 0);
  check_group(c, 1, gid, sched, n, 0);
  CHECK(rpl_comm_partial_group(c, 0, 0, &o, got, N) == 0, "round 0's group was replaced");

  /* Round 2: pairs {0,1} and {2,3}; rank 1 comes late, so rank 0's round is still queued or
   * running when it tries to give again. SUM: size/|G| times the pair's sum. */
  int pair[2] = {r < 2 ? 0 : 2, r < 2 ? 1 : 3};
  for (int i = 0; i < LEN; i++) x[i] = input(r, i);
  if (r == 1) sleep_s(0.3);
  give(c, pair, 2, 100 + (uint64_t)pair[0], NULL);
  rpl_buf b = {x, LEN, RPL_FLOAT64};
  rpl_op_desc d = {.kind = RPL_OP_PARTIAL_ALLREDUCE, .redop = RPL_SUM, .in = &b, .nin = 1};
  req q;
  submit(c, d, &q);
  check_group(c, 2, 100 + (uint64_t)pair[0], pair, 2, 1); /* rank 1 may not have come yet */
  if (r == 0) {
    give(c, pair, 2, 100, "still queued or running");
    rpl_error err = {RPL_OK, ""};
    rpl_status st = rpl_comm_fence_alone(c, &err);
    CHECK(st == RPL_ERR_INVALID && strstr(err.msg, "still queued or running"),
          "fence_alone with a round queued: %s: %s", rpl_status_name(st), err.msg);
  }
  CHECK(wait_for(&q, 30) == 0 && q.st == RPL_OK, "given SUM round: %s", q.err.msg);
  req_free(&q);
  for (int i = 0; i < LEN; i++) x[i] /= N; /* the SUM's size/|G| scaling, undone to a mean */
  check_mean(x, pair, 2, "given pair, SUM");
  check_last(c, 2, 100 + (uint64_t)pair[0], pair, 2, 1, 1);
  CHECK(rpl_comm_partial_group(c, 3, 0.01, &o, got, N) == -1, "round 3 has not started");

  rpl_partial_stats s;
  rpl_comm_partial_stats(c, &s);
  CHECK(s.rounds == 3 && s.given == 2 && s.failed == 0, "rounds %llu given %llu failed %llu",
        (unsigned long long)s.rounds, (unsigned long long)s.given,
        (unsigned long long)s.failed);
  CHECK(s.reduced + s.singletons == 3, "reduced %llu singletons %llu",
        (unsigned long long)s.reduced, (unsigned long long)s.singletons);

  /* Out of the fence domain, the domain can go before the communicator, and rounds go on. */
  OK(rpl_comm_fence_alone(c, &e_));
  rpl_domain_destroy(dom);
  for (int i = 0; i < LEN; i++) x[i] = input(r, i);
  round_avg(c, x, RPL_AVG);
  OK(rpl_layout_create(N, NULL, &l, &e_));
  OK(rpl_static_group(l, r, 3, sched, N, &n, &gid, &e_));
  rpl_layout_destroy(l);
  check_mean(x, sched, n, "a round after leaving the fence domain");
  expected_rounds(c, r);
}

int main(void) {
  g_layout = (world_layout){.hosts = 2}; /* rings and sockets in the same group */
  run_world(N, 30, body_given, NULL);
  g_layout = (world_layout){.hosts = 1};
  run_world(N, 30, body_given, NULL);
  return report("given");
}
