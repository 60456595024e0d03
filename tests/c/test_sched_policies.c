/* Dynamic policies (random, adpsgd, smart, smart+inter_intra, static) driven by a seeded
 * simulation of workers that compute, ask, reduce, report done, fence, die and leave. A tracer
 * checks, over many seeds, what the Group Generator promises:
 *   - the requester is always in its group, and every member receives the same group;
 *   - no worker is ever in two running groups;
 *   - every worker receives its groups in generation order (none skipped unless cancelled);
 *   - a Global Division groups exactly the idle workers that pass the slowdown filter, or
 *     wait already (deferred), or all idle ones for an isolated initiator;
 *   - only isolated workers join pending groups, and no worker gets more than max_isolated
 *     groups of one in a row, beyond a bounded hold, while others are about;
 *   - inter-intra groups respect hosts and heads;
 *   - workers keep making progress (no deadlock) and nothing leaks (ASan). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpl_sched.h"

#include "check.h"

static uint64_t rng_state;
static uint32_t rnd(uint32_t n) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)((rng_state >> 33) % n);
}

/* A Group Generator made from cfg (a compound literal naming only what is not zero); a
 * failure to create it ends the test. */
static rpl_gg *make_gg(rpl_gg_config cfg) {
  rpl_gg *gg;
  OK(rpl_gg_create(&cfg, &gg, &e_));
  return gg;
}

enum { W_COMPUTE, W_WAITING, W_RUNNING, W_FENCED, W_DEAD, W_LEFT };

typedef struct {
  int n;
  int *m;
  int cancelled;
  int handed_to;   /* members that received it */
  int division;
} grp;

typedef struct {
  int state;
  int timer;
  uint64_t round;
  uint64_t c;           /* counted requests, as the GG defines c_w */
  int counted;
  uint64_t last_round;
  uint64_t gid;         /* running group */
  int locked;           /* GG holds a lock for it (handed, no done yet) */
  int slow;             /* compute multiplier */
  int out;              /* declared dead; the GG revives it on its next request */
  uint64_t *gen;        /* groups generated with it, in generation order */
  int ngen, capgen, next;
  uint64_t rounds_done;
  int lonely;           /* groups of one in a row */
  int told_cancel;      /* a CANCEL is on its way to it: the GG no longer counts it waiting */
  int handed_soon;      /* a GROUP is on its way to it: the GG holds its lock already */
  double handed_at;     /* the GG's clock when its last group was handed, < 0 before */
  double pace;          /* its step as the GG measures it (handed -> next request), 0 = unknown */
  double free_at;       /* the GG's clock when it last left the GG (its done), < 0 unknown */
  double comp;          /* its compute step as the GG measures it (free_at -> request), 0 = unknown */
} wk;

typedef struct {
  rpl_policy policy;
  int n;
  int inter_intra;
  int c_thres;
  const rpl_layout *layout;
  wk *w;
  grp *g;               /* indexed by group id */
  int gcap;
  int *heads_of_div;    /* per host: head of the current division, -1 */
  int *in_div;          /* per worker: participant of the current division */
  uint64_t cur_div;
  uint64_t divisions, handed;
  double now;           /* the GG's clock: the last time passed to rpl_gg_advance */
  rpl_gg *gg;
} harness;

static harness H;
static uint64_t total_joins, total_singletons, total_groups; /* over every seed */

static int buffered(int w) { /* groups generated with w, not yet received, not cancelled */
  int k = 0;
  for (int i = H.w[w].next; i < H.w[w].ngen; i++) k += !H.g[H.w[w].gen[i]].cancelled;
  return k;
}

static int live(int w) {
  int s = H.w[w].state;
  if (H.w[w].out) return 0;
  return s == W_COMPUTE || s == W_WAITING || s == W_RUNNING;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The lower median of v(r) over the workers the GG holds live or fenced (those with v(r) > 0
 * only, if known_only); 0 if there are none. */
static double held_median(double (*v)(int r), int known_only) {
  double *a = malloc(sizeof *a * (size_t)H.n);
  int k = 0;
  for (int r = 0; r < H.n; r++)
    if (!H.w[r].out && H.w[r].state != W_DEAD && H.w[r].state != W_LEFT &&
        (!known_only || v(r) > 0))
      a[k++] = v(r);
  qsort(a, (size_t)k, sizeof *a, cmp_double);
  double m = k ? a[(k - 1) / 2] : 0;
  free(a);
  return m;
}
static double count_of(int r) { return (double)H.w[r].c; } /* exact: far below 2^53 */
static double comp_of(int r) { return H.w[r].comp; }
static double pace_of(int r) { return H.w[r].pace; }

/* The lower median of the counts of the workers the GG holds live or fenced. */
static uint64_t bulk_count(void) { return (uint64_t)held_median(count_of, 0); }
/* ... of their known compute steps (0 = none known). */
static double bulk_comp(void) { return held_median(comp_of, 1); }
/* ... of their steps (0 = unknown). */
static double bulk_pace(void) { return held_median(pace_of, 0); }

static void tracer(void *ctx, const rpl_gg_trace *t) {
  (void)ctx;
  if (t->kind == RPL_TRACE_DIVISION) {
    REQUIRE(H.policy == RPL_POLICY_SMART, "division under %s", rpl_policy_name(H.policy));
    H.divisions++;
    H.cur_div = t->division;
    const wk *ini = &H.w[t->initiator];
    uint64_t bulk = bulk_count();
    double pace = bulk_pace(), comp = bulk_comp();
    for (int r = 0; r < H.n; r++) H.in_div[r] = 0;
    for (int i = 0; i < t->nmembers; i++) H.in_div[t->members[i]] = 1;
    REQUIRE(H.in_div[t->initiator], "initiator %d not in its division", t->initiator);
    for (int r = 0; r < H.n; r++) {
      const wk *x = &H.w[r];
      int idle = live(r) && buffered(r) == 0 && !x->locked && !x->handed_soon;
      int pass = H.c_thres < 0 || ini->c <= x->c || ini->c - x->c < (uint64_t)H.c_thres;
      pass |= bulk <= x->c || bulk - x->c < (uint64_t)H.c_thres; /* behind i, not the bulk */
      if (x->comp > 0 && comp > 0) /* behind, not slow (speed: the compute step) */
        pass |= !(x->comp > 1.5 * comp);
      else
        pass |= x->pace > 0 && pace > 0 && !(x->pace > 1.5 * pace);
      pass |= x->state == W_WAITING && !x->told_cancel;     /* deferred: waits already */
      pass |= ini->lonely >= RPL_GG_DEFAULT_MAX_ISOLATED;   /* isolated initiator widens */
      if (r == t->initiator) continue;
      if (H.in_div[r] != (idle && pass)) {
        fprintf(stderr, "state=%d buffered=%d locked=%d out=%d\n", x->state, buffered(r), x->locked, x->out);
        rpl_gg_worker_info wi; rpl_error ee;
        rpl_gg_worker(H.gg, r, &wi, &ee);
        fprintf(stderr, "gg: state=%d waiting=%d buffered=%d locked=%llu deferred=%d lonely=%u c=%llu\n", wi.state, wi.waiting, wi.buffered, (unsigned long long)wi.locked_group, wi.deferred, wi.lonely, (unsigned long long)wi.requests);
        rpl_gg_worker(H.gg, t->initiator, &wi, &ee);
        fprintf(stderr, "ini gg: state=%d waiting=%d buffered=%d deferred=%d lonely=%u c=%llu harness lonely=%d\n", wi.state, wi.waiting, wi.buffered, wi.deferred, wi.lonely, (unsigned long long)wi.requests, ini->lonely);
      }
      REQUIRE(H.in_div[r] == (idle && pass),
              "division by %d: worker %d idle=%d pass=%d (c %llu vs %llu) but participant=%d",
              t->initiator, r, idle, pass, (unsigned long long)ini->c, (unsigned long long)x->c,
              H.in_div[r]);
    }
    for (int h = 0; h < rpl_layout_hosts(H.layout); h++) H.heads_of_div[h] = -1;
    return;
  }
  if (t->kind == RPL_TRACE_CREATED) {
    uint64_t id = t->group_id;
    REQUIRE(id > 0, "group id 0");
    if ((int)id >= H.gcap) {
      int cap = H.gcap ? 2 * H.gcap : 1024;
      while (cap <= (int)id) cap *= 2;
      H.g = realloc(H.g, sizeof *H.g * (size_t)cap);
      memset(H.g + H.gcap, 0, sizeof *H.g * (size_t)(cap - H.gcap));
      H.gcap = cap;
    }
    grp *g = &H.g[id];
    REQUIRE(g->m == NULL, "group id %llu reused", (unsigned long long)id);
    g->n = t->nmembers;
    g->m = malloc(sizeof(int) * (size_t)g->n);
    memcpy(g->m, t->members, sizeof(int) * (size_t)g->n);
    g->division = (int)t->division;
    int self = 0;
    for (int i = 0; i < g->n; i++) {
      int m = g->m[i];
      REQUIRE(m >= 0 && m < H.n && (i == 0 || m > g->m[i - 1]), "members sorted, unique, valid");
      self |= m == t->initiator;
      REQUIRE(live(m) || m == t->initiator, "group %llu includes worker %d, which is out",
              (unsigned long long)id, m);
      wk *x = &H.w[m];
      if (x->ngen == x->capgen) {
        x->capgen = x->capgen ? 2 * x->capgen : 16;
        x->gen = realloc(x->gen, sizeof *x->gen * (size_t)x->capgen);
      }
      x->gen[x->ngen++] = id;
    }
    if (H.policy == RPL_POLICY_RANDOM || H.policy == RPL_POLICY_ADPSGD) {
      REQUIRE(self, "requester %d not in the group it caused", t->initiator);
      int want = H.policy == RPL_POLICY_ADPSGD ? 2 : 3;
      int lv = 0;
      for (int r = 0; r < H.n; r++) lv += live(r) || r == t->initiator;
      REQUIRE(g->n == (want < lv ? want : lv), "group of %d, expected %d", g->n, want);
    }
    if (H.policy == RPL_POLICY_SMART) {
      REQUIRE(t->division == H.cur_div, "group outside its division");
      for (int i = 0; i < g->n; i++)
        REQUIRE(H.in_div[g->m[i]], "division group has non-participant %d", g->m[i]);
      /* A group of one is a no-op round: only a division of one makes one. */
      int ndiv = 0;
      for (int r = 0; r < H.n; r++) ndiv += H.in_div[r];
      REQUIRE(g->n > 1 || ndiv == 1, "a group of one in a division of %d", ndiv);
      if (H.inter_intra) {
        const rpl_layout *l = H.layout;
        int h0 = rpl_layout_host(l, g->m[0]);
        if (t->phase == RPL_PHASE_INTER && t->heads) {
          for (int i = 0; i < g->n; i++) {
            int h = rpl_layout_host(l, g->m[i]);
            REQUIRE(H.heads_of_div[h] == -1, "two heads of host %d in one division", h);
            H.heads_of_div[h] = g->m[i];
          }
        } else if (t->phase == RPL_PHASE_INTER) {
          for (int i = 0; i < g->n; i++) {
            int h = rpl_layout_host(l, g->m[i]);
            REQUIRE(h == h0, "non-head Inter group spans hosts");
            REQUIRE(H.heads_of_div[h] != g->m[i], "a head in a non-head group");
          }
        } else {
          REQUIRE(t->phase == RPL_PHASE_INTRA, "phase %d under inter_intra", (int)t->phase);
          int cnt = 0;
          for (int r = 0; r < H.n; r++) cnt += H.in_div[r] && rpl_layout_host(l, r) == h0;
          for (int i = 0; i < g->n; i++)
            REQUIRE(rpl_layout_host(l, g->m[i]) == h0, "Intra group spans hosts");
          REQUIRE(cnt == g->n, "Intra group of host %d has %d of its %d participants", h0, g->n,
                  cnt);
          /* Each head found in an Inter heads group when several hosts take part. */
        }
      } else {
        REQUIRE(t->phase == RPL_PHASE_PLAIN, "plain smart phase");
      }
    }
    return;
  }
  if (t->kind == RPL_TRACE_HANDED) { /* one call may hand a group, then divide again */
    for (int i = 0; i < t->nmembers; i++) {
      H.w[t->members[i]].handed_soon = 1;
      H.w[t->members[i]].handed_at = H.now;
    }
    return;
  }
  if (t->kind == RPL_TRACE_JOINED) {
    REQUIRE(t->group_id < (uint64_t)H.gcap && H.g[t->group_id].m, "join of unknown group");
    grp *g = &H.g[t->group_id];
    wk *x = &H.w[t->initiator];
    REQUIRE(x->state == W_WAITING && buffered(t->initiator) == 0,
            "worker %d joined a group while not waiting with an empty buffer", t->initiator);
    REQUIRE(x->lonely >= RPL_GG_DEFAULT_MAX_ISOLATED, "worker %d joined without being isolated",
            t->initiator);
    REQUIRE(t->nmembers == g->n + 1 && g->handed_to == 0 && !g->cancelled, "join bookkeeping");
    free(g->m);
    g->n = t->nmembers;
    g->m = malloc(sizeof(int) * (size_t)g->n);
    memcpy(g->m, t->members, sizeof(int) * (size_t)g->n);
    if (x->ngen == x->capgen) {
      x->capgen = x->capgen ? 2 * x->capgen : 16;
      x->gen = realloc(x->gen, sizeof *x->gen * (size_t)x->capgen);
    }
    x->gen[x->ngen++] = t->group_id;
    total_joins++;
    return;
  }
  if (t->kind == RPL_TRACE_CANCELLED) {
    REQUIRE(t->group_id < (uint64_t)H.gcap && H.g[t->group_id].m, "cancel of unknown group");
    REQUIRE(H.g[t->group_id].handed_to == 0, "cancelled a group already handed");
    for (int i = 0; i < t->nmembers; i++) { /* the GG tells waiting members it was first for */
      wk *x = &H.w[t->members[i]];
      int k = x->next;
      while (k < x->ngen && H.g[x->gen[k]].cancelled) k++;
      if (x->state == W_WAITING && k < x->ngen && x->gen[k] == t->group_id) x->told_cancel = 1;
    }
    H.g[t->group_id].cancelled = 1;
    return;
  }
}

/* The worker received group gid: it must be the next non-cancelled generated one. */
static void on_group(int w, uint64_t gid, const int *members, int n) {
  wk *x = &H.w[w];
  REQUIRE(x->state == W_WAITING, "worker %d got a group while not waiting (state %d)", w,
          x->state);
  REQUIRE(!x->locked, "worker %d handed a group while running another", w);
  REQUIRE(gid < (uint64_t)H.gcap && H.g[gid].m, "unknown group %llu", (unsigned long long)gid);
  grp *g = &H.g[gid];
  REQUIRE(!g->cancelled, "handed a cancelled group");
  REQUIRE(n == g->n && memcmp(members, g->m, sizeof(int) * (size_t)n) == 0,
          "members differ from the generated group");
  int self = 0;
  for (int i = 0; i < n; i++) self |= members[i] == w;
  REQUIRE(self, "worker %d not in the group it received", w);
  if (H.policy != RPL_POLICY_STATIC) {
    while (x->next < x->ngen && H.g[x->gen[x->next]].cancelled) x->next++;
    REQUIRE(x->next < x->ngen && x->gen[x->next] == gid,
            "worker %d received group %llu out of generation order (expected %llu)", w,
            (unsigned long long)gid,
            (unsigned long long)(x->next < x->ngen ? x->gen[x->next] : 0));
    x->next++;
  } else {
    rpl_error e;
    int want[256], nw = 0;
    REQUIRE(rpl_static_group(H.layout, w, x->round, want, 256, &nw, NULL, &e) == RPL_OK, "%s",
            e.msg);
    REQUIRE(nw == n && memcmp(want, members, sizeof(int) * (size_t)n) == 0,
            "static group of %d round %llu differs from the schedule", w,
            (unsigned long long)x->round);
  }
  g->handed_to++;
  total_groups++;
  total_singletons += n == 1;
  x->handed_soon = 0;
  x->lonely = n == 1 ? x->lonely + 1 : 0;
  x->state = W_RUNNING;
  x->gid = gid;
  x->locked = 1;
  x->timer = (int)rnd(3);
}

static void count_request(wk *x) {
  if (!x->counted || x->last_round != x->round) {
    x->c++;
    x->counted = 1;
    x->last_round = x->round;
    if (x->handed_at >= 0 && H.now > x->handed_at) { /* as the GG measures a step */
      double dt = H.now - x->handed_at;
      x->pace = x->pace > 0 ? x->pace + (dt - x->pace) / 16 : dt;
    }
    if (x->free_at >= 0 && x->free_at >= x->handed_at && H.now >= x->free_at) {
      double dt = H.now - x->free_at, w = dt > x->comp ? 1.0 / 3 : 1.0 / 8;
      x->comp = x->comp > 0 ? x->comp + (dt - x->comp) * w : dt;
    }
  }
}

typedef struct {
  rpl_policy policy;
  int n;
  int per_host;   /* 0 = random uneven hosts */
  int inter_intra;
  int c_thres;
  int churn;      /* fences, deaths, leaves */
  int steps;
} scenario;

static uint64_t run(const scenario *sc, uint64_t seed) {
  memset(&H, 0, sizeof H);
  rng_state = seed * 2654435761u + 7;
  H.policy = sc->policy;
  H.n = sc->n;
  H.inter_intra = sc->inter_intra;
  int *labels = malloc(sizeof(int) * (size_t)sc->n);
  for (int r = 0; r < sc->n; r++)
    labels[r] = sc->per_host ? r / sc->per_host : (int)rnd(1 + (uint32_t)sc->n / 3);
  rpl_gg *gg = make_gg((rpl_gg_config){
      .policy = sc->policy, .nworkers = sc->n, .host_of = labels, .inter_intra = sc->inter_intra,
      .c_thres = sc->c_thres, .seed = seed, .trace = tracer,
      .arrival_filter = -1}); /* the tracer checks the paper's division rule (tested below) */
  H.gg = gg;
  H.layout = rpl_gg_layout(gg);
  H.c_thres = rpl_gg_c_thres(gg);
  H.w = calloc((size_t)sc->n, sizeof *H.w);
  H.heads_of_div = malloc(sizeof(int) * (size_t)rpl_layout_hosts(H.layout));
  H.in_div = calloc((size_t)sc->n, sizeof(int));
  for (int r = 0; r < sc->n; r++) {
    H.w[r].timer = (int)rnd(4);
    H.w[r].slow = rnd(8) == 0 ? 4 : 1;
    H.w[r].handed_at = H.w[r].free_at = -1;
  }
  int *mem = malloc(sizeof(int) * (size_t)sc->n);
  uint64_t hash = 1469598103934665603ull;
  for (int step = 0; step < sc->steps; step++) {
    for (int r = 0; r < sc->n; r++) {
      wk *x = &H.w[r];
      switch (x->state) {
        case W_COMPUTE:
          if (x->timer > 0) { x->timer--; break; }
          if (sc->churn && rnd(40) == 0) { /* an exact collective: fence around it */
            /* The harness's view changes first: the call may trigger divisions (deferred
             * requests re-checked) whose trace is checked against it. */
            x->out = 0; /* a fence from a worker declared dead shows it is back */
            x->state = W_FENCED;
            x->free_at = -1; /* an exact collective is no compute step */
            OK(rpl_gg_fence(gg, r, &e_));
            x->timer = 1 + (int)rnd(4);
            break;
          }
          if (sc->churn && rnd(3000) == 0) {
            x->state = W_DEAD;
            x->locked = 0;
            x->out = 1;
            OK(rpl_gg_dead(gg, r, &e_));
            x->timer = 20 + (int)rnd(50);
            break;
          }
          count_request(x);
          x->locked = 0;
          x->out = 0;
          x->state = W_WAITING;
          OK(rpl_gg_request(gg, r, x->round, &e_));
          break;
        case W_RUNNING:
          if (x->timer > 0) { x->timer--; break; }
          /* Usually report done; sometimes not, so the next request releases the lock. */
          if (rnd(50) != 0) {
            if (x->locked) x->free_at = H.now;
            x->locked = 0;
            OK(rpl_gg_done(gg, r, x->gid, &e_));
          }
          x->round++;
          x->rounds_done++;
          x->state = W_COMPUTE;
          x->timer = (int)rnd(3) * x->slow;
          break;
        case W_FENCED:
          if (x->timer > 0) { x->timer--; break; }
          x->state = W_COMPUTE;
          OK(rpl_gg_unfence(gg, r, &e_));
          break;
        case W_DEAD:
          if (x->timer > 0) { x->timer--; break; }
          x->state = W_COMPUTE; /* comes back: its next request revives it */
          break;
        default: break;
      }
      if (sc->churn && x->state == W_COMPUTE && step > sc->steps / 2 && rnd(2000) == 0) {
        x->state = W_LEFT;
        x->locked = 0;
        OK(rpl_gg_leave(gg, r, &e_));
      }
      /* One step is 10 ms of the GG's clock: waits for partners end on it. */
      H.now = step * 0.01 + r * 1e-5; /* first: advancing may hand groups */
      OK(rpl_gg_advance(gg, H.now, &e_));
      rpl_gg_event ev;
      while (rpl_gg_poll(gg, &ev, mem, sc->n)) {
        hash = (hash ^ (ev.group_id * 31 + (uint64_t)ev.worker + ev.kind)) * 1099511628211ull;
        wk *y = &H.w[ev.worker];
        if (ev.kind == RPL_EV_GROUP) {
          REQUIRE(ev.round == y->round, "GROUP answers round %llu, worker asked %llu",
                  (unsigned long long)ev.round, (unsigned long long)y->round);
          on_group(ev.worker, ev.group_id, mem, ev.nmembers);
          H.handed++;
        } else {
          REQUIRE(ev.kind == RPL_EV_CANCEL, "unknown event");
          REQUIRE(y->state == W_WAITING, "cancel to a worker not waiting");
          REQUIRE(ev.culprit >= 0 && ev.culprit != ev.worker, "cancel culprit");
          REQUIRE(H.g[ev.group_id].cancelled, "cancel event for a live group");
          /* Ask again at once, same round (not counted again). */
          y->told_cancel = 0;
          count_request(y);
          OK(rpl_gg_request(gg, ev.worker, y->round, &e_));
        }
      }
    }
  }
  /* Progress: every worker that stayed in made rounds. */
  for (int r = 0; r < sc->n; r++)
    if (H.w[r].state != W_LEFT)
      REQUIRE(H.w[r].rounds_done >= (uint64_t)sc->steps / 40,
              "%s n=%d seed %llu: worker %d made only %llu rounds in %d steps",
              rpl_policy_name(sc->policy), sc->n, (unsigned long long)seed, r,
              (unsigned long long)H.w[r].rounds_done, sc->steps);
  /* Everyone leaves: nothing stays pending, and every group was handed to all or none. */
  for (int r = 0; r < sc->n; r++) {
    if (H.w[r].state == W_LEFT) continue;
    H.w[r].state = W_LEFT;
    OK(rpl_gg_leave(gg, r, &e_));
  }
  rpl_gg_event ev;
  while (rpl_gg_poll(gg, &ev, mem, sc->n)) { /* a worker left alone got its last group */
    if (ev.kind == RPL_EV_GROUP) H.g[ev.group_id].handed_to++;
  }
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.pending == 0, "%llu groups pending after everyone left",
          (unsigned long long)st.pending);
  REQUIRE(st.groups_created == st.groups_handed + st.groups_cancelled,
          "created != handed+cancelled");
  for (int id = 1; id < H.gcap; id++) {
    grp *g = &H.g[id];
    if (!g->m) continue;
    REQUIRE(g->cancelled ? g->handed_to == 0 : g->handed_to == g->n,
            "group %d handed to %d of %d members", id, g->handed_to, g->n);
  }
  if (sc->policy == RPL_POLICY_SMART) REQUIRE(H.divisions == st.divisions, "division count");
  if (sc->policy != RPL_POLICY_RANDOM && sc->policy != RPL_POLICY_ADPSGD)
    REQUIRE(st.conflicts == 0, "conflicts under %s", rpl_policy_name(sc->policy));
  rpl_gg_destroy(gg);
  for (int id = 1; id < H.gcap; id++) free(H.g[id].m);
  for (int r = 0; r < sc->n; r++) free(H.w[r].gen);
  free(H.g);
  free(H.w);
  free(H.heads_of_div);
  free(H.in_div);
  free(mem);
  free(labels);
  return hash ^ st.groups_handed;
}

static void test_many_seeds(void) {
  const scenario scs[] = {
      {RPL_POLICY_RANDOM, 8, 4, 0, 0, 1, 400},   {RPL_POLICY_RANDOM, 17, 0, 0, 0, 1, 400},
      {RPL_POLICY_ADPSGD, 8, 4, 0, 0, 1, 400},   {RPL_POLICY_ADPSGD, 13, 0, 0, 0, 1, 400},
      {RPL_POLICY_SMART, 8, 4, 0, 0, 1, 400},    {RPL_POLICY_SMART, 16, 4, 0, 2, 1, 400},
      {RPL_POLICY_SMART, 21, 0, 0, -1, 1, 400},  {RPL_POLICY_SMART, 16, 4, 1, 0, 1, 400},
      {RPL_POLICY_SMART, 24, 8, 1, 3, 1, 400},   {RPL_POLICY_SMART, 19, 0, 1, 0, 1, 400},
      {RPL_POLICY_SMART, 6, 1, 1, 0, 1, 400},    {RPL_POLICY_SMART, 5, 5, 1, 0, 1, 400},
      {RPL_POLICY_STATIC, 16, 4, 0, 0, 0, 300},  {RPL_POLICY_STATIC, 15, 0, 0, 0, 0, 300},
      {RPL_POLICY_RANDOM, 1, 1, 0, 0, 0, 100},   {RPL_POLICY_SMART, 2, 1, 1, 0, 1, 200},
      {RPL_POLICY_SMART, 200, 8, 1, 0, 1, 200},  {RPL_POLICY_RANDOM, 200, 8, 0, 0, 1, 200},
  };
  int seeds = 60;
  for (size_t i = 0; i < sizeof scs / sizeof *scs; i++) {
    int ns = scs[i].n >= 100 ? 4 : seeds;
    for (int s = 1; s <= ns; s++) {
      uint64_t a = run(&scs[i], (uint64_t)s);
      if (s <= 3) { /* deterministic given the seed */
        uint64_t b = run(&scs[i], (uint64_t)s);
        REQUIRE(a == b, "%s not deterministic for seed %d", rpl_policy_name(scs[i].policy), s);
      }
    }
    printf("  %-7s n=%-3d per_host=%d inter_intra=%d c_thres=%d churn=%d: %d seeds ok\n",
           rpl_policy_name(scs[i].policy), scs[i].n, scs[i].per_host, scs[i].inter_intra,
           scs[i].c_thres, scs[i].churn, ns);
  }
  /* Joins are rare here (the churn seldom isolates anyone since the slowdown filter looks at
   * the bulk of the job); test_isolated_joins_pending covers them. */
  printf("  %llu groups handed, %.1f%% of one, %llu isolated joins\n",
         (unsigned long long)total_groups, 100.0 * (double)total_singletons / (double)total_groups,
         (unsigned long long)total_joins);
}

/* Figure 11: with 4 idle workers, the first request divides all of them; the next request
 * gets its group from the buffer without another division. */
static void test_figure11(void) {
  rpl_gg *gg = make_gg((rpl_gg_config){.policy = RPL_POLICY_SMART, .nworkers = 4, .group_size = 2,
                                       .seed = 3, .partner_wait_ms = 10});
  OK(rpl_gg_request(gg, 0, 0, &e_));
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.divisions == 1 && st.groups_created == 2, "one division, two groups");
  for (int w = 0; w < 4; w++) {
    rpl_gg_worker_info wi;
    OK(rpl_gg_worker(gg, w, &wi, &e_));
    REQUIRE(wi.buffered == 1, "worker %d buffered %d", w, wi.buffered);
  }
  rpl_gg_worker_info w0;
  OK(rpl_gg_worker(gg, 0, &w0, &e_));
  int partner = -1;
  for (int w = 1; w < 4; w++) {
    rpl_gg_worker_info wi;
    OK(rpl_gg_worker(gg, w, &wi, &e_));
    if (wi.head_group == w0.head_group) partner = w;
  }
  REQUIRE(partner > 0, "worker 0 has a partner");
  int other = partner == 3 ? 1 : 3;
  rpl_gg_event ev;
  int m[4];
  REQUIRE(!rpl_gg_poll(gg, &ev, m, 4), "nothing handed before the partner asks");
  OK(rpl_gg_request(gg, other, 0, &e_));
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.divisions == 1, "second request served from the buffer");
  OK(rpl_gg_request(gg, partner, 0, &e_));
  REQUIRE(rpl_gg_poll(gg, &ev, m, 4) && ev.kind == RPL_EV_GROUP && ev.nmembers == 2, "handed");
  REQUIRE(rpl_gg_poll(gg, &ev, m, 4) && ev.kind == RPL_EV_GROUP, "both members told");
  REQUIRE(!rpl_gg_poll(gg, &ev, m, 4), "only two events");
  /* The remaining group waits for its last member, who fences: the waiting one is told. */
  int last = -1;
  for (int w = 1; w < 4; w++)
    if (w != other && w != partner) last = w;
  (void)last;
  int waiting = other, third = -1;
  for (int w = 1; w < 4; w++)
    if (w != other && w != partner && w != 0) third = w;
  REQUIRE(third >= 0, "third worker");
  OK(rpl_gg_fence(gg, third == waiting ? 0 : third, &e_));
  REQUIRE(rpl_gg_poll(gg, &ev, m, 4) && ev.kind == RPL_EV_CANCEL && ev.worker == waiting &&
              ev.reason == RPL_REASON_FENCED,
          "waiting member told of the cancel");
  /* Asking again: the fenced worker is left out and everyone else is busy, so it waits for
   * partners about to be free; when the wait ends first, it gets a group of one. */
  OK(rpl_gg_request(gg, waiting, 0, &e_));
  REQUIRE(!rpl_gg_poll(gg, &ev, m, 4), "the request waits for partners");
  REQUIRE(rpl_gg_next_deadline(gg) > 0.0099 && rpl_gg_next_deadline(gg) < 0.0101, "deadline");
  OK(rpl_gg_advance(gg, 0.005, &e_));
  REQUIRE(!rpl_gg_poll(gg, &ev, m, 4), "still waiting within the wait");
  OK(rpl_gg_advance(gg, 0.011, &e_));
  REQUIRE(rpl_gg_poll(gg, &ev, m, 4) && ev.kind == RPL_EV_GROUP && ev.nmembers == 1 &&
              m[0] == waiting,
          "group of one when no partner is available (got %d members)", ev.nmembers);
  rpl_gg_destroy(gg);
}

/* The slowdown filter keeps a worker far behind out of a fast worker's division, and lets it
 * in when off. */
static void filter_case(int c_thres, int expect_slow_in) {
  rpl_gg *gg = make_gg((rpl_gg_config){
      .policy = RPL_POLICY_SMART, .nworkers = 3, .group_size = 3, .c_thres = c_thres, .seed = 9,
      .partner_wait_ms = -1}); /* this test is about the filter: no waiting for the fenced one */
  rpl_gg_event ev;
  int m[3];
  OK(rpl_gg_fence(gg, 2, &e_)); /* worker 2 is busy elsewhere for a while */
  for (uint64_t r = 0; r < 4; r++) {
    OK(rpl_gg_request(gg, 0, r, &e_));
    OK(rpl_gg_request(gg, 1, r, &e_));
    int got = 0;
    uint64_t gid = 0;
    while (rpl_gg_poll(gg, &ev, m, 3)) {
      REQUIRE(ev.kind == RPL_EV_GROUP && ev.nmembers == 2, "fast pair");
      gid = ev.group_id;
      got++;
    }
    REQUIRE(got == 2, "both fast workers served");
    OK(rpl_gg_done(gg, 0, gid, &e_));
    OK(rpl_gg_done(gg, 1, gid, &e_));
  }
  OK(rpl_gg_unfence(gg, 2, &e_)); /* c_2 = 0, c_0 will be 5 */
  OK(rpl_gg_request(gg, 0, 4, &e_));
  rpl_gg_worker_info wi;
  OK(rpl_gg_worker(gg, 2, &wi, &e_));
  REQUIRE((wi.buffered > 0) == expect_slow_in, "c_thres=%d: slow worker buffered=%d", c_thres,
          wi.buffered);
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE((st.filtered > 0) == !expect_slow_in, "filtered count");
  rpl_gg_destroy(gg);
}

static void test_errors(void) {
  rpl_error e;
  rpl_gg *gg;
  rpl_gg_config cfg = {0};
  cfg.policy = RPL_POLICY_RANDOM;
  cfg.nworkers = 0;
  REQUIRE(rpl_gg_create(&cfg, &gg, &e) == RPL_ERR_INVALID, "0 workers");
  cfg.nworkers = 4;
  cfg.policy = (rpl_policy)17;
  REQUIRE(rpl_gg_create(&cfg, &gg, &e) == RPL_ERR_INVALID, "bad policy");
  cfg.policy = RPL_POLICY_RANDOM;
  REQUIRE(rpl_gg_create(&cfg, &gg, &e) == RPL_OK, "%s", e.msg);
  REQUIRE(rpl_gg_request(gg, 4, 0, &e) == RPL_ERR_INVALID, "rank out of range");
  REQUIRE(rpl_gg_request(gg, -1, 0, &e) == RPL_ERR_INVALID, "negative rank");
  REQUIRE(rpl_gg_leave(gg, 2, &e) == RPL_OK, "%s", e.msg);
  REQUIRE(rpl_gg_request(gg, 2, 0, &e) == RPL_ERR_CLOSED && strstr(e.msg, "left"),
          "request after leave: %s", e.msg);
  REQUIRE(rpl_gg_done(gg, 1, 12345, &e) == RPL_OK, "stale done is not an error");
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.stale_dones == 1, "stale done counted");
  rpl_gg_destroy(gg);
  rpl_policy p;
  REQUIRE(rpl_policy_parse("smart", &p, &e) == RPL_OK && p == RPL_POLICY_SMART, "parse");
  REQUIRE(rpl_policy_parse("bogus", &p, &e) == RPL_ERR_INVALID && strstr(e.msg, "bogus"), "parse");
}

static rpl_gg *make_smart(int n, int group_size, int wait_ms) {
  return make_gg((rpl_gg_config){.policy = RPL_POLICY_SMART, .nworkers = n,
                                 .group_size = group_size, .partner_wait_ms = wait_ms, .seed = 5});
}

/* Collects the GROUP events for worker w (members of the last one in m); returns its size. */
static int group_of(rpl_gg *gg, int w, int *m, int cap, uint64_t *gid, int *events) {
  rpl_gg_event ev;
  int size = 0, mm[64];
  while (rpl_gg_poll(gg, &ev, mm, 64)) {
    (*events)++;
    if (ev.kind == RPL_EV_GROUP && ev.worker == w) {
      size = ev.nmembers;
      if (gid) *gid = ev.group_id;
      if (m) memcpy(m, mm, sizeof(int) * (size_t)(size < cap ? size : cap));
    }
  }
  return size;
}

/* Three workers run a group; the fourth asks meanwhile. It waits for them rather than take a
 * group of one, and gets a full group once they are done. */
static void test_waits_for_busy_partners(void) {
  rpl_gg *gg = make_smart(4, 3, 50);
  int ev = 0;
  uint64_t gid = 0;
  for (int w = 0; w < 3; w++) OK(rpl_gg_request(gg, w, 0, &e_));
  /* 0 asked first with 1, 2, 3 idle: a division of all four (round(4/3) = 1 group). */
  rpl_gg_worker_info wi;
  OK(rpl_gg_worker(gg, 3, &wi, &e_));
  REQUIRE(wi.buffered == 1, "idle worker 3 is in the division");
  OK(rpl_gg_request(gg, 3, 0, &e_));
  REQUIRE(group_of(gg, 0, NULL, 0, &gid, &ev) == 4, "first group of four");
  for (int w = 0; w < 3; w++) OK(rpl_gg_done(gg, w, gid, &e_));
  /* Now 3 is still running while 0 asks: it waits for 3 (others idle: 1, 2 are enough). */
  OK(rpl_gg_request(gg, 0, 1, &e_));
  int size = group_of(gg, 0, NULL, 0, &gid, &ev);
  REQUIRE(size == 0, "0 has its group generated, waiting for its members");
  OK(rpl_gg_worker(gg, 0, &wi, &e_));
  REQUIRE(wi.buffered == 1 && !wi.deferred, "0's division was made at once (3 members idle)");
  rpl_gg_destroy(gg);

  /* Two of three busy: the asker waits, and a done is enough to end the wait. */
  gg = make_smart(3, 3, 50);
  ev = 0;
  for (int w = 0; w < 3; w++) OK(rpl_gg_request(gg, w, 0, &e_));
  REQUIRE(group_of(gg, 0, NULL, 0, &gid, &ev) == 3, "group of three");
  OK(rpl_gg_done(gg, 2, gid, &e_));
  OK(rpl_gg_request(gg, 2, 1, &e_));
  REQUIRE(group_of(gg, 2, NULL, 0, NULL, &ev) == 0, "2 waits for 0 and 1");
  OK(rpl_gg_worker(gg, 2, &wi, &e_));
  REQUIRE(wi.deferred && wi.buffered == 0, "2 is deferred");
  OK(rpl_gg_done(gg, 0, gid, &e_));
  OK(rpl_gg_done(gg, 1, gid, &e_));
  OK(rpl_gg_worker(gg, 2, &wi, &e_));
  REQUIRE(!wi.deferred && wi.buffered == 1, "2's group was made when its partners were free");
  OK(rpl_gg_request(gg, 0, 1, &e_));
  OK(rpl_gg_request(gg, 1, 1, &e_));
  REQUIRE(group_of(gg, 2, NULL, 0, NULL, &ev) == 3, "a full group, not one of one");
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.singletons_handed == 0 && st.deferred == 1 && st.wait_expired == 0, "stats");
  rpl_gg_destroy(gg);
}

/* Pairs (group size 2) over a division of three idle workers: one group of three, not a pair
 * and a no-op round of one. */
static void test_division_of_three_in_pairs(void) {
  rpl_gg *gg = make_smart(3, 2, 50);
  int ev = 0;
  for (int w = 0; w < 3; w++) OK(rpl_gg_request(gg, w, 0, &e_));
  REQUIRE(group_of(gg, 0, NULL, 0, NULL, &ev) == 3, "one group of three");
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.singletons_handed == 0 && st.groups_handed == 1, "no group of one: %llu of %llu",
          (unsigned long long)st.singletons_handed, (unsigned long long)st.groups_handed);
  rpl_gg_destroy(gg);
}

/* After an exact collective every worker is fenced; the first to come back must not find
 * everyone still fenced and take a group of one: it waits for the others to unfence. */
static void test_unfence_reentry(void) {
  for (int pol = RPL_POLICY_RANDOM; pol <= RPL_POLICY_ADPSGD; pol++) {
    rpl_gg_config cfg = {.policy = (rpl_policy)pol, .nworkers = 8, .group_size = 3, .seed = 11};
    rpl_gg *gg = make_gg(cfg);
    for (int w = 0; w < 8; w++) OK(rpl_gg_fence(gg, w, &e_));
    OK(rpl_gg_unfence(gg, 5, &e_));
    OK(rpl_gg_request(gg, 5, 0, &e_));
    int ev = 0;
    REQUIRE(group_of(gg, 5, NULL, 0, NULL, &ev) == 0 && ev == 0, "%s: 5 waits",
            rpl_policy_name(cfg.policy));
    for (int w = 0; w < 8; w++) {
      if (w == 5) continue;
      OK(rpl_gg_unfence(gg, w, &e_));
      OK(rpl_gg_request(gg, w, 0, &e_));
    }
    rpl_gg_event e;
    int mm[8], handed = 0;
    while (rpl_gg_poll(gg, &e, mm, 8)) {
      REQUIRE(e.kind == RPL_EV_GROUP && e.nmembers >= 2, "%s: worker %d got a group of %d",
              rpl_policy_name(cfg.policy), e.worker, e.nmembers);
      handed++;
    }
    rpl_gg_stats st;
    rpl_gg_get_stats(gg, &st);
    REQUIRE(handed >= 2 && st.singletons_handed == 0, "%s: no group of one after the fence",
            rpl_policy_name(cfg.policy));
    rpl_gg_destroy(gg);
  }
}

/* An isolated worker whose partners all have groups already joins the pending group (the one
 * most of whose members wait) instead of holding on or taking a third group of one. */
static void test_isolated_joins_pending(void) {
  rpl_gg *gg = make_smart(4, 3, 10);
  int ev = 0, m[4];
  uint64_t pair = 0, mine = 0;
  double t = 0;
  rpl_gg_worker_info wi;
  rpl_gg_stats st;
  OK(rpl_gg_fence(gg, 0, &e_)); /* out of play for good: fenced longer than a wait */
  OK(rpl_gg_fence(gg, 3, &e_));
  OK(rpl_gg_request(gg, 1, 0, &e_));
  OK(rpl_gg_request(gg, 2, 0, &e_));
  t += 0.02;
  OK(rpl_gg_advance(gg, t, &e_));
  REQUIRE(group_of(gg, 1, NULL, 0, &pair, &ev) == 2, "1 and 2 run a pair");
  OK(rpl_gg_unfence(gg, 3, &e_));
  for (uint64_t r = 0; r < 2; r++) { /* 1 and 2 stay in their round: 3 gets groups of one */
    OK(rpl_gg_request(gg, 3, r, &e_));
    t += 0.02;
    OK(rpl_gg_advance(gg, t, &e_));
    REQUIRE(group_of(gg, 3, NULL, 0, &mine, &ev) == 1, "3 alone in round %d", (int)r);
    if (r == 0) OK(rpl_gg_done(gg, 3, mine, &e_));
  }
  /* 3 is isolated, still in its second round; 1 and 2 finish, 1 asks: a pair is pending. */
  OK(rpl_gg_done(gg, 1, pair, &e_));
  OK(rpl_gg_done(gg, 2, pair, &e_));
  OK(rpl_gg_request(gg, 1, 1, &e_));
  t += 0.02;
  OK(rpl_gg_advance(gg, t, &e_));
  OK(rpl_gg_worker(gg, 2, &wi, &e_));
  REQUIRE(wi.buffered == 1, "2 holds the pending pair");
  OK(rpl_gg_done(gg, 3, mine, &e_));
  OK(rpl_gg_request(gg, 3, 2, &e_));
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.joins == 1, "isolated 3 joined the pending pair (joins %llu)",
          (unsigned long long)st.joins);
  OK(rpl_gg_request(gg, 2, 1, &e_));
  REQUIRE(group_of(gg, 3, m, 4, NULL, &ev) == 3 && m[0] == 1 && m[1] == 2 && m[2] == 3,
          "1, 2 and 3 handed one group");
  OK(rpl_gg_worker(gg, 3, &wi, &e_));
  REQUIRE(wi.lonely == 0 && wi.singletons == 2, "3 grouped after two groups of one");
  rpl_gg_destroy(gg);
}

/* A worker that keeps finding its partners busy gets at most max_isolated groups of one in a
 * row; then it holds on, past the slowdown filter, until the next division takes it in. */
static void test_isolation_bound(void) {
  rpl_gg *gg = make_smart(4, 3, 10);
  int ev = 0;
  uint64_t gid = 0, mine = 0;
  double t = 0;
  /* Fast workers 0-2 get far ahead of 3 (fenced meanwhile), so the filter keeps 3 out of
   * their divisions; then they are in a group whenever the slow worker 3 asks. */
  OK(rpl_gg_fence(gg, 3, &e_));
  for (uint64_t r = 0; r < 4; r++) {
    for (int w = 0; w < 3; w++) OK(rpl_gg_request(gg, w, r, &e_));
    REQUIRE(group_of(gg, 0, NULL, 0, &gid, &ev) == 3, "fast group");
    for (int w = 0; w < 3; w++) OK(rpl_gg_done(gg, w, gid, &e_));
  }
  OK(rpl_gg_unfence(gg, 3, &e_));
  for (uint64_t r = 0; r < 3; r++) {
    for (int w = 0; w < 3; w++) OK(rpl_gg_request(gg, w, r + 4, &e_));
    REQUIRE(group_of(gg, 0, NULL, 0, &gid, &ev) == 3, "fast group (round %d)", (int)r);
    OK(rpl_gg_request(gg, 3, r, &e_));
    t += 0.02; /* past the wait */
    OK(rpl_gg_advance(gg, t, &e_));
    int s3 = group_of(gg, 3, NULL, 0, &mine, &ev);
    rpl_gg_worker_info wi;
    OK(rpl_gg_worker(gg, 3, &wi, &e_));
    if (r < 2) {
      REQUIRE(s3 == 1 && wi.lonely == r + 1, "round %d: a group of one for 3 (lonely %u)", (int)r,
              wi.lonely);
      OK(rpl_gg_done(gg, 3, mine, &e_));
    } else {
      REQUIRE(s3 == 0 && wi.deferred && wi.lonely == 2, "isolated 3 holds on instead");
    }
    for (int w = 0; w < 3; w++) OK(rpl_gg_done(gg, w, gid, &e_));
  }
  /* Fast worker 0 asks: its division takes the waiting 3 in. */
  OK(rpl_gg_request(gg, 0, 7, &e_));
  OK(rpl_gg_request(gg, 1, 7, &e_));
  OK(rpl_gg_request(gg, 2, 7, &e_));
  int m[8];
  int s3 = group_of(gg, 3, m, 8, NULL, &ev);
  REQUIRE(s3 >= 2, "the isolated worker is in a group of %d", s3);
  rpl_gg_worker_info wi;
  OK(rpl_gg_worker(gg, 3, &wi, &e_));
  REQUIRE(wi.lonely == 0 && wi.lonely_max == 2 && wi.singletons == 2, "isolation counters");
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.isolation_holds == 1, "one hold");
  rpl_gg_destroy(gg);

  /* Nobody comes (1 and 2 stay in a long round): the hold is bounded, the worker gets its
   * no-op round. */
  gg = make_smart(3, 2, 10);
  ev = 0;
  t = 0;
  OK(rpl_gg_fence(gg, 0, &e_));
  OK(rpl_gg_request(gg, 1, 0, &e_));
  OK(rpl_gg_request(gg, 2, 0, &e_));
  REQUIRE(group_of(gg, 1, NULL, 0, NULL, &ev) == 2, "1 and 2 run a group");
  OK(rpl_gg_unfence(gg, 0, &e_));
  for (uint64_t r = 0; r < 2; r++) {
    OK(rpl_gg_request(gg, 0, r, &e_));
    t += 0.02;
    OK(rpl_gg_advance(gg, t, &e_));
    REQUIRE(group_of(gg, 0, NULL, 0, &mine, &ev) == 1, "group of one while 1, 2 are busy");
    OK(rpl_gg_done(gg, 0, mine, &e_));
  }
  OK(rpl_gg_request(gg, 0, 2, &e_));
  t += 0.02;
  OK(rpl_gg_advance(gg, t, &e_));
  REQUIRE(group_of(gg, 0, NULL, 0, NULL, &ev) == 0, "isolated: holds on");
  t += 1.0;
  OK(rpl_gg_advance(gg, t, &e_));
  REQUIRE(group_of(gg, 0, NULL, 0, NULL, &ev) == 1, "the hold ends in a group of one");
  OK(rpl_gg_leave(gg, 2, &e_));
  /* A worker fenced longer than a wait is in a long exact collective (perhaps waiting for
   * this very worker): nothing to wait for. */
  OK(rpl_gg_fence(gg, 1, &e_));
  t += 1.0;
  OK(rpl_gg_advance(gg, t, &e_));
  OK(rpl_gg_request(gg, 0, 3, &e_));
  REQUIRE(group_of(gg, 0, NULL, 0, NULL, &ev) == 1, "long-fenced partner: at once");
  OK(rpl_gg_leave(gg, 1, &e_));
  /* With every other worker gone there is nothing to wait for. */
  OK(rpl_gg_request(gg, 0, 4, &e_));
  REQUIRE(group_of(gg, 0, NULL, 0, NULL, &ev) == 1, "alone in the job: at once");
  rpl_gg_destroy(gg);
}

/* Four workers driven by 1 ms ticks (sim_tick), each asking again `step` after its answer;
 * a handed group ends at once. Workers below `nstopped` ask only before `stop_at`. */
typedef struct tick_sim {
  double step[4], next_ask[4], asked[4];
  uint64_t round[4];
  int waiting[4];
  int nstopped;
  double stop_at;
  int fence_each_step; /* an exact collective after every round (FSDP's shard group's, say) */
} tick_sim;

/* Advances the clock to t and has every worker that is due ask for its next round. */
static void sim_tick(rpl_gg *gg, tick_sim *s, double t) {
  OK(rpl_gg_advance(gg, t, &e_));
  for (int w = 0; w < 4; w++) {
    if (!s->waiting[w] && t >= s->next_ask[w] - 1e-9 && (w >= s->nstopped || t < s->stop_at)) {
      s->waiting[w] = 1;
      s->asked[w] = t;
      OK(rpl_gg_request(gg, w, s->round[w], &e_));
    }
  }
}

/* ev answered a worker's request at t (a group, ended at once, or a pass): its next step. */
static void sim_answered(rpl_gg *gg, tick_sim *s, const rpl_gg_event *ev, double t) {
  int w = ev->worker;
  s->waiting[w] = 0;
  s->round[w]++;
  s->next_ask[w] = t + s->step[w];
  if (ev->kind == RPL_EV_GROUP) OK(rpl_gg_done(gg, w, ev->group_id, &e_));
  if (s->fence_each_step) {
    OK(rpl_gg_fence(gg, w, &e_));
    OK(rpl_gg_unfence(gg, w, &e_));
  }
}

/* The arrival filter: a division by a fast worker leaves out a slow worker that is computing
 * and not due for a while; once the slow worker asks it waits, and the next division takes it
 * in -- nobody waits for it, and it is not left alone. */
static void test_arrival_filter(void) {
  rpl_gg *gg = make_smart(4, 3, 10);
  /* 0-2 compute 10 ms, 3 computes 50 ms. */
  tick_sim s = {.step = {0.01, 0.01, 0.01, 0.05}};
  uint64_t slow_groups = 0;
  double worst_fast_wait = 0;
  for (int tick = 0; tick <= 600; tick++) {
    double t = tick * 0.001;
    sim_tick(gg, &s, t);
    rpl_gg_event ev;
    int mm[8];
    while (rpl_gg_poll(gg, &ev, mm, 8)) {
      REQUIRE(ev.kind == RPL_EV_GROUP, "no cancels here");
      int w = ev.worker;
      REQUIRE(ev.nmembers >= 2, "worker %d got a group of one at %.3f s", w, t);
      if (w < 3 && t > 0.2 && t - s.asked[w] > worst_fast_wait) worst_fast_wait = t - s.asked[w];
      if (w == 3) slow_groups++;
      sim_answered(gg, &s, &ev, t);
    }
  }
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE(st.late > 0, "the slow worker was left out of divisions while computing");
  REQUIRE(worst_fast_wait < 0.0125, "a fast worker waited %.3f s for a group", worst_fast_wait);
  REQUIRE(slow_groups >= 10 && s.round[0] >= 4 * s.round[3], "rounds: fast %llu, slow %llu",
          (unsigned long long)s.round[0], (unsigned long long)s.round[3]);
  rpl_gg_destroy(gg);
}

/* The slowdown filter leaves out a worker far behind only if it is also slow: one that fell
 * behind by chance (a pause) but steps as fast as the bulk stays in the fast workers' divisions
 * -- left out, it would wait for partners every round and never catch up (the ratchet). */
static void filter_behind_case(double slow_step, int expect_in) {
  rpl_gg *gg = make_smart(4, 3, 10);
  int ev = 0;
  uint64_t gid = 0;
  double t = 0;
  /* Rounds 0 and 1: everyone together; worker 3 steps slow_step, the others 10 ms. A slow
   * worker 3 is dropped from round 1's group once it is late past the group's deadline
   * (speed-aware), and the others go on without it. */
  for (uint64_t r = 0; r < 2; r++) {
    for (int w = 0; w < 4; w++) {
      OK(rpl_gg_advance(gg, r == 0 ? 0 : w == 3 ? slow_step : 0.01, &e_));
      OK(rpl_gg_request(gg, w, r, &e_));
    }
    rpl_gg_event e;
    int mm[8], size0 = 0;
    while (rpl_gg_poll(gg, &e, mm, 8)) {
      REQUIRE(e.kind == RPL_EV_GROUP, "round %d: no cancels", (int)r);
      if (e.worker == 0) size0 = e.nmembers;
      OK(rpl_gg_done(gg, e.worker, e.group_id, &e_));
    }
    int want = r == 1 && slow_step > 0.02 ? 3 : 4;
    REQUIRE(size0 == want, "round %d: %d members with worker 0, want %d", (int)r, size0, want);
  }
  t = slow_step + 0.001;
  OK(rpl_gg_advance(gg, t, &e_));
  OK(rpl_gg_fence(gg, 3, &e_)); /* a pause: 0-2 run 5 rounds without it */
  for (uint64_t r = 2; r < 7; r++) {
    t += 0.01;
    OK(rpl_gg_advance(gg, t, &e_));
    for (int w = 0; w < 3; w++) OK(rpl_gg_request(gg, w, r, &e_));
    REQUIRE(group_of(gg, 0, NULL, 0, &gid, &ev) == 3, "round %d: 0-2", (int)r);
    for (int w = 0; w < 3; w++) OK(rpl_gg_done(gg, w, gid, &e_));
  }
  OK(rpl_gg_unfence(gg, 3, &e_)); /* back, idle and due, 5 rounds behind everyone */
  t += 0.01;
  OK(rpl_gg_advance(gg, t, &e_));
  OK(rpl_gg_request(gg, 0, 7, &e_));
  rpl_gg_worker_info wi;
  OK(rpl_gg_worker(gg, 3, &wi, &e_));
  rpl_gg_stats st;
  rpl_gg_get_stats(gg, &st);
  REQUIRE((wi.buffered == 1) == expect_in && (st.filtered == 0) == expect_in,
          "worker 3 (step %.0f ms, 5 rounds behind) in 0's division: %d, filtered %llu",
          slow_step * 1000, wi.buffered, (unsigned long long)st.filtered);
  rpl_gg_destroy(gg);
}

/* Four workers, groups of three, 1 ms ticks for 3 s: compute 4 ms (x slow for worker 3) + up
 * to 2, reduce 3 ms + up to 6 -- members say done apart, as on a busy machine, so groups of
 * three form and the counts drift apart by chance. rounds[] counts from 0.3 s on. */
static void paced_run(int slow, uint64_t seed, uint64_t rounds[4], uint64_t ones[4]) {
  rpl_gg *gg = make_gg(
      (rpl_gg_config){.policy = RPL_POLICY_SMART, .nworkers = 4, .group_size = 3, .seed = seed});
  rng_state = seed;
  int period[4] = {4, 4, 4, 4 * slow}, next_ask[4] = {0, 1, 2, 3}, done_at[4] = {-1, -1, -1, -1};
  int waiting[4] = {0};
  uint64_t round[4] = {0}, gid[4] = {0}, start[4] = {0};
  memset(ones, 0, sizeof(uint64_t) * 4);
  for (int tick = 0; tick <= 3000; tick++) {
    OK(rpl_gg_advance(gg, tick * 0.001, &e_));
    if (tick == 300) memcpy(start, round, sizeof round);
    for (int k = 0; k < 4; k++) {
      int w = (k + tick) % 4; /* no worker always last within a tick */
      if (done_at[w] == tick) {
        OK(rpl_gg_done(gg, w, gid[w], &e_));
        done_at[w] = -1;
        next_ask[w] = tick + period[w] + (int)rnd(3);
      }
      if (!waiting[w] && done_at[w] < 0 && tick >= next_ask[w]) {
        waiting[w] = 1;
        OK(rpl_gg_request(gg, w, round[w], &e_));
      }
    }
    rpl_gg_event ev;
    int mm[8];
    while (rpl_gg_poll(gg, &ev, mm, 8)) {
      int w = ev.worker;
      REQUIRE(ev.kind == RPL_EV_GROUP, "no cancels here");
      waiting[w] = 0;
      gid[w] = ev.group_id;
      round[w]++;
      ones[w] += tick >= 300 && ev.nmembers == 1;
      done_at[w] = tick + 1 + (ev.nmembers > 1 ? 2 + (int)rnd(7) : 0);
    }
  }
  for (int w = 0; w < 4; w++) rounds[w] = round[w] - start[w];
  rpl_gg_destroy(gg);
}

/* Equal speeds: no worker falls behind for good. With the slowdown filter on counts alone one
 * worker in every seed ran at 0.6-0.8 of the others' rate: once c_thres behind by chance it was
 * left out of their divisions and waited for partners every round. */
static void test_equal_speeds_no_laggard(void) {
  for (uint64_t seed = 1; seed <= 10; seed++) {
    uint64_t r[4], ones[4], lo = UINT64_MAX, hi = 0, single = 0, all = 0;
    paced_run(1, seed, r, ones);
    for (int w = 0; w < 4; w++) {
      lo = r[w] < lo ? r[w] : lo;
      hi = r[w] > hi ? r[w] : hi;
      single += ones[w];
      all += r[w];
    }
    REQUIRE(lo >= hi * 85 / 100, "seed %d: rounds %llu %llu %llu %llu", (int)seed,
            (unsigned long long)r[0], (unsigned long long)r[1], (unsigned long long)r[2],
            (unsigned long long)r[3]);
    REQUIRE(single * 50 <= all, "seed %d: %llu groups of one in %llu rounds", (int)seed,
            (unsigned long long)single, (unsigned long long)all);
  }
}

/* A straggler (10x the compute, about 4x the step) still stays out of the fast workers' way:
 * they run 3x more rounds, and it is grouped in at least 70 % of its rounds. */
static void test_straggler_still_filtered(void) {
  for (uint64_t seed = 1; seed <= 5; seed++) {
    uint64_t r[4], ones[4];
    paced_run(10, seed, r, ones);
    for (int w = 0; w < 3; w++)
      REQUIRE(r[w] >= 3 * r[3], "seed %d: fast worker %d made %llu rounds, the slow one %llu",
              (int)seed, w, (unsigned long long)r[w], (unsigned long long)r[3]);
    REQUIRE(ones[3] * 10 <= r[3] * 3, "seed %d: the slow worker alone in %llu of %llu rounds",
            (int)seed, (unsigned long long)ones[3], (unsigned long long)r[3]);
  }
}

/* Workers that fenced after the requester's last unfence are inside a collective it has not
 * entered -- one that may wait for it (a metric, a final average): it must not wait for them
 * (it used to, for a whole partner wait, and the adaptive wait grew on that time). Workers that
 * fenced before it unfenced are leaving its own collective: it waits for them. */
static void test_fenced_after_me_not_coming(void) {
  for (int pol = RPL_POLICY_RANDOM; pol <= RPL_POLICY_SMART; pol++) {
    rpl_gg *gg = make_gg((rpl_gg_config){.policy = (rpl_policy)pol, .nworkers = 3, .group_size = 3,
                                         .partner_wait_ms = 50, .seed = 2});
    const char *name = rpl_policy_name((rpl_policy)pol);
    int ev = 0, m[3];
    for (int w = 0; w < 3; w++) OK(rpl_gg_fence(gg, w, &e_));
    OK(rpl_gg_advance(gg, 0.001, &e_));
    for (int w = 0; w < 3; w++) OK(rpl_gg_unfence(gg, w, &e_));
    OK(rpl_gg_advance(gg, 0.002, &e_));
    OK(rpl_gg_fence(gg, 0, &e_)); /* the next collective, which waits for 2 */
    OK(rpl_gg_fence(gg, 1, &e_));
    OK(rpl_gg_advance(gg, 0.003, &e_));
    OK(rpl_gg_request(gg, 2, 0, &e_));
    uint64_t gid = 0;
    REQUIRE(group_of(gg, 2, m, 3, &gid, &ev) == 1, "%s: 2 waited for workers that wait for it",
            name);
    OK(rpl_gg_done(gg, 2, gid, &e_));
    OK(rpl_gg_fence(gg, 2, &e_)); /* 2 joins; the collective ends, 0 and 2 leave it first */
    OK(rpl_gg_advance(gg, 0.010, &e_));
    OK(rpl_gg_unfence(gg, 0, &e_));
    OK(rpl_gg_unfence(gg, 2, &e_));
    OK(rpl_gg_advance(gg, 0.011, &e_));
    OK(rpl_gg_request(gg, 2, 1, &e_));
    REQUIRE(group_of(gg, 2, NULL, 0, NULL, &ev) == 0, "%s: 2 waits for 1, leaving with it", name);
    OK(rpl_gg_advance(gg, 0.012, &e_));
    OK(rpl_gg_unfence(gg, 1, &e_));
    OK(rpl_gg_request(gg, 0, 0, &e_));
    OK(rpl_gg_request(gg, 1, 0, &e_));
    REQUIRE(group_of(gg, 2, m, 3, NULL, &ev) == 3, "%s: then all three", name);
    rpl_gg_destroy(gg);
  }
}

/* Workers that stop asking (their steps done, a long evaluation) are not waited for: the one
 * still training is answered at once with a group of one, round after round -- not held for
 * partners that never come, nor put, isolated and widened, in a group with them that is never
 * handed (the real client's rounds then each waited out their deadline). */
/* Workers below `nstopped` ask only before `stop_at` (never, if 0); the others train on, at
 * 10 ms steps (1 ms ticks), for 1 s past `settled`, when nothing is left to wait for: each of
 * them must go on running rounds then, none waiting long for a partner. */
static void stopped_case(int nstopped, double stop_at, double settled, int fence_each_step) {
  rpl_gg *gg = make_smart(4, 3, 10);
  tick_sim s = {.step = {0.01, 0.01, 0.01, 0.01}, .nstopped = nstopped, .stop_at = stop_at,
                .fence_each_step = fence_each_step};
  double worst_wait = 0;
  uint64_t late_rounds[4] = {0};
  for (int tick = 0; tick <= (int)((settled + 1.0) * 1000); tick++) {
    double t = tick * 0.001;
    sim_tick(gg, &s, t);
    rpl_gg_event ev;
    int mm[8];
    while (rpl_gg_poll(gg, &ev, mm, 8)) {
      int w = ev.worker;
      if (ev.kind == RPL_EV_CANCEL) { /* ask again */
        s.waiting[w] = 0;
        s.next_ask[w] = t;
        continue;
      }
      if (s.asked[w] > settled) {
        late_rounds[w]++;
        if (t - s.asked[w] > worst_wait) worst_wait = t - s.asked[w];
      }
      sim_answered(gg, &s, &ev, t);
    }
  }
  for (int w = nstopped; w < 4; w++)
    REQUIRE(late_rounds[w] >= 60, "%d stopped at %.2f s: worker %d ran %llu rounds after "
            "%.2f s", nstopped, stop_at, w, (unsigned long long)late_rounds[w], settled);
  /* alone, a worker's rounds are answered at once; with partners of its own pace, within a
   * tick or two */
  double bound = nstopped == 3 ? 0.002 : 0.005;
  REQUIRE(worst_wait < bound, "%d stopped at %.2f s: a round waited %.3f s", nstopped,
          stop_at, worst_wait);
  rpl_gg_destroy(gg);
}

static void test_stopped_workers_not_waited_for(void) {
  /* their steps done: after GG_OVERDUE steps, the last worker trains on alone */
  stopped_case(3, 0.2, 0.25, 0);
  /* never asked once (a long first step after warm-up), nothing measured yet since every
   * group holds it: after GG_OVERDUE longest partner waits */
  stopped_case(1, 0.0, 4 * RPL_GG_MAX_PARTNER_WAIT + 0.05, 0); /* GG_OVERDUE: 4 */
  /* an exact collective between every two rounds (FSDP's shard group's): no compute step is
   * ever measured, yet stopped workers are not waited for -- after GG_OVERDUE of their steps
   * from a group handed to the next request. They used to be waited for without end. */
  stopped_case(3, 0.2, 0.25, 1);
  stopped_case(2, 0.2, 0.25, 1);
}

int main(void) {
  test_errors();
  test_figure11();
  filter_case(2, 0);
  filter_case(-1, 1);
  filter_case(100, 1);
  filter_behind_case(0.01, 1);
  filter_behind_case(0.05, 0);
  test_waits_for_busy_partners();
  test_division_of_three_in_pairs();
  test_unfence_reentry();
  test_isolation_bound();
  test_isolated_joins_pending();
  test_arrival_filter();
  test_equal_speeds_no_laggard();
  test_straggler_still_filtered();
  test_fenced_after_me_not_coming();
  test_stopped_workers_not_waited_for();
  test_many_seeds();
  return report("test_sched_policies");
}
