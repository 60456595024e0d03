/* harness.c - see harness.h. */
#include "harness.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

world_layout g_layout;
int g_inline_runs;

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void sleep_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

rpl_xfer xfer(int peer, int is_send, void *buf, size_t len, uint64_t seq) {
  rpl_xfer x;
  memset(&x, 0, sizeof x);
  x.peer = peer;
  x.is_send = is_send;
  x.buf = buf;
  x.len = len;
  x.meta.op = RPL_OP_BROADCAST;
  x.meta.dtype = RPL_UINT8;
  x.meta.tag = 1;
  x.meta.seq = seq;
  x.meta.count = len;
  return x;
}

typedef struct kv {
  struct kv *next;
  char key[128];
  char *val;
  size_t len;
} kv;

struct mem_store {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  kv *head;
};

static rpl_status ms_set(void *ctx, const char *key, const void *val, size_t len,
                         rpl_error *err) {
  mem_store *s = ctx;
  kv *e = calloc(1, sizeof *e);
  snprintf(e->key, sizeof e->key, "%s", key);
  e->val = malloc(len + 1);
  memcpy(e->val, val, len);
  e->len = len;
  pthread_mutex_lock(&s->mu);
  e->next = s->head;
  s->head = e;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return RPL_OK;
}

static rpl_status ms_get(void *ctx, const char *key, void *buf, size_t cap, size_t *len,
                         rpl_error *err) {
  mem_store *s = ctx;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    for (kv *e = s->head; e; e = e->next)
      if (strcmp(e->key, key) == 0) {
        memcpy(buf, e->val, e->len < cap ? e->len : cap);
        *len = e->len;
        pthread_mutex_unlock(&s->mu);
        return RPL_OK;
      }
    pthread_cond_wait(&s->cv, &s->mu);
  }
}

static int g_order; /* completions so far, in all ranks: gives each its req.order */

static void req_done(void *arg, rpl_status st, const rpl_error *err) {
  req *r = arg;
  pthread_mutex_lock(&r->mu);
  r->done = 1;
  r->st = st;
  r->order = __atomic_add_fetch(&g_order, 1, __ATOMIC_SEQ_CST);
  if (err) r->err = *err;
  pthread_cond_broadcast(&r->cv);
  pthread_mutex_unlock(&r->mu);
}

rpl_status submit(rpl_comm *c, rpl_op_desc d, req *r) {
  memset(r, 0, sizeof *r);
  pthread_mutex_init(&r->mu, NULL);
  pthread_cond_init(&r->cv, NULL);
  d.on_done = req_done;
  d.done_arg = r;
  rpl_status st = rpl_submit(c, &d, &r->err);
  r->submitted = st == RPL_OK;
  if (st != RPL_OK) {
    r->done = 1;
    r->st = st;
  }
  return st;
}

int wait_for(req *r, double max_s) {
  double end = now_s() + max_s;
  pthread_mutex_lock(&r->mu);
  while (!r->done) {
    double left = end - now_s();
    if (left <= 0) break;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double t = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + (left < 0.05 ? left : 0.05);
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    pthread_cond_timedwait(&r->cv, &r->mu, &ts);
  }
  int done = r->done;
  pthread_mutex_unlock(&r->mu);
  return done ? 0 : -1;
}

int is_done(req *r) {
  pthread_mutex_lock(&r->mu);
  int d = r->done;
  pthread_mutex_unlock(&r->mu);
  return d;
}

void req_free(req *r) {
  wait_for(r, 60);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
}

rpl_status run_op(rpl_comm *c, rpl_op_desc d, rpl_error *err) {
  req r = {.done = 0};
  pthread_mutex_init(&r.mu, NULL);
  pthread_cond_init(&r.cv, NULL);
  d.on_done = req_done;
  d.done_arg = &r;
  int ran = 0;
  rpl_status st = g_layout.inline_ops ? rpl_submit_inline(c, &d, &ran, err)
                                      : rpl_submit(c, &d, err);
  if (st == RPL_OK && ran) __atomic_fetch_add(&g_inline_runs, 1, __ATOMIC_RELAXED);
  if (st != RPL_OK) return st;
  pthread_mutex_lock(&r.mu);
  while (!r.done) pthread_cond_wait(&r.cv, &r.mu);
  pthread_mutex_unlock(&r.mu);
  if (err) *err = r.err;
  req_free(&r);
  return r.st;
}

static void *rank_main(void *arg) {
  job *j = arg;
  rpl_store st = {.ctx = j->store, .set = ms_set, .get = ms_get};
  char host[32];
  snprintf(host, sizeof host, "host%d", g_layout.hosts > 0 ? j->rank % g_layout.hosts : 0);
  rpl_comm_config cfg = {.rank = j->rank, .size = j->size, .timeout_s = j->timeout,
                         .name = "test", .small_bytes = 256, .chunk_bytes = 1000,
                         .host_key = host, .tcp_only = g_layout.tcp_only, .use_ucx = g_layout.ucx,
                         .ring_bytes = 64 * 1024 /* small: wrap-around happens often */,
                         .single_copy_bytes = g_layout.single_copy ? 1024 : 0,
                         .frame_macs = g_layout.frame_macs};
  rpl_error err;
  rpl_status s = rpl_comm_create(&cfg, &st, &j->comm, &err);
  CHECK(s == RPL_OK, "rank %d create: %s", j->rank, err.msg);
  if (s == RPL_OK) {
    j->body(j, j->comm);
    rpl_comm_destroy(j->comm);
  }
  return NULL;
}

void run_world(int size, double timeout, void (*body)(job *, rpl_comm *), void *arg) {
  mem_store store = {.head = NULL};
  pthread_mutex_init(&store.mu, NULL);
  pthread_cond_init(&store.cv, NULL);
  pthread_t *th = calloc((size_t)size, sizeof *th);
  job *jobs = calloc((size_t)size, sizeof *jobs);
  for (int r = 0; r < size; r++) {
    jobs[r] = (job){.rank = r, .size = size, .store = &store, .timeout = timeout, .body = body,
                    .arg = arg};
    pthread_create(&th[r], NULL, rank_main, &jobs[r]);
  }
  for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
  for (kv *e = store.head; e;) {
    kv *n = e->next;
    free(e->val);
    free(e);
    e = n;
  }
  free(th);
  free(jobs);
}

void run_on_each_transport(void (*suite)(void)) {
  static const world_layout layouts[] = {{.hosts = 1}, {.hosts = 1, .tcp_only = 1}, {.hosts = 2}};
  for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
    g_layout = layouts[i];
    suite();
  }
}

static void count_closed(void *arg, rpl_status st, const rpl_error *err) {
  closed_count *w = arg;
  w->calls++;
  if (st == RPL_ERR_CLOSED)
    w->closed++;
  else
    w->other = st;
}

void submit_counting_closed(rpl_comm *c, rpl_op_desc *d, int n, closed_count *w,
                            const char *what) {
  for (int i = 0; i < n; i++) {
    rpl_error err;
    d[i].on_done = count_closed;
    d[i].done_arg = w;
    CHECK(rpl_submit(c, &d[i], &err) == RPL_OK, "%s: submit %d: %s", what, i + 1, err.msg);
  }
}

void check_all_closed(const closed_count *w, int n, const char *what) {
  CHECK(w->calls == n && w->closed == n, "%s: %d callbacks, %d closed (of %d; other: %s)", what,
        w->calls, w->closed, n, rpl_status_name(w->other));
}
