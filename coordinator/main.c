/* ripples-coordinator: the Group Generator as a standalone service, or a status query.
 *   ripples-coordinator --bind tcp://10.0.0.5:29600 --workers 16 --per-host 4 \
 *                       --write-token ~/.ripples-token
 *   RIPPLES_GG_TOKEN=$(cat ~/.ripples-token) ripples-coordinator --status tcp://10.0.0.5:29600
 * The default bind is loopback; the token is printed only with --print-token. --status prints
 * a table of the workers (--json: the whole status document). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rpl_coord.h"

#define DEFAULT_BIND "tcp://127.0.0.1:29600"

static rpl_coord *g_coord; /* for the signal handler only */

static void on_signal(int sig) {
  (void)sig;
  if (g_coord) rpl_coord_stop(g_coord); /* sets an atomic flag: the loop ends */
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: ripples-coordinator --workers N [--bind ENDPOINT] [--policy P]\n"
          "                           [--per-host L | --hosts LABEL,LABEL,...]\n"
          "                           [--group-size G] [--c-thres C] [--inter-intra]\n"
          "                           [--partner-wait-ms MS] [--max-isolated K]\n"
          "                           [--period-max P] [--seed S]\n"
          "                           [--token-file PATH | --token HEX]\n"
          "                           [--write-token PATH] [--print-token]\n"
          "                           [--heartbeat-ms MS] [--dead-ms MS] [--join-ms MS]\n"
          "                           [--standby]\n"
          "       ripples-coordinator --status ENDPOINT [--token-file PATH | --token HEX]\n"
          "                           [--timeout-ms MS] [--json]\n"
          "--bind defaults to " DEFAULT_BIND " (this host only): a multi-host job passes\n"
          "tcp://<interface-ip>:29600; every interface (tcp://0.0.0.0:29600) only if asked.\n"
          "Policies: random, smart, adpsgd, static. The token comes from --token-file, else\n"
          "$RIPPLES_GG_TOKEN, else a new one, which must be written (--write-token, created\n"
          "0600) or printed (--print-token). --token HEX works but argv is visible to other\n"
          "users (ps). --join-ms -1 waits for ever for workers to connect.\n"
          "--partner-wait-ms: longest wait for partners before a smaller group (0 = adaptive,\n"
          "-1 = never); --max-isolated: groups of one in a row per worker (0 = 2, -1 = no bound).\n"
          "--period-max: adaptive period (random, smart, adpsgd): while no worker falls behind,\n"
          "a worker averages only every P-th request and the coordinator passes the others\n"
          "(0 = default, %d; 1 or -1 = every request, as in the paper).\n"
          "--standby: a failover coordinator; every worker is out until it registers (list it\n"
          "after the primary in the workers' endpoint: tcp://primary:port,tcp://standby:port).\n"
          "--status prints a table of the workers (rank, host, state, steps/s, step, slowdown\n"
          "against the median step, groups of one, last seen); --json prints the whole status\n"
          "document instead (coordinator/PROTOCOL.md).\n",
          RPL_GG_DEFAULT_PERIOD_MAX);
}

static int read_token_file(const char *path, char *hex, size_t cap) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t n = fread(hex, 1, cap - 1, f);
  fclose(f);
  hex[n] = '\0';
  while (n > 0 && (hex[n - 1] == '\n' || hex[n - 1] == '\r' || hex[n - 1] == ' ')) hex[--n] = '\0';
  return 0;
}

/* Writes the token readable by its owner only: created 0600, also made 0600 if it existed,
 * and never through a symbolic link. */
static int write_token_file(const char *path, const char *hex) {
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) return -1;
  size_t n = strlen(hex);
  int ok = fchmod(fd, 0600) == 0 && write(fd, hex, n) == (ssize_t)n && write(fd, "\n", 1) == 1;
  if (close(fd) != 0) ok = 0;
  return ok ? 0 : -1;
}

static int parse_int(const char *s, const char *what, long lo, long hi, int *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (!*s || *end || v < lo || v > hi) {
    fprintf(stderr, "ripples-coordinator: %s must be an integer in [%ld, %ld], got '%s'\n", what,
            lo, hi, s);
    return -1;
  }
  *out = (int)v;
  return 0;
}

int main(int argc, char **argv) {
  const char *bind = DEFAULT_BIND, *status = NULL, *token = getenv("RIPPLES_GG_TOKEN");
  const char *policy = "smart", *hosts = NULL, *token_file = NULL, *write_token = NULL;
  const char *token_from = token ? "from $RIPPLES_GG_TOKEN" : NULL;
  int print_token = 0, as_json = 0;
  int workers = 0, per_host = 0, group_size = 0, c_thres = 0, inter_intra = 0;
  int heartbeat_ms = 0, dead_ms = 0, join_ms = 0, timeout_ms = 5000, standby = 0;
  int partner_wait_ms = 0, max_isolated = 0, period_max = 0;
  unsigned long long seed = 0;
  char token_buf[128];
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE                                                             \
  if (!v) {                                                                    \
    fprintf(stderr, "ripples-coordinator: %s needs a value\n", a);             \
    return 2;                                                                  \
  }                                                                            \
  i++
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(stdout); return 0; }
    else if (!strcmp(a, "--inter-intra")) inter_intra = 1;
    else if (!strcmp(a, "--bind")) { NEED_VALUE; bind = v; }
    else if (!strcmp(a, "--status")) { NEED_VALUE; status = v; }
    else if (!strcmp(a, "--token")) {
      NEED_VALUE;
      token = v;
      token_from = "from --token";
      fprintf(stderr, "ripples-coordinator: warning: --token puts the job token in the command "
                      "line, which other users of this host can read (ps); prefer "
                      "--token-file FILE or $RIPPLES_GG_TOKEN\n");
    }
    else if (!strcmp(a, "--token-file")) { NEED_VALUE; token_file = v; }
    else if (!strcmp(a, "--write-token")) { NEED_VALUE; write_token = v; }
    else if (!strcmp(a, "--print-token")) print_token = 1;
    else if (!strcmp(a, "--json")) as_json = 1;
    else if (!strcmp(a, "--policy")) { NEED_VALUE; policy = v; }
    else if (!strcmp(a, "--hosts")) { NEED_VALUE; hosts = v; }
    else if (!strcmp(a, "--seed")) { NEED_VALUE; seed = strtoull(v, NULL, 0); }
    else if (!strcmp(a, "--workers")) { NEED_VALUE; if (parse_int(v, a, 1, RPL_SCHED_MAX_WORKERS, &workers)) return 2; }
    else if (!strcmp(a, "--per-host")) { NEED_VALUE; if (parse_int(v, a, 1, RPL_SCHED_MAX_WORKERS, &per_host)) return 2; }
    else if (!strcmp(a, "--group-size")) { NEED_VALUE; if (parse_int(v, a, 1, RPL_SCHED_MAX_WORKERS, &group_size)) return 2; }
    else if (!strcmp(a, "--c-thres")) { NEED_VALUE; if (parse_int(v, a, -1, 1 << 30, &c_thres)) return 2; }
    else if (!strcmp(a, "--partner-wait-ms")) { NEED_VALUE; if (parse_int(v, a, -1, 1 << 30, &partner_wait_ms)) return 2; }
    else if (!strcmp(a, "--max-isolated")) { NEED_VALUE; if (parse_int(v, a, -1, 1 << 30, &max_isolated)) return 2; }
    else if (!strcmp(a, "--period-max")) { NEED_VALUE; if (parse_int(v, a, -1, RPL_GG_MAX_PERIOD, &period_max)) return 2; }
    else if (!strcmp(a, "--heartbeat-ms")) { NEED_VALUE; if (parse_int(v, a, 1, 1 << 30, &heartbeat_ms)) return 2; }
    else if (!strcmp(a, "--dead-ms")) { NEED_VALUE; if (parse_int(v, a, 1, 1 << 30, &dead_ms)) return 2; }
    else if (!strcmp(a, "--join-ms")) { NEED_VALUE; if (parse_int(v, a, -1, 1 << 30, &join_ms)) return 2; }
    else if (!strcmp(a, "--standby")) standby = 1;
    else if (!strcmp(a, "--timeout-ms")) { NEED_VALUE; if (parse_int(v, a, 1, 1 << 30, &timeout_ms)) return 2; }
    else {
      fprintf(stderr, "ripples-coordinator: unknown argument '%s'\n", a);
      usage(stderr);
      return 2;
    }
#undef NEED_VALUE
  }
  if (token_file) {
    if (read_token_file(token_file, token_buf, sizeof token_buf) != 0) {
      fprintf(stderr, "ripples-coordinator: cannot read token file '%s'\n", token_file);
      return 2;
    }
    token = token_buf;
    token_from = "read from the token file";
  }
  rpl_error err;
  if (status) {
    if (!token) {
      fprintf(stderr, "ripples-coordinator: --status needs the job token (--token, "
                      "--token-file or $RIPPLES_GG_TOKEN)\n");
      return 2;
    }
    char *json = NULL;
    if (rpl_gg_query_status(status, token, timeout_ms, &json, &err) != RPL_OK) {
      fprintf(stderr, "ripples-coordinator: %s\n", err.msg);
      return 1;
    }
    if (as_json) {
      printf("%s\n", json);
      free(json);
      return 0;
    }
    char *table = NULL;
    rpl_status st = rpl_coord_status_table(json, strlen(json), &table, &err);
    free(json);
    if (st != RPL_OK) {
      fprintf(stderr, "ripples-coordinator: %s (--json prints it as it came)\n", err.msg);
      return 1;
    }
    fputs(table, stdout);
    free(table);
    return 0;
  }
  if (workers < 1) {
    fprintf(stderr, "ripples-coordinator: --workers N is required\n");
    usage(stderr);
    return 2;
  }
  if (!token && !write_token && !print_token) {
    fprintf(stderr, "ripples-coordinator: a new job token must reach the workers: pass "
                    "--write-token FILE (created 0600) or --print-token, or give one with "
                    "--token-file / $RIPPLES_GG_TOKEN\n");
    return 2;
  }
  rpl_coord_config cfg;
  memset(&cfg, 0, sizeof cfg);
  if (rpl_policy_parse(policy, &cfg.gg.policy, &err) != RPL_OK) {
    fprintf(stderr, "ripples-coordinator: %s\n", err.msg);
    return 2;
  }
  int *labels = malloc(sizeof(int) * (size_t)workers);
  if (!labels) return 1;
  for (int r = 0; r < workers; r++) labels[r] = per_host ? r / per_host : 0;
  if (hosts) {
    const char *p = hosts;
    for (int r = 0; r < workers; r++) {
      char *end;
      long v = strtol(p, &end, 10);
      if (end == p || (*end != ',' && *end != '\0') || (*end == '\0' && r != workers - 1)) {
        fprintf(stderr, "ripples-coordinator: --hosts needs %d comma-separated integers\n",
                workers);
        free(labels);
        return 2;
      }
      labels[r] = (int)v;
      p = *end ? end + 1 : end;
    }
    if (*p) {
      fprintf(stderr, "ripples-coordinator: --hosts has more than %d labels\n", workers);
      free(labels);
      return 2;
    }
  }
  cfg.bind = bind;
  cfg.token_hex = token;
  cfg.gg.nworkers = workers;
  cfg.gg.host_of = labels;
  cfg.gg.group_size = group_size;
  cfg.gg.c_thres = c_thres;
  cfg.gg.inter_intra = inter_intra;
  cfg.gg.seed = seed;
  cfg.gg.partner_wait_ms = partner_wait_ms;
  cfg.gg.max_isolated = max_isolated;
  cfg.gg.period_max = period_max;
  cfg.heartbeat_ms = heartbeat_ms;
  cfg.dead_ms = dead_ms;
  cfg.join_ms = join_ms;
  cfg.standby = standby;
  rpl_coord *c;
  if (rpl_coord_create(&cfg, &c, &err) != RPL_OK) {
    fprintf(stderr, "ripples-coordinator: %s\n", err.msg);
    free(labels);
    return 1;
  }
  free(labels);
  g_coord = c;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  if (write_token && write_token_file(write_token, rpl_coord_token(c)) != 0) {
    fprintf(stderr, "ripples-coordinator: cannot write token file '%s': %s\n", write_token,
            strerror(errno));
    rpl_coord_destroy(c);
    return 1;
  }
  if (print_token)
    printf("ripples-coordinator: %s for %d workers at %s token %s%s\n", policy, workers,
           rpl_coord_endpoint(c), rpl_coord_token(c), standby ? " (standby)" : "");
  else
    printf("ripples-coordinator: %s for %d workers at %s token %s%s%s%s\n", policy, workers,
           rpl_coord_endpoint(c), token_from ? token_from : "generated",
           write_token ? ", written to " : "", write_token ? write_token : "",
           standby ? " (standby)" : "");
  fflush(stdout);
  if (!strncmp(rpl_coord_endpoint(c), "tcp://127.", 10) ||
      !strncmp(rpl_coord_endpoint(c), "tcp://[::1]", 11))
    fprintf(stderr, "ripples-coordinator: listening on loopback only; a multi-host job must "
                    "pass --bind tcp://<interface-ip>:29600 (the address its workers reach)\n");
  rpl_status st = rpl_coord_run(c, &err);
  if (st != RPL_OK) fprintf(stderr, "ripples-coordinator: %s\n", err.msg);
  g_coord = NULL;
  rpl_coord_destroy(c);
  return st == RPL_OK ? 0 : 1;
}
