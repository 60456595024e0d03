/*
 * gg_latency: round-trip latency and throughput of the coordinator on loopback.
 * An embedded coordinator (its own thread) serves K client threads (one rpl_gg_client each,
 * sharing one zmq context, heartbeats off) that each issue REQUEST -> GROUP -> DONE in a loop.
 * Policy `random` with group size 1 answers every request at once, so this measures the
 * service path (parse, policy, encode, two socket hops) rather than waiting for partners;
 * `--group-size 2` adds matchmaking with random partners.
 *
 *   gg_latency [--clients 4,16,64,256] [--requests TOTAL] [--group-size G] [--policy P]
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "rpl_coord.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct {
  const char *endpoint, *token;
  void *ctx;
  int rank, nworkers, requests;
  double *rtt;
  int failed;
} client_arg;

static void *client_main(void *arg) {
  client_arg *a = arg;
  rpl_gg_client_config cc;
  memset(&cc, 0, sizeof cc);
  cc.endpoint = a->endpoint;
  cc.token_hex = a->token;
  cc.rank = a->rank;
  cc.nworkers = a->nworkers;
  cc.timeout_ms = 30000;
  cc.request_timeout_ms = 30000;
  cc.heartbeat_ms = -1;
  cc.zmq_context = a->ctx;
  rpl_gg_client *cl;
  rpl_error err;
  if (rpl_gg_client_create(&cc, &cl, &err) != RPL_OK) {
    fprintf(stderr, "client %d: %s\n", a->rank, err.msg);
    a->failed = 1;
    return NULL;
  }
  int *m = malloc(sizeof(int) * (size_t)a->nworkers);
  for (int i = 0; i < a->requests; i++) {
    int n;
    uint64_t gid;
    double t0 = now_s();
    if (rpl_gg_client_request(cl, (uint64_t)i, m, a->nworkers, &n, &gid, &err) != RPL_OK) {
      fprintf(stderr, "client %d: %s\n", a->rank, err.msg);
      a->failed = 1;
      break;
    }
    a->rtt[i] = now_s() - t0;
    rpl_gg_client_done(cl, gid, 0, &err);
  }
  free(m);
  rpl_gg_client_leave(cl, &err);
  rpl_gg_client_destroy(cl);
  return NULL;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  const char *clients = "4,16,64,256", *policy = "random";
  int total = 20000, group_size = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--clients")) clients = argv[i + 1];
    else if (!strcmp(argv[i], "--requests")) total = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--group-size")) group_size = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--policy")) policy = argv[i + 1];
    else {
      fprintf(stderr, "usage: gg_latency [--clients 4,16,64,256] [--requests N] "
                      "[--group-size G] [--policy P]\n");
      return 2;
    }
  }
  printf("%8s %8s %10s %10s %12s\n", "clients", "requests", "median_us", "p99_us", "requests/s");
  char list[256];
  snprintf(list, sizeof list, "%s", clients);
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
    int k = atoi(tok);
    if (k < 1) continue;
    rpl_coord_config cfg;
    memset(&cfg, 0, sizeof cfg);
    rpl_error err;
    if (rpl_policy_parse(policy, &cfg.gg.policy, &err) != RPL_OK) {
      fprintf(stderr, "%s\n", err.msg);
      return 2;
    }
    cfg.gg.nworkers = k;
    cfg.gg.group_size = group_size;
    cfg.gg.seed = 1;
    cfg.join_ms = -1;
    cfg.dead_ms = 600000;
    rpl_coord *c;
    if (rpl_coord_create(&cfg, &c, &err) != RPL_OK || rpl_coord_start(c, &err) != RPL_OK) {
      fprintf(stderr, "%s\n", err.msg);
      return 1;
    }
    int per = total / k < 20 ? 20 : total / k;
    void *ctx = zmq_ctx_new();
    client_arg *a = calloc((size_t)k, sizeof *a);
    pthread_t *th = calloc((size_t)k, sizeof *th);
    double *rtt = calloc((size_t)k * (size_t)per, sizeof *rtt);
    double t0 = now_s();
    for (int i = 0; i < k; i++) {
      a[i] = (client_arg){rpl_coord_endpoint(c), rpl_coord_token(c), ctx, i, k, per,
                          rtt + (size_t)i * per, 0};
      pthread_create(&th[i], NULL, client_main, &a[i]);
    }
    int failed = 0;
    for (int i = 0; i < k; i++) {
      pthread_join(th[i], NULL);
      failed |= a[i].failed;
    }
    double wall = now_s() - t0;
    size_t nr = (size_t)k * (size_t)per;
    qsort(rtt, nr, sizeof *rtt, cmp_d);
    printf("%8d %8zu %10.1f %10.1f %12.0f%s\n", k, nr, rtt[nr / 2] * 1e6,
           rtt[(size_t)(nr * 0.99)] * 1e6, (double)nr / wall, failed ? "  (failures)" : "");
    fflush(stdout);
    free(rtt);
    free(th);
    free(a);
    zmq_ctx_term(ctx);
    rpl_coord_destroy(c);
  }
  return 0;
}
