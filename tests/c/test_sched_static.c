/* Static schedule: Figure 10 exactly for 4 workers per host, and for other layouts the
 * properties the schedule promises: every round a partition that all members agree on,
 * periodic, connected over one period. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpl_sched.h"

#include "check.h"

static int group_of(const rpl_layout *l, int rank, uint64_t round, int *m, uint64_t *gid) {
  rpl_error err;
  int n = 0;
  rpl_status st = rpl_static_group(l, rank, round, m, rpl_layout_workers(l), &n, gid, &err);
  REQUIRE(st == RPL_OK, "rpl_static_group: %s", err.msg);
  return n;
}

static int same_set(const int *a, int na, const int *b, int nb) {
  if (na != nb) return 0;
  for (int i = 0; i < na; i++)
    if (a[i] != b[i]) return 0;
  return 1;
}

/* Expected group under Figure 10 (4 per host), written from the table, not from the rule. */
static int fig10(const rpl_layout *l, int r, int phase, int *m) {
  int h = rpl_layout_host(l, r), j = rpl_layout_local(l, r), H = rpl_layout_hosts(l), n = 0;
#define R(hh, jj) rpl_layout_rank(l, (hh), (jj))
  switch (phase) {
    case 0:
      if (j == 0)
        for (int g = 0; g < H; g++) m[n++] = R(g, 0);
      else if (j == 1) m[n++] = r;
      else { m[n++] = R(h, 2); m[n++] = R(h, 3); }
      break;
    case 1:
    case 3:
      for (int k = 0; k < 4; k++) m[n++] = R(h, k);
      break;
    case 2:
      if (j == 0 || j == 3) { m[n++] = R(h, 0); m[n++] = R(h, 3); }
      else if (j == 2) m[n++] = r;
      else {
        int o = (h + H / 2) % H;
        m[n++] = R(h, 1);
        if (o != h) m[n++] = R(o, 1);
      }
      break;
  }
#undef R
  /* sort */
  for (int a = 1; a < n; a++)
    for (int b = a; b > 0 && m[b - 1] > m[b]; b--) { int t = m[b]; m[b] = m[b - 1]; m[b - 1] = t; }
  return n;
}

static void test_figure10(void) {
  int hosts_list[] = {2, 4, 6, 8};
  for (size_t hi = 0; hi < sizeof hosts_list / sizeof *hosts_list; hi++) {
    int H = hosts_list[hi], N = 4 * H;
    rpl_layout *l;
    rpl_error err;
    REQUIRE(rpl_layout_create_uniform(N, 4, &l, &err) == RPL_OK, "%s", err.msg);
    int got[64], want[64];
    for (uint64_t round = 0; round < 12; round++)
      for (int r = 0; r < N; r++) {
        int ng = group_of(l, r, round, got, NULL);
        int nw = fig10(l, r, (int)(round % 4), want);
        REQUIRE(same_set(got, ng, want, nw), "H=%d rank %d round %llu differs from Figure 10", H,
                r, (unsigned long long)round);
      }
    rpl_layout_destroy(l);
  }
  /* Figure 9 (16 workers): W0, W4, W8, W12 in one group in round 4k; W2, W6, W10, W14 skip
   * round 4k+2. */
  rpl_layout *l;
  rpl_error err;
  REQUIRE(rpl_layout_create_uniform(16, 4, &l, &err) == RPL_OK, "%s", err.msg);
  int m[16];
  int n = group_of(l, 8, 4, m, NULL);
  REQUIRE(n == 4 && m[0] == 0 && m[1] == 4 && m[2] == 8 && m[3] == 12, "Figure 9 row 0");
  for (int r = 2; r < 16; r += 4) REQUIRE(group_of(l, r, 6, m, NULL) == 1, "W%d skips 4k+2", r);
  /* A host's workers need not be contiguous ranks: labels interleaved. */
  int labels[16];
  for (int r = 0; r < 16; r++) labels[r] = 100 + (r % 4); /* host k = ranks k, k+4, ... */
  rpl_layout *li;
  REQUIRE(rpl_layout_create(16, labels, &li, &err) == RPL_OK, "%s", err.msg);
  REQUIRE(rpl_layout_hosts(li) == 4 && rpl_layout_host(li, 5) == 1 && rpl_layout_local(li, 5) == 1,
          "interleaved layout");
  int want[16];
  for (uint64_t round = 0; round < 4; round++)
    for (int r = 0; r < 16; r++) {
      int ng = group_of(li, r, round, m, NULL), nw = fig10(li, r, (int)round, want);
      REQUIRE(same_set(m, ng, want, nw), "interleaved rank %d round %llu", r,
              (unsigned long long)round);
    }
  rpl_layout_destroy(li);
  rpl_layout_destroy(l);
  /* A short buffer fails cleanly and says how much is needed. */
  REQUIRE(rpl_layout_create_uniform(16, 4, &l, &err) == RPL_OK, "%s", err.msg);
  int small[2];
  int need = 0;
  REQUIRE(rpl_static_group(l, 0, 1, small, 2, &need, NULL, &err) == RPL_ERR_INVALID && need == 4,
          "short buffer must fail with the size needed");
  REQUIRE(rpl_static_group(l, 16, 1, small, 2, &need, NULL, &err) == RPL_ERR_INVALID, "bad rank");
  rpl_layout_destroy(l);
}

static int uf_find(int *p, int x) {
  while (p[x] != x) x = p[x] = p[p[x]];
  return x;
}

/* Partition, agreement, periodicity and connectivity for one layout. */
static void check_properties(const rpl_layout *l, const char *what) {
  int N = rpl_layout_workers(l);
  int *m = malloc(sizeof(int) * (size_t)N), *m2 = malloc(sizeof(int) * (size_t)N);
  int *owner = malloc(sizeof(int) * (size_t)N), *parent = malloc(sizeof(int) * (size_t)N);
  uint64_t *gids = malloc(sizeof(uint64_t) * (size_t)N);
  for (int r = 0; r < N; r++) parent[r] = r;
  for (uint64_t round = 0; round < 2 * RPL_STATIC_PERIOD; round++) {
    for (int r = 0; r < N; r++) owner[r] = -1;
    for (int r = 0; r < N; r++) {
      uint64_t gid, gid2;
      int n = group_of(l, r, round, m, &gid);
      REQUIRE(n >= 1, "%s: empty group", what);
      int self = 0;
      for (int i = 0; i < n; i++) {
        self |= m[i] == r;
        if (i) REQUIRE(m[i] > m[i - 1], "%s: members not sorted/unique", what);
      }
      REQUIRE(self, "%s: rank %d not in its own group (round %llu)", what, r,
              (unsigned long long)round);
      /* Every member computes the same group and id: a partition, not just a cover. */
      for (int i = 0; i < n; i++) {
        int n2 = group_of(l, m[i], round, m2, &gid2);
        REQUIRE(same_set(m, n, m2, n2) && gid == gid2, "%s: ranks %d and %d disagree (round %llu)",
                what, r, m[i], (unsigned long long)round);
      }
      if (owner[r] == -1) {
        for (int i = 0; i < n; i++) {
          REQUIRE(owner[m[i]] == -1, "%s: rank %d in two groups in round %llu", what, m[i],
                  (unsigned long long)round);
          owner[m[i]] = r;
        }
        gids[r] = gid;
      }
      /* Periodic. */
      uint64_t gid3;
      int n3 = group_of(l, r, round + 5 * RPL_STATIC_PERIOD, m2, &gid3);
      REQUIRE(same_set(m, n, m2, n3), "%s: not periodic", what);
      REQUIRE(gid3 != gid, "%s: group ids must differ across rounds", what);
      if (round < RPL_STATIC_PERIOD)
        for (int i = 1; i < n; i++) parent[uf_find(parent, m[i])] = uf_find(parent, m[0]);
    }
    /* Group ids unique within a round. */
    for (int a = 0; a < N; a++)
      if (owner[a] == a)
        for (int b = a + 1; b < N; b++)
          if (owner[b] == b) REQUIRE(gids[a] != gids[b], "%s: duplicate group id", what);
  }
  int root = uf_find(parent, 0);
  for (int r = 1; r < N; r++)
    REQUIRE(uf_find(parent, r) == root, "%s: rank %d not connected over one period", what, r);
  free(m);
  free(m2);
  free(owner);
  free(parent);
  free(gids);
}

static void test_layouts(void) {
  int per_host[] = {1, 2, 3, 4, 5, 8};
  int hosts[] = {1, 2, 3, 4, 5, 7, 16};
  char what[128];
  for (size_t a = 0; a < sizeof per_host / sizeof *per_host; a++)
    for (size_t b = 0; b < sizeof hosts / sizeof *hosts; b++) {
      rpl_layout *l;
      rpl_error err;
      int N = per_host[a] * hosts[b];
      REQUIRE(rpl_layout_create_uniform(N, per_host[a], &l, &err) == RPL_OK, "%s", err.msg);
      snprintf(what, sizeof what, "%d hosts x %d", hosts[b], per_host[a]);
      check_properties(l, what);
      rpl_layout_destroy(l);
    }
  /* Uneven and shuffled layouts from seeded random labels. */
  uint64_t s = 12345;
  for (int trial = 0; trial < 200; trial++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    int N = 1 + (int)((s >> 33) % 40);
    int nlabels = 1 + (int)((s >> 20) % 7);
    int *labels = malloc(sizeof(int) * (size_t)N);
    for (int r = 0; r < N; r++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      labels[r] = (int)((s >> 35) % (uint64_t)nlabels) * 7 - 3;
    }
    rpl_layout *l;
    rpl_error err;
    REQUIRE(rpl_layout_create(N, labels, &l, &err) == RPL_OK, "%s", err.msg);
    /* Layout sanity: local indices dense per host, hosts ordered by lowest rank. */
    int lastmin = -1;
    for (int h = 0; h < rpl_layout_hosts(l); h++) {
      int first = rpl_layout_rank(l, h, 0);
      REQUIRE(first > lastmin, "hosts not ordered by lowest rank");
      lastmin = first;
      for (int j = 0; j < rpl_layout_host_size(l, h); j++) {
        int r = rpl_layout_rank(l, h, j);
        REQUIRE(rpl_layout_host(l, r) == h && rpl_layout_local(l, r) == j, "layout inverse");
        REQUIRE(labels[r] == labels[first], "host mixes labels");
      }
    }
    snprintf(what, sizeof what, "random layout %d (N=%d)", trial, N);
    check_properties(l, what);
    rpl_layout_destroy(l);
    free(labels);
  }
  rpl_error err;
  rpl_layout *l;
  REQUIRE(rpl_layout_create(0, NULL, &l, &err) == RPL_ERR_INVALID, "0 workers rejected");
  REQUIRE(rpl_layout_create_uniform(4, 0, &l, &err) == RPL_ERR_INVALID, "per_host 0 rejected");
}

int main(void) {
  test_figure10();
  test_layouts();
  return report("test_sched_static");
}
