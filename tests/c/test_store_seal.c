/* Records in the c10d store sealed with the job secret (csrc/bootstrap.c): with a secret every
 * record a communicator publishes (link salt, addresses, shared-memory names) carries a MAC,
 * and a store writer who changes one, moves one to another key, or replaces the salt makes
 * set-up fail naming the record, instead of steering a rank; ranks that disagree about having
 * a secret are told so. Two ranks as threads over a store of this file's own, whose gets give
 * up after 3 s (a rank that failed never publishes what its peer waits for). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "ripples.h"

#define SECRET "a-job-secret-of-some-length"

typedef struct rec {
  char key[96];
  char val[512];
  size_t len;
} rec;

typedef struct tstore {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  rec recs[64];
  int n;
  /* The store writer: called on every set, may rewrite the value (len in, len out). */
  void (*tamper)(struct tstore *, const char *key, char *val, size_t *len);
} tstore;

static rec *find(tstore *s, const char *key) {
  for (int i = 0; i < s->n; i++)
    if (strcmp(s->recs[i].key, key) == 0) return &s->recs[i];
  return NULL;
}

static rpl_status ts_set(void *ctx, const char *key, const void *val, size_t len,
                         rpl_error *err) {
  tstore *s = ctx;
  pthread_mutex_lock(&s->mu);
  rec *r = find(s, key);
  if (!r && s->n < 64) r = &s->recs[s->n++];
  if (r && len < sizeof r->val) {
    snprintf(r->key, sizeof r->key, "%s", key);
    memcpy(r->val, val, len);
    r->len = len;
    if (s->tamper) s->tamper(s, key, r->val, &r->len);
  }
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return RPL_OK;
}

static rpl_status ts_get(void *ctx, const char *key, void *buf, size_t cap, size_t *len,
                         rpl_error *err) {
  tstore *s = ctx;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 3;
  pthread_mutex_lock(&s->mu);
  rec *r;
  while (!(r = find(s, key)))
    if (pthread_cond_timedwait(&s->cv, &s->mu, &until) != 0) {
      pthread_mutex_unlock(&s->mu);
      err->code = RPL_ERR_TIMEOUT;
      snprintf(err->msg, sizeof err->msg, "store: no %s", key);
      return RPL_ERR_TIMEOUT;
    }
  memcpy(buf, r->val, r->len < cap ? r->len : cap);
  *len = r->len;
  pthread_mutex_unlock(&s->mu);
  return RPL_OK;
}

typedef struct rank_run {
  tstore *store;
  int rank;
  const char *secret;
  rpl_status st;
  rpl_error err;
} rank_run;

static void *rank_main(void *arg) {
  rank_run *r = arg;
  rpl_store st = {.ctx = r->store, .set = ts_set, .get = ts_get};
  rpl_comm_config cfg = {.rank = r->rank, .size = 2, .timeout_s = 5, .name = "seal",
                         .host_key = "one-host", .job_secret = r->secret};
  rpl_comm *c = NULL;
  r->st = rpl_comm_create(&cfg, &st, &c, &r->err);
  if (c) rpl_comm_destroy(c);
  return NULL;
}

/* Runs ranks 0 and 1 (with the secrets given) over a fresh store with `tamper`; the store is
 * left in *s for the caller to read. */
static void run_pair(tstore *s, void (*tamper)(tstore *, const char *, char *, size_t *),
                     const char *secret0, const char *secret1, rank_run out[2]) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->tamper = tamper;
  pthread_t th[2];
  for (int r = 0; r < 2; r++) {
    out[r] = (rank_run){.store = s, .rank = r, .secret = r ? secret1 : secret0};
    pthread_create(&th[r], NULL, rank_main, &out[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
}

static int sealed(const rec *r) {
  if (r->len < 33 || r->val[r->len - 33] != '|') return 0;
  for (size_t i = r->len - 32; i < r->len; i++)
    if (!strchr("0123456789abcdef", r->val[i])) return 0;
  return 1;
}

/* Store writers. */
static void change_addr1(tstore *s, const char *key, char *val, size_t *len) {
  if (strcmp(key, "ripples/addr/1") == 0) val[0] = val[0] == '1' ? '2' : '1';
}
static void move_addr0_to_addr1(tstore *s, const char *key, char *val, size_t *len) {
  rec *a0;
  if (strcmp(key, "ripples/addr/1") != 0) return;
  /* rank 0 may not have published yet: then the test only checks a change */
  if ((a0 = find(s, "ripples/addr/0")) != NULL) {
    memcpy(val, a0->val, a0->len);
    *len = a0->len;
  } else {
    val[0] ^= 1;
  }
}
static void strip_seal_shm0(tstore *s, const char *key, char *val, size_t *len) {
  if (strcmp(key, "ripples/shm/0") == 0 && *len > 33) *len -= 33; /* the plain name */
}
static void other_salt(tstore *s, const char *key, char *val, size_t *len) {
  if (strcmp(key, "ripples/link-salt") == 0) val[5] = val[5] == 'a' ? 'b' : 'a';
}

int main(void) {
  tstore s;
  rank_run r[2];

  /* Both ranks hold the secret: set-up works, and every record carries its seal. */
  run_pair(&s, NULL, SECRET, SECRET, r);
  for (int k = 0; k < 2; k++) CHECK(r[k].st == RPL_OK, "rank %d: %s", k, r[k].err.msg);
  static const char *const keys[] = {"ripples/link-salt", "ripples/addr/0", "ripples/addr/1",
                                     "ripples/shm/0", "ripples/shm/1"};
  for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
    rec *e = find(&s, keys[k]);
    CHECK(e && sealed(e), "%s sealed: %.*s", keys[k], e ? (int)e->len : 0, e ? e->val : "");
  }

  /* No secret: records stay plain (anyone reading the store could compute a key anyway). */
  run_pair(&s, NULL, NULL, NULL, r);
  for (int k = 0; k < 2; k++) CHECK(r[k].st == RPL_OK, "plain rank %d: %s", k, r[k].err.msg);
  CHECK(find(&s, "ripples/addr/0") && !sealed(find(&s, "ripples/addr/0")), "plain record");

  /* A store writer changes rank 1's address: rank 0 refuses it, naming the record. */
  run_pair(&s, change_addr1, SECRET, SECRET, r);
  CHECK(r[0].st == RPL_ERR_INVALID && strstr(r[0].err.msg, "ripples/addr/1") &&
            strstr(r[0].err.msg, "fails its MAC"), "changed address: %s", r[0].err.msg);

  /* ... moves rank 0's (validly sealed) address to rank 1's key: refused just the same. */
  run_pair(&s, move_addr0_to_addr1, SECRET, SECRET, r);
  CHECK(r[0].st == RPL_ERR_INVALID && strstr(r[0].err.msg, "ripples/addr/1"),
        "moved address: %s", r[0].err.msg);

  /* ... strips the seal of a shared-memory name: "carries no MAC". */
  run_pair(&s, strip_seal_shm0, SECRET, SECRET, r);
  CHECK(r[1].st == RPL_ERR_INVALID && strstr(r[1].err.msg, "ripples/shm/0") &&
            strstr(r[1].err.msg, "carries no MAC"), "unsealed shm name: %s", r[1].err.msg);

  /* ... replaces the link salt: rank 1 refuses it before keying any link with it. */
  run_pair(&s, other_salt, SECRET, SECRET, r);
  CHECK(r[1].st == RPL_ERR_INVALID && strstr(r[1].err.msg, "ripples/link-salt"),
        "replaced salt: %s", r[1].err.msg);

  /* Ranks that disagree about the secret are told what to fix. */
  run_pair(&s, NULL, SECRET, NULL, r);
  CHECK(r[1].st == RPL_ERR_INVALID && strstr(r[1].err.msg, "this rank has none") &&
            strstr(r[1].err.msg, "RIPPLES_JOB_SECRET"), "secret on rank 0 only: %s",
        r[1].err.msg);
  run_pair(&s, NULL, NULL, SECRET, r);
  CHECK(r[1].st == RPL_ERR_INVALID && strstr(r[1].err.msg, "carries no MAC"),
        "secret on rank 1 only: %s", r[1].err.msg);
  run_pair(&s, NULL, SECRET, "another-secret-of-some-length", r);
  CHECK(r[1].st == RPL_ERR_INVALID && strstr(r[1].err.msg, "fails its MAC"),
        "different secrets: %s", r[1].err.msg);
  return report("test_store_seal");
}
