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

typedef struct waiter {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done;
  rpl_status st;
  rpl_error err;
} waiter;

static void on_done(void *arg, rpl_status st, const rpl_error *err) {
  waiter *w = arg;
  pthread_mutex_lock(&w->mu);
  w->done = 1;
  w->st = st;
  if (err) w->err = *err;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

rpl_status run_op(rpl_comm *c, rpl_op_desc d, rpl_error *err) {
  waiter w = {.done = 0};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  d.on_done = on_done;
  d.done_arg = &w;
  int ran = 0;
  rpl_status st = g_layout.inline_ops ? rpl_run_inline(c, &d, &ran, err) : RPL_OK;
  if (st == RPL_OK && ran) __atomic_fetch_add(&g_inline_runs, 1, __ATOMIC_RELAXED);
  if (st == RPL_OK && !ran) st = rpl_submit(c, &d, err);
  if (st != RPL_OK) return st;
  pthread_mutex_lock(&w.mu);
  while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
  pthread_mutex_unlock(&w.mu);
  if (err) *err = w.err;
  pthread_mutex_destroy(&w.mu);
  pthread_cond_destroy(&w.cv);
  return w.st;
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
                         .single_copy_bytes = g_layout.single_copy ? 1024 : 0};
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
