/* The coordinator over real loopback sockets: embedded service (its own thread) and real
 * clients (one thread each, as the backend will run them). Checks behaviour only: groups are
 * consistent among members, a silent worker is declared dead and its group cancelled, wrong
 * tokens and malformed messages are rejected and counted while service continues, an
 * unreachable or stopped coordinator gives a clear error. Every wait is bounded. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "rpl_coord.h"

#include "check.h"

static rpl_coord *start_coord(rpl_policy p, int n, int group_size, int hb_ms, int dead_ms) {
  rpl_coord_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.gg.policy = p;
  cfg.gg.nworkers = n;
  cfg.gg.group_size = group_size;
  cfg.gg.seed = 42;
  cfg.heartbeat_ms = hb_ms;
  cfg.dead_ms = dead_ms;
  cfg.join_ms = -1;
  rpl_coord *c;
  rpl_error err;
  CHECK(rpl_coord_create(&cfg, &c, &err) == RPL_OK, "%s", err.msg);
  CHECK(strncmp(rpl_coord_endpoint(c), "tcp://127.0.0.1:", 16) == 0, "endpoint %s",
        rpl_coord_endpoint(c));
  CHECK(rpl_coord_start(c, &err) == RPL_OK, "%s", err.msg);
  return c;
}

static rpl_gg_client *connect_client(rpl_coord *c, int rank, int n, int hb_ms) {
  rpl_gg_client_config cc;
  memset(&cc, 0, sizeof cc);
  cc.endpoint = rpl_coord_endpoint(c);
  cc.token_hex = rpl_coord_token(c);
  cc.rank = rank;
  cc.nworkers = n;
  cc.host_label = 0;
  cc.timeout_ms = 5000;
  cc.request_timeout_ms = 10000;
  cc.heartbeat_ms = hb_ms;
  rpl_gg_client *cl;
  rpl_error err;
  CHECK(rpl_gg_client_create(&cc, &cl, &err) == RPL_OK, "rank %d: %s", rank, err.msg);
  return cl;
}

/* ---- groups formed ------------------------------------------------------------------------ */

#define NW 4
#define ROUNDS 30
typedef struct {
  rpl_coord *c;
  int rank;
  uint64_t gid[ROUNDS];
  int n[ROUNDS];
  int m[ROUNDS][NW];
} worker_log;

static void *worker_main(void *arg) {
  worker_log *wl = arg;
  rpl_gg_client *cl = connect_client(wl->c, wl->rank, NW, 50);
  rpl_error err;
  for (int r = 0; r < ROUNDS; r++) {
    int n = 0;
    uint64_t gid = 0;
    CHECK(rpl_gg_client_request(cl, (uint64_t)r, wl->m[r], NW, &n, &gid, &err) == RPL_OK,
          "rank %d round %d: %s", wl->rank, r, err.msg);
    wl->n[r] = n;
    wl->gid[r] = gid;
    if (r % 7 == 3) { /* an exact collective between partial rounds: fence around it */
      CHECK(rpl_gg_client_done(cl, gid, 0, &err) == RPL_OK, "%s", err.msg);
      CHECK(rpl_gg_client_fence(cl, &err) == RPL_OK, "%s", err.msg);
      usleep(1000);
      CHECK(rpl_gg_client_unfence(cl, &err) == RPL_OK, "%s", err.msg);
    } else {
      CHECK(rpl_gg_client_done(cl, gid, 0, &err) == RPL_OK, "%s", err.msg);
    }
  }
  CHECK(rpl_gg_client_leave(cl, &err) == RPL_OK, "%s", err.msg);
  rpl_gg_client_destroy(cl);
  return NULL;
}

static void test_groups_formed(rpl_policy p) {
  rpl_coord *c = start_coord(p, NW, 0, 200, 5000);
  worker_log logs[NW];
  pthread_t th[NW];
  for (int i = 0; i < NW; i++) {
    memset(&logs[i], 0, sizeof logs[i]);
    logs[i].c = c;
    logs[i].rank = i;
    CHECK(pthread_create(&th[i], NULL, worker_main, &logs[i]) == 0, "thread");
  }
  for (int i = 0; i < NW; i++) pthread_join(th[i], NULL);
  /* Each worker's groups have increasing ids (generation order), contain it, and every member
   * of a group saw the same members under the same id. */
  int total = 0;
  for (int i = 0; i < NW; i++)
    for (int r = 0; r < ROUNDS; r++) {
      int self = 0;
      for (int k = 0; k < logs[i].n[r]; k++) self |= logs[i].m[r][k] == i;
      CHECK(self, "rank %d not in its group", i);
      if (r) CHECK(logs[i].gid[r] > logs[i].gid[r - 1], "rank %d ids not increasing", i);
      total += logs[i].n[r] > 1;
      for (int k = 0; k < logs[i].n[r]; k++) {
        int o = logs[i].m[r][k], found = 0;
        for (int s = 0; s < ROUNDS; s++)
          if (logs[o].gid[s] == logs[i].gid[r]) {
            found = 1;
            CHECK(logs[o].n[s] == logs[i].n[r] &&
                      memcmp(logs[o].m[s], logs[i].m[r], sizeof(int) * (size_t)logs[i].n[r]) == 0,
                  "members disagree on group %llu", (unsigned long long)logs[i].gid[r]);
          }
        CHECK(found, "rank %d never saw group %llu it belongs to", o,
              (unsigned long long)logs[i].gid[r]);
      }
    }
  CHECK(total > 0, "some rounds had partners");
  char *json = NULL;
  rpl_error err;
  CHECK(rpl_gg_query_status(rpl_coord_endpoint(c), rpl_coord_token(c), 5000, &json, &err) ==
            RPL_OK, "%s", err.msg);
  CHECK(strstr(json, "\"state\":\"left\"") && strstr(json, "\"pending\":[]"), "status: %s", json);
  free(json);
  rpl_coord_destroy(c);
  printf("  groups formed over loopback (%s): ok\n", rpl_policy_name(p));
}

/* ---- dead worker ------------------------------------------------------------------------- */

typedef struct {
  rpl_coord *c;
  int rank;
  int members[3];
  int n;
  rpl_status st;
} req_arg;

static void *request_once(void *arg) {
  req_arg *a = arg;
  rpl_gg_client *cl = connect_client(a->c, a->rank, 3, 50);
  rpl_error err;
  uint64_t gid;
  a->st = rpl_gg_client_request(cl, 0, a->members, 3, &a->n, &gid, &err);
  if (a->st != RPL_OK) fprintf(stderr, "rank %d: %s\n", a->rank, err.msg);
  rpl_gg_client_done(cl, gid, 0, &err);
  rpl_gg_client_leave(cl, &err);
  rpl_gg_client_destroy(cl);
  return NULL;
}

static void test_dead_worker(void) {
  /* smart, one group of 3: worker 2 says hello, then falls silent (no heartbeat thread). The
   * division puts it with 0 and 1; once it is declared dead they are told and regrouped. */
  rpl_coord *c = start_coord(RPL_POLICY_SMART, 3, 3, 50, 400);
  rpl_gg_client *silent = connect_client(c, 2, 3, -1);
  req_arg a[2];
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    memset(&a[i], 0, sizeof a[i]);
    a[i].c = c;
    a[i].rank = i;
    CHECK(pthread_create(&th[i], NULL, request_once, &a[i]) == 0, "thread");
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) {
    CHECK(a[i].st == RPL_OK, "rank %d request failed", i);
    for (int k = 0; k < a[i].n; k++) CHECK(a[i].members[k] != 2, "dead worker still grouped");
  }
  rpl_coord_counters k;
  rpl_coord_get_counters(c, &k);
  CHECK(k.dead_declared == 1, "dead_declared %llu", (unsigned long long)k.dead_declared);
  char *json = NULL;
  rpl_error err;
  CHECK(rpl_gg_query_status(rpl_coord_endpoint(c), rpl_coord_token(c), 5000, &json, &err) ==
            RPL_OK, "%s", err.msg);
  CHECK(strstr(json, "\"rank\":2,\"state\":\"dead\""), "status: %s", json);
  free(json);
  rpl_gg_client_destroy(silent);
  rpl_coord_destroy(c);
  printf("  dead worker detected and removed: ok\n");
}

/* ---- rejection and malformed input ------------------------------------------------------- */

static void test_rejections(void) {
  rpl_coord *c = start_coord(RPL_POLICY_RANDOM, 2, 2, 100, 5000);
  rpl_error err;
  rpl_gg_client_config cc;
  memset(&cc, 0, sizeof cc);
  cc.endpoint = rpl_coord_endpoint(c);
  cc.token_hex = "00112233445566778899aabbccddeeff";
  cc.rank = 0;
  cc.nworkers = 2;
  cc.timeout_ms = 3000;
  cc.heartbeat_ms = -1;
  rpl_gg_client *cl = NULL;
  CHECK(rpl_gg_client_create(&cc, &cl, &err) == RPL_ERR_INVALID && strstr(err.msg, "token"),
        "wrong token must be refused: %s", err.msg);
  cc.token_hex = rpl_coord_token(c);
  cc.nworkers = 3;
  CHECK(rpl_gg_client_create(&cc, &cl, &err) == RPL_ERR_INVALID && strstr(err.msg, "world size"),
        "world size mismatch: %s", err.msg);
  cc.token_hex = "not-a-token";
  CHECK(rpl_gg_client_create(&cc, &cl, &err) == RPL_ERR_INVALID, "bad token text");
  char *json;
  CHECK(rpl_gg_query_status(rpl_coord_endpoint(c), "00112233445566778899aabbccddeeff", 3000,
                            &json, &err) == RPL_ERR_INVALID, "status needs the token");

  /* Malformed input from a raw socket. */
  void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
  int linger = 0;
  zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
  CHECK(zmq_connect(s, rpl_coord_endpoint(c)) == 0, "connect");
  rpl_coord_counters before;
  rpl_coord_get_counters(c, &before);
  uint8_t good[64];
  rpl_msg m;
  memset(&m, 0, sizeof m);
  m.type = RPL_MSG_HEARTBEAT;
  m.rank = 1;
  uint8_t tok[RPL_TOKEN_LEN];
  CHECK(rpl_token_from_hex(rpl_coord_token(c), tok, &err) == RPL_OK, "token");
  memcpy(m.token, tok, RPL_TOKEN_LEN);
  size_t glen = rpl_msg_encode(&m, NULL, good, sizeof good);
  CHECK(glen == RPL_PROTO_HEADER, "encode heartbeat");
  int sent = 0;
  zmq_send(s, "x", 1, 0), sent++;                              /* short */
  uint8_t bad[64];
  memcpy(bad, good, glen); bad[0] ^= 1; zmq_send(s, bad, glen, 0), sent++;   /* magic */
  memcpy(bad, good, glen); bad[4] = 9; zmq_send(s, bad, glen, 0), sent++;    /* version */
  memcpy(bad, good, glen); bad[5] = 99; zmq_send(s, bad, glen, 0), sent++;   /* type */
  memcpy(bad, good, glen); bad[8] = 4; zmq_send(s, bad, glen, 0), sent++;    /* body length */
  memcpy(bad, good, glen); bad[12] = 7; zmq_send(s, bad, glen, 0), sent++;   /* rank >= n */
  memcpy(bad, good, glen); bad[5] = RPL_MSG_GROUP; zmq_send(s, bad, glen, 0), sent++; /* reply type */
  zmq_send(s, good, glen, ZMQ_SNDMORE); zmq_send(s, good, glen, 0), sent++; /* two frames */
  zmq_send(s, good, glen, 0); /* valid: answered */
  zmq_pollitem_t it = {s, 0, ZMQ_POLLIN, 0};
  CHECK(zmq_poll(&it, 1, 5000) == 1, "a valid heartbeat after garbage is still answered");
  uint8_t rb[256];
  int n = zmq_recv(s, rb, sizeof rb, 0);
  /* ... with NOT_REGISTERED: rank 1 said no HELLO to this instance (a restarted coordinator
   * tells the workers of its predecessor to register again). */
  CHECK(n > 0 && rpl_msg_parse(rb, (size_t)n, 2, &m, &err) == RPL_OK &&
            m.type == RPL_MSG_ERROR && m.code == RPL_PERR_NOT_REGISTERED,
        "unregistered heartbeat answered NOT_REGISTERED");
  rpl_coord_counters after;
  rpl_coord_get_counters(c, &after);
  CHECK(after.malformed - before.malformed == (uint64_t)sent, "malformed counted %llu of %d",
        (unsigned long long)(after.malformed - before.malformed), sent);
  /* An oversized message makes zmq drop the connection; the service keeps serving. */
  size_t big = 1 << 20;
  uint8_t *huge = calloc(1, big);
  zmq_send(s, huge, big, 0);
  free(huge);
  zmq_close(s);
  zmq_ctx_term(ctx);
  /* Still serving real clients. */
  rpl_gg_client *c0 = connect_client(c, 0, 2, 100);
  int mem[2], cnt;
  uint64_t gid;
  CHECK(rpl_gg_client_leave(c0, &err) == RPL_OK, "%s", err.msg);
  CHECK(rpl_gg_client_request(c0, 0, mem, 2, &cnt, &gid, &err) == RPL_ERR_CLOSED &&
            strstr(err.msg, "left"), "request after leave: %s", err.msg);
  rpl_gg_client_destroy(c0);
  rpl_coord_get_counters(c, &after);
  CHECK(after.bad_token >= 2, "bad tokens counted");
  rpl_coord_destroy(c);
  printf("  wrong token, world size, malformed input rejected and counted: ok\n");
}

typedef struct {
  rpl_coord *c;
  int rank;
  uint64_t round;
  int members[2];
  int n;
  rpl_status st;
} req2_arg;

static void *request_round(void *arg) {
  req2_arg *a = arg;
  rpl_gg_client *cl = connect_client(a->c, a->rank, 2, 50);
  rpl_error err;
  uint64_t gid;
  a->st = rpl_gg_client_request(cl, a->round, a->members, 2, &a->n, &gid, &err);
  rpl_gg_client_destroy(cl);
  return NULL;
}

/* ---- unreachable or stopped coordinator ---------------------------------------------------- */

static void test_unreachable(void) {
  rpl_gg_client_config cc;
  memset(&cc, 0, sizeof cc);
  cc.endpoint = "tcp://127.0.0.1:9"; /* discard port: nothing answers */
  cc.token_hex = "00112233445566778899aabbccddeeff";
  cc.rank = 0;
  cc.nworkers = 1;
  cc.timeout_ms = 300;
  rpl_gg_client *cl;
  rpl_error err;
  CHECK(rpl_gg_client_create(&cc, &cl, &err) == RPL_ERR_PEER && strstr(err.msg, "did not answer"),
        "unreachable: %s", err.msg);
  cc.endpoint = "nonsense://";
  CHECK(rpl_gg_client_create(&cc, &cl, &err) == RPL_ERR_INVALID, "bad endpoint: %s", err.msg);

  /* The coordinator stops while a worker waits for a partner: the heartbeat thread notices. */
  rpl_coord *c = start_coord(RPL_POLICY_SMART, 2, 2, 50, 300);
  rpl_gg_client *c0 = connect_client(c, 0, 2, 50);
  rpl_coord_stop(c);
  int mem[2], n;
  uint64_t gid;
  CHECK(rpl_gg_client_request(c0, 0, mem, 2, &n, &gid, &err) == RPL_ERR_PEER &&
            strstr(err.msg, "heartbeats"), "stopped coordinator: %s", err.msg);
  rpl_gg_client_destroy(c0);
  rpl_coord_destroy(c);

  /* A request times out when the partner never asks. */
  c = start_coord(RPL_POLICY_SMART, 2, 2, 50, 5000);
  cc.endpoint = rpl_coord_endpoint(c);
  cc.token_hex = rpl_coord_token(c);
  cc.nworkers = 2;
  cc.timeout_ms = 3000;
  cc.request_timeout_ms = 300;
  cc.heartbeat_ms = 50;
  CHECK(rpl_gg_client_create(&cc, &cl, &err) == RPL_OK, "%s", err.msg);
  CHECK(rpl_gg_client_request(cl, 0, mem, 2, &n, &gid, &err) == RPL_ERR_TIMEOUT, "timeout: %s",
        err.msg);
  /* Nothing is left stuck behind the timed-out request: both ask again and meet. */
  req2_arg a1 = {c, 1, 0, {0}, 0, RPL_OK};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, request_round, &a1) == 0, "thread");
  CHECK(rpl_gg_client_request(cl, 1, mem, 2, &n, &gid, &err) == RPL_OK && n == 2, "%s", err.msg);
  pthread_join(th, NULL);
  CHECK(a1.st == RPL_OK && a1.n == 2, "worker 1 grouped with worker 0 after its timeout");
  rpl_gg_client_destroy(cl);
  rpl_coord_destroy(c);
  printf("  unreachable, stopped coordinator and request timeout reported: ok\n");
}

int main(void) {
  test_groups_formed(RPL_POLICY_SMART);
  test_groups_formed(RPL_POLICY_RANDOM);
  test_groups_formed(RPL_POLICY_ADPSGD);
  test_dead_worker();
  test_rejections();
  test_unreachable();
  printf("test_coord: all passed\n");
  return 0;
}
