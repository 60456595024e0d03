/* Straggler attribution (coordinator/coord_straggler.h) on the I/O-free coordinator core, with
 * made-up times: workers step at chosen paces through real protocol messages, and the checks
 * are on what a user sees -- the log lines, the status documents, the --status table.
 *   - a 5x slower rank is named, with its slowdown and the step its slow spell began, in one
 *     line, within a few dozen of its steps; nobody else is; it recovers in one line;
 *   - a rank stuck in a step is seen before the step ends; a pause of everyone is no straggler;
 *   - a flapping rank is logged at most once per COORD_SLOW_HOLD_S, many at once within the
 *     log's burst, and the lines left out are counted in the next one;
 *   - host names with quotes and control bytes come out sanitised;
 *   - the status document stays within its bound at the largest job, and renders as a table;
 *   - the table reader refuses what is not a status document;
 *   - over real sockets, a rank's summary comes from the coordinator that serves it, along a
 *     failover list (one that is down, or does not serve the rank, is passed over). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_core.h"
#include "rpl_coord.h"

#include "check.h"

/* ---- a simulated job ------------------------------------------------------------------------ */

#define MAXW 64
#define MAXLINES 256

typedef struct {
  char line[MAXLINES][256];
  int n;
} lines;

static void keep_line(void *ctx, const char *line) {
  lines *l = ctx;
  if (l->n < MAXLINES) snprintf(l->line[l->n++], sizeof l->line[0], "%s", line);
}

static int ignore_send(void *ctx, const uint8_t *route, size_t route_len, const void *msg,
                       size_t len) {
  (void)ctx, (void)route, (void)route_len, (void)msg, (void)len;
  return 0;
}

/* The last STATUS_REPLY's text, for status queries, and the last CHALLENGE's nonce. */
static char g_reply[1 << 16];
static uint8_t g_nonce_c[RPL_NONCE_LEN];
static int capture_send(void *ctx, const uint8_t *route, size_t route_len, const void *msg,
                        size_t len) {
  (void)ctx, (void)route, (void)route_len;
  rpl_msg m;
  rpl_error err;
  if (rpl_msg_parse(msg, len, 0, &m, &err) != RPL_OK) return 0;
  if (m.type == RPL_MSG_CHALLENGE) {
    memcpy(g_nonce_c, m.nonce_c, RPL_NONCE_LEN);
  } else if (m.type == RPL_MSG_STATUS_REPLY) {
    size_t n = m.text_len < sizeof g_reply - 1 ? m.text_len : sizeof g_reply - 1;
    memcpy(g_reply, m.text, n);
    g_reply[n] = '\0';
  } else if (m.type == RPL_MSG_ERROR) {
    snprintf(g_reply, sizeof g_reply, "ERROR %u", m.code);
  }
  return 0;
}

typedef struct {
  coord_core core;
  lines log;
  int n;
  uint32_t seq[MAXW];
  uint8_t key[MAXW][RPL_TOKEN_LEN]; /* each worker's session key */
  uint64_t round[MAXW];
  double next[MAXW];  /* when it asks next */
  double step[MAXW];  /* its compute step; < 0 = stuck */
} job;

static void send_msg(job *j, int rank, rpl_msg *m, double now) {
  uint8_t b[256], route[RPL_ROUTE_ID_LEN];
  route[0] = RPL_ROUTE_REQUEST;
  memset(route + 1, 0x20 + rank, RPL_ROUTE_ID_LEN - 1);
  m->rank = rank;
  m->seq = ++j->seq[rank];
  if (m->type != RPL_MSG_HELLO) memcpy(m->token, j->key[rank], RPL_TOKEN_LEN); /* HELLO: set */
  size_t len = rpl_msg_encode(m, NULL, b, sizeof b);
  REQUIRE(len > 0, "encode");
  coord_core_handle(&j->core, route, RPL_ROUTE_ID_LEN, b, len, now);
}

static void job_init(job *j, int n, const char *const *names) {
  memset(j, 0, sizeof *j);
  j->n = n;
  rpl_coord_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.token_hex = "a77ba77ba77ba77ba77ba77ba77ba77b";
  /* Groups of one at once: each step is a request, a group, a done. */
  cfg.gg.policy = RPL_POLICY_RANDOM;
  cfg.gg.nworkers = n;
  cfg.gg.group_size = 1;
  cfg.gg.partner_wait_ms = -1;
  cfg.gg.max_isolated = -1;
  int labels[MAXW];
  for (int i = 0; i < n; i++) labels[i] = i < n / 2 ? 0 : 1;
  cfg.gg.host_of = labels;
  cfg.heartbeat_ms = 1000;
  cfg.dead_ms = 1000000; /* nobody dies here, stuck or not */
  cfg.join_ms = -1;
  cfg.host_names = names;
  cfg.log = keep_line;
  cfg.log_ctx = &j->log;
  rpl_error err;
  REQUIRE(coord_core_init(&j->core, &cfg, &err) == RPL_OK, "%s", err.msg);
  j->core.send = ignore_send;
  j->core.start = 0;
  for (int r = 0; r < n; r++) { /* a session each: the opening, then the answer */
    rpl_msg m;
    memset(&m, 0, sizeof m);
    m.type = RPL_MSG_HELLO;
    m.nworkers = n;
    m.host_label = labels[r];
    m.nonce_w[0] = (uint8_t)(r + 1);
    memcpy(m.token, j->core.token, RPL_TOKEN_LEN);
    j->core.send = capture_send;
    send_msg(j, r, &m, 0.0);
    memcpy(m.nonce_c, g_nonce_c, RPL_NONCE_LEN);
    rpl_session_key(j->core.token, RPL_MSG_HELLO, r, m.nonce_w, m.nonce_c, j->key[r]);
    memcpy(m.token, j->key[r], RPL_TOKEN_LEN);
    send_msg(j, r, &m, 0.0);
    j->core.send = ignore_send;
    j->step[r] = 0.010;
    j->next[r] = 0.001 * r;
  }
}

/* Runs the job until `until`: every worker asks, gets its group, says done, computes. */
static void job_run(job *j, double until) {
  for (;;) {
    int w = -1;
    for (int r = 0; r < j->n; r++)
      if (j->step[r] >= 0 && (w < 0 || j->next[r] < j->next[w])) w = r;
    double t = w < 0 ? until : j->next[w];
    if (t > until) t = until;
    coord_core_tick(&j->core, t);
    if (w < 0 || j->next[w] > until) return;
    rpl_msg m;
    memset(&m, 0, sizeof m);
    m.type = RPL_MSG_REQUEST;
    m.round = j->round[w]++;
    send_msg(j, w, &m, t);
    rpl_gg_worker_info info;
    rpl_error err;
    REQUIRE(rpl_gg_worker(j->core.gg, w, &info, &err) == RPL_OK, "%s", err.msg);
    memset(&m, 0, sizeof m);
    m.type = RPL_MSG_DONE;
    m.group_id = info.locked_group;
    send_msg(j, w, &m, t);
    j->next[w] = t + j->step[w];
  }
}

static int count_lines(const job *j, const char *needle) {
  int k = 0;
  for (int i = 0; i < j->log.n; i++) k += strstr(j->log.line[i], needle) != NULL;
  return k;
}

static const char *status_of(job *j, int rank, double now) {
  j->core.send = capture_send;
  rpl_msg m;
  memset(&m, 0, sizeof m);
  m.type = RPL_MSG_STATUS;
  uint8_t b[256], route[RPL_ROUTE_ID_LEN];
  memset(route, 0x77, sizeof route);
  m.rank = rank;
  m.seq = 1;
  m.nonce_w[0] = 0x42;
  memcpy(m.token, j->core.token, RPL_TOKEN_LEN);
  size_t len = rpl_msg_encode(&m, NULL, b, sizeof b);
  coord_core_handle(&j->core, route, sizeof route, b, len, now); /* the opening */
  memcpy(m.nonce_c, g_nonce_c, RPL_NONCE_LEN);
  rpl_session_key(j->core.token, RPL_MSG_STATUS, rank, m.nonce_w, m.nonce_c, m.token);
  m.seq = 2;
  len = rpl_msg_encode(&m, NULL, b, sizeof b);
  g_reply[0] = '\0';
  coord_core_handle(&j->core, route, sizeof route, b, len, now);
  j->core.send = ignore_send;
  return g_reply;
}

/* ---- the tests ------------------------------------------------------------------------------ */

static void test_slow_rank_named_and_recovers(void) {
  static const char *const names[4] = {"alpha", "alpha", "beta", "beta"};
  job *j = calloc(1, sizeof *j);
  job_init(j, 4, names);
  job_run(j, 3.0);
  REQUIRE(j->log.n == 0, "equal workers: no line, got '%s'", j->log.line[0]);
  /* Rank 3 becomes 5x slower at t = 3 s. */
  j->step[3] = 0.050;
  uint64_t began = j->round[3];
  double t = 3.0;
  while (j->log.n == 0 && t < 20.0) job_run(j, t += 0.1);
  REQUIRE(j->log.n == 1, "%d lines", j->log.n);
  const char *l = j->log.line[0];
  REQUIRE(strstr(l, "ripples: rank 3 on host beta is ") && strstr(l, "x slower than the median "
          "since step "), "line: %s", l);
  double factor = atof(strstr(l, " is ") + 4);
  unsigned long long since = strtoull(strstr(l, "since step ") + 11, NULL, 10);
  REQUIRE(factor >= 4.0 && factor <= 5.5, "slowdown in '%s'", l);
  /* Its spell is seen at the first refresh (every COORD_ATTR_EVERY_S) after a slow step. */
  REQUIRE(since >= began && since <= began + 2 + COORD_ATTR_EVERY_S / 0.05,
          "since step %llu, slow from %llu", since,
          (unsigned long long)began);
  REQUIRE(j->round[3] - began <= 60, "named after %llu of its steps",
          (unsigned long long)(j->round[3] - began));
  /* What the documents say. */
  const char *doc = status_of(j, 1, t);
  REQUIRE(strstr(doc, "\"rank\":1,") && strstr(doc, "\"slowest\":[{\"rank\":3,"),
          "rank 1's summary: %s", doc);
  REQUIRE(strstr(doc, "\"slow\":true,\"slow_since_step\":"), "summary: %s", doc);
  doc = status_of(j, -1, t);
  char *table = NULL;
  rpl_error err;
  REQUIRE(rpl_coord_status_table(doc, strlen(doc), &table, &err) == RPL_OK, "%s", err.msg);
  printf("%s", table);
  const char *row = strstr(table, "\n   3  beta");
  REQUIRE(row && strstr(row, "x  ") && strstr(row, "slow since step"), "table:\n%s", table);
  REQUIRE(strstr(table, "median step 10.0 ms"), "table:\n%s", table);
  /* What-if (issue 50): the slow rank caused all of all-reduce's waiting, and with nobody
   * waiting here (groups of one) the job saved all of it. */
  REQUIRE(strstr(row, "100%") && strstr(table, "what-if over ") &&
          strstr(table, "this job took "), "table:\n%s", table);
  const char *wf = strstr(doc, "\"whatif\":{");
  REQUIRE(wf, "no whatif in the status document: %s", doc);
  double waste = atof(strstr(wf, "\"waste\":") + 8), saved = atof(strstr(wf, "\"saved\":") + 8);
  double gain = atof(strstr(wf, "\"gain\":") + 7);
  CHECK(gain > 1.2 && waste > 0.15 && saved > waste - 0.02 && saved <= waste + 0.02,
        "whatif: gain %g waste %g saved %g", gain, waste, saved);
  free(table);
  /* Back to the others' pace: one line, not before COORD_SLOW_HOLD_S after the first. */
  double slow_at = t;
  j->step[3] = 0.010;
  while (j->log.n == 1 && t < 60.0) job_run(j, t += 0.1);
  REQUIRE(j->log.n == 2 && strstr(j->log.line[1], "ripples: rank 3 on host beta recovered ("),
          "lines: %d, %s", j->log.n, j->log.line[1]);
  REQUIRE(t - slow_at >= COORD_SLOW_HOLD_S - 0.2, "recovered %.1f s after it was named",
          t - slow_at);
  job_run(j, t + 30.0);
  REQUIRE(j->log.n == 2, "quiet afterwards: %s", j->log.line[2]);
  REQUIRE(count_lines(j, "rank 0 ") + count_lines(j, "rank 1 ") + count_lines(j, "rank 2 ") == 0,
          "only rank 3 named");
  coord_core_free(&j->core);
  free(j);
}

static void test_stuck_rank_and_pause(void) {
  job *j = calloc(1, sizeof *j);
  job_init(j, 4, NULL);
  job_run(j, 2.0);
  /* Everybody pauses (an evaluation, a checkpoint): nobody is slower than anybody. */
  for (int r = 0; r < 4; r++) j->next[r] += 30.0;
  job_run(j, 40.0);
  REQUIRE(j->log.n == 0, "a pause of all: %s", j->log.line[0]);
  /* Rank 1 gets stuck in a step: named before the step ends (host: its label). */
  j->step[1] = -1;
  double t = 40.0;
  while (j->log.n == 0 && t < 50.0) job_run(j, t += 0.1);
  REQUIRE(j->log.n == 1 && strstr(j->log.line[0], "ripples: rank 1 on host 0 is "),
          "stuck: %d lines, %s", j->log.n, j->log.line[0]);
  REQUIRE(t < 45.0, "stuck rank named only after %.1f s", t - 40.0);
  coord_core_free(&j->core);
  free(j);
}

static void test_rate_limits(void) {
  static const char *names[MAXW];
  names[20] = "a\"b\\c";
  names[21] = "x\ny\001";
  job *j = calloc(1, sizeof *j);
  job_init(j, 40, names);
  job_run(j, 2.0);
  /* Half the job turns slow at once: the burst is logged, the rest only counted ... */
  for (int r = 20; r < 40; r++) j->step[r] = 0.05;
  job_run(j, 8.0);
  REQUIRE(j->log.n == COORD_LOG_BURST, "%d lines at once", j->log.n);
  /* ... in a line of their own once the bucket has a token again. */
  job_run(j, 20.0);
  REQUIRE(j->log.n == COORD_LOG_BURST + 1 &&
              strstr(j->log.line[COORD_LOG_BURST], "ripples: 10 slow/recovered change(s) not "
                     "logged (rate limit)"), "the count of left-out lines: %s",
          j->log.line[COORD_LOG_BURST]);
  const char *doc = status_of(j, -1, 20.0);
  REQUIRE(strstr(doc, "\"slow\":20,"), "every slow rank counted: %.300s",
          strstr(doc, "\"attribution"));
  /* Sanitised host names, in the line and in the document. */
  REQUIRE(count_lines(j, "rank 20 on host a?b?c is "), "rank 20's line: %s", j->log.line[0]);
  REQUIRE(strstr(doc, "\"host_name\":\"a?b?c\"") && strstr(doc, "\"host_name\":\"x?y?\""),
          "names in the document");
  /* A flapping rank: slow, fast, slow ... every 3 s; at most one line per hold time. */
  job *f = calloc(1, sizeof *f);
  job_init(f, 4, NULL);
  double t = 1.0;
  for (int k = 0; k < 20; k++) {
    f->step[2] = k % 2 ? 0.010 : 0.080;
    job_run(f, t += 3.0);
  }
  REQUIRE(f->log.n >= 2 && f->log.n <= (int)(60.0 / COORD_SLOW_HOLD_S) + 1, "%d lines in 60 s",
          f->log.n);
  coord_core_free(&f->core);
  free(f);
  coord_core_free(&j->core);
  free(j);
}

static void test_bounded_document(void) {
  /* The largest job: the document stays within RPL_PROTO_MAX_BODY (listing the workers it
   * can), the summary of a rank stays small, and both render. */
  rpl_coord_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.gg.policy = RPL_POLICY_SMART;
  cfg.gg.nworkers = RPL_SCHED_MAX_WORKERS;
  cfg.join_ms = -1;
  coord_core core;
  rpl_error err;
  REQUIRE(coord_core_init(&core, &cfg, &err) == RPL_OK, "%s", err.msg);
  core.start = 0;
  size_t len = 0;
  char *doc = coord_core_status_json(&core, 1.0, &len);
  REQUIRE(doc && len <= RPL_PROTO_MAX_BODY, "document of %zu bytes", len);
  REQUIRE(strstr(doc, "\"workers_omitted\":") && !strstr(doc, "\"workers_omitted\":0,"),
          "some workers left out at %d", RPL_SCHED_MAX_WORKERS);
  char *table = NULL;
  REQUIRE(rpl_coord_status_table(doc, len, &table, &err) == RPL_OK, "%s", err.msg);
  REQUIRE(strstr(table, "more workers not listed"), "the table says so");
  free(table);
  free(doc);
  doc = coord_core_rank_json(&core, RPL_SCHED_MAX_WORKERS - 1, 1.0, &len);
  REQUIRE(doc && len < 4096, "summary of %zu bytes", len);
  free(doc);
  coord_core_free(&core);
}

static void test_table_reader(void) {
  /* A document of a coordinator before issue 24 (no attribution): hosts by label. */
  const char *old = "{\"version\":4,\"policy\":\"smart\",\"nworkers\":2,\"uptime_s\":3.5,"
                    "\"counters\":{\"messages\":1},\"workers\":[{\"rank\":0,\"state\":\"live\","
                    "\"host\":0,\"host_label\":7,\"handed\":4,\"singletons\":1,\"step_s\":0.02,"
                    "\"seen\":true,\"silent_s\":0.25},{\"rank\":1,\"state\":\"dead\",\"host\":1,"
                    "\"host_label\":-1,\"seen\":false}],\"pending\":[{\"id\":1,\"members\":[0]}]}";
  char *table = NULL;
  rpl_error err;
  REQUIRE(rpl_coord_status_table(old, strlen(old), &table, &err) == RPL_OK, "%s", err.msg);
  REQUIRE(strstr(table, "smart coordinator, 2 workers, median step -, up 4 s\n") &&
              strstr(table, "   0  7     live") && strstr(table, "1 (25%)") &&
              strstr(table, "0.2 s ago") && strstr(table, "   1  1     dead") &&
              strstr(table, "never"),
          "table:\n%s", table);
  free(table);
  const char *bad[] = {"", "[]", "{", "{\"workers\":[{\"rank\":0}", "{\"workers\":[]} x",
                       "{\"policy\":\"smart\"}", "{\"workers\":[{\"rank\":\"0\"}]}",
                       "{\"workers\":[{\"rank\":0,\"state\":\"li\\qve\"}]}",
                       "{\"workers\":[{\"rank\":1e999}]}"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    REQUIRE(rpl_coord_status_table(bad[i], strlen(bad[i]), &table, &err) == RPL_ERR_INVALID,
            "accepted '%s'", bad[i]);
  /* Nesting deeper than the reader goes is refused, not followed. */
  static char deep[40000];
  size_t k = (size_t)snprintf(deep, sizeof deep, "{\"workers\":[],\"x\":");
  for (int i = 0; i < 10000; i++) deep[k++] = '[';
  deep[k] = '\0';
  REQUIRE(rpl_coord_status_table(deep, k, &table, &err) == RPL_ERR_INVALID, "deep nesting");
}

static void test_rank_query_over_sockets(void) {
  rpl_coord_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.gg.policy = RPL_POLICY_RANDOM;
  cfg.gg.nworkers = 2;
  cfg.join_ms = -1;
  rpl_coord *c;
  rpl_error err;
  REQUIRE(rpl_coord_create(&cfg, &c, &err) == RPL_OK, "%s", err.msg);
  REQUIRE(rpl_coord_start(c, &err) == RPL_OK, "%s", err.msg);
  rpl_gg_client_config cc = {
      .endpoint = rpl_coord_endpoint(c),
      .token_hex = rpl_coord_token(c),
      .rank = 1,
      .nworkers = 2,
      .host_label = 5,
      .timeout_ms = 5000,
  };
  rpl_gg_client *cl;
  REQUIRE(rpl_gg_client_create(&cc, &cl, &err) == RPL_OK, "%s", err.msg);
  char *json = NULL;
  REQUIRE(rpl_gg_query_rank_status(rpl_coord_endpoint(c), rpl_coord_token(c), 1, 5000, &json,
                                   &err) == RPL_OK, "%s", err.msg);
  REQUIRE(strstr(json, "\"rank\":1,") && strstr(json, "\"self\":{\"rank\":1,") &&
              strstr(json, "\"host_name\":\"5\""), "summary: %s", json);
  free(json);
  /* Rank 0 never registered here: refused, so that a worker asks its next coordinator. */
  REQUIRE(rpl_gg_query_rank_status(rpl_coord_endpoint(c), rpl_coord_token(c), 0, 5000, &json,
                                   &err) == RPL_ERR_INVALID && strstr(err.msg, "not registered"),
          "%s", err.msg);
  /* A list whose first coordinator is gone. */
  char list[600];
  snprintf(list, sizeof list, "tcp://127.0.0.1:1,%s", rpl_coord_endpoint(c));
  REQUIRE(rpl_gg_query_rank_status(list, rpl_coord_token(c), 1, 300, &json, &err) == RPL_OK,
          "%s", err.msg);
  free(json);
  rpl_gg_client_leave(cl, &err);
  rpl_gg_client_destroy(cl);
  rpl_coord_destroy(c);
}

int main(void) {
  test_slow_rank_named_and_recovers();
  test_stuck_rank_and_pause();
  test_rate_limits();
  test_bounded_document();
  test_table_reader();
  test_rank_query_over_sockets();
  return report("test_coord_attr");
}
