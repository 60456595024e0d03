/* The ripples-coordinator command line (rpl_coord_cli.h): the one definition the binary and
 * the Python entry point share. The default bind is loopback; the token is printed only with
 * --print-token. --status prints a table of the workers (--json: the whole status document). */
#include "rpl_coord_cli.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static rpl_coord *g_coord; /* for the signal handler only */

static void on_signal(int sig) {
  (void)sig;
  if (g_coord) rpl_coord_stop(g_coord); /* sets an atomic flag: the loop ends */
}

void rpl_coord_cli_usage(FILE *f) {
  fprintf(f,
          "usage: ripples-coordinator --workers N [--bind ENDPOINT] [--schedule S]\n"
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
          "--bind defaults to " RPL_COORD_CLI_DEFAULT_BIND " (this host only): a multi-host job passes\n"
          "tcp://<interface-ip>:29600; every interface (tcp://0.0.0.0:29600) only if asked.\n"
          "Schedules: random, smart, adpsgd, static (--policy is the old name). The token comes\n"
          "from --token-file, else $RIPPLES_COORDINATOR_TOKEN (the old $RIPPLES_GG_TOKEN\n"
          "works), else a new one, which must be written (--write-token, created\n"
          "0600) or printed (--print-token). --token HEX works but argv is visible to other\n"
          "users (ps). --join-ms -1 waits for ever for workers to connect.\n"
          "--partner-wait-ms: longest wait for partners before a smaller group (0 = adaptive,\n"
          "-1 = never); --max-isolated: groups of one in a row per worker (0 = 2, -1 = no bound).\n"
          "--period-max: adaptive period (random, smart, adpsgd): while the job keeps its pace,\n"
          "a worker averages only every P-th request and the coordinator passes the others\n"
          "(a straggler, its step over 2x the median, averages with whoever is due)\n"
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

/* The integer flags: name, bounds, where the value goes. */
typedef struct int_flag {
  const char *name;
  long lo, hi;
  size_t offset; /* of an int in rpl_coord_cli */
} int_flag;

#define CLI_FIELD(f) offsetof(rpl_coord_cli, f)
static const int_flag k_int_flags[] = {
    {"--workers", 1, RPL_SCHED_MAX_WORKERS, CLI_FIELD(cfg.gg.nworkers)},
    {"--per-host", 1, RPL_SCHED_MAX_WORKERS, CLI_FIELD(per_host)},
    {"--group-size", 1, RPL_SCHED_MAX_WORKERS, CLI_FIELD(cfg.gg.group_size)},
    {"--c-thres", -1, 1 << 30, CLI_FIELD(cfg.gg.c_thres)},
    {"--partner-wait-ms", -1, 1 << 30, CLI_FIELD(cfg.gg.partner_wait_ms)},
    {"--max-isolated", -1, 1 << 30, CLI_FIELD(cfg.gg.max_isolated)},
    {"--period-max", -1, RPL_GG_MAX_PERIOD, CLI_FIELD(cfg.gg.period_max)},
    {"--heartbeat-ms", RPL_HEARTBEAT_MIN_MS, RPL_HEARTBEAT_MAX_MS, CLI_FIELD(cfg.heartbeat_ms)},
    {"--dead-ms", 1, 1 << 30, CLI_FIELD(cfg.dead_ms)},
    {"--join-ms", -1, 1 << 30, CLI_FIELD(cfg.join_ms)},
    {"--timeout-ms", 1, 1 << 30, CLI_FIELD(timeout_ms)},
};
#undef CLI_FIELD

/* The string flags: name, where the value goes. */
typedef struct str_flag {
  const char *name;
  size_t offset; /* of a const char * in rpl_coord_cli */
} str_flag;

static const str_flag k_str_flags[] = {
    {"--bind", offsetof(rpl_coord_cli, cfg.bind)},
    {"--status", offsetof(rpl_coord_cli, status)},
    {"--token-file", offsetof(rpl_coord_cli, token_file)}, /* read after the loop */
    {"--write-token", offsetof(rpl_coord_cli, write_token)},
    {"--schedule", offsetof(rpl_coord_cli, policy)},
    {"--policy", offsetof(rpl_coord_cli, policy)}, /* the old name of --schedule */
    {"--hosts", offsetof(rpl_coord_cli, hosts)},
};

int rpl_coord_cli_parse(int argc, char *const *argv, rpl_coord_cli *cli) {
  memset(cli, 0, sizeof *cli);
  cli->cfg.bind = RPL_COORD_CLI_DEFAULT_BIND;
  cli->policy = "smart";
  cli->timeout_ms = 5000;
  /* One name for the token on both sides: the workers read RIPPLES_COORDINATOR_TOKEN. */
  cli->token = getenv("RIPPLES_COORDINATOR_TOKEN");
  cli->token_from = cli->token ? "from $RIPPLES_COORDINATOR_TOKEN" : NULL;
  if (!cli->token && (cli->token = getenv("RIPPLES_GG_TOKEN")) != NULL) {
    cli->token_from = "from $RIPPLES_GG_TOKEN";
    fprintf(stderr, "ripples-coordinator: warning: $RIPPLES_GG_TOKEN is deprecated; use "
                    "$RIPPLES_COORDINATOR_TOKEN, as the workers do\n");
  }
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      rpl_coord_cli_usage(stdout);
      return 0;
    }
    if (!strcmp(a, "--inter-intra")) { cli->cfg.gg.inter_intra = 1; continue; }
    if (!strcmp(a, "--print-token")) { cli->print_token = 1; continue; }
    if (!strcmp(a, "--json")) { cli->as_json = 1; continue; }
    if (!strcmp(a, "--standby")) { cli->cfg.standby = 1; continue; }
    const int_flag *fi = NULL;
    const str_flag *fs = NULL;
    for (size_t k = 0; k < sizeof k_int_flags / sizeof *k_int_flags; k++)
      if (!strcmp(a, k_int_flags[k].name)) fi = &k_int_flags[k];
    for (size_t k = 0; k < sizeof k_str_flags / sizeof *k_str_flags; k++)
      if (!strcmp(a, k_str_flags[k].name)) fs = &k_str_flags[k];
    if (!fi && !fs && strcmp(a, "--token") && strcmp(a, "--seed")) {
      fprintf(stderr, "ripples-coordinator: unknown argument '%s'\n", a);
      rpl_coord_cli_usage(stderr);
      return 2;
    }
    if (!v) {
      fprintf(stderr, "ripples-coordinator: %s needs a value\n", a);
      return 2;
    }
    i++;
    if (fi) {
      if (parse_int(v, a, fi->lo, fi->hi, (int *)((char *)cli + fi->offset))) return 2;
    } else if (fs) {
      *(const char **)((char *)cli + fs->offset) = v;
      if (!strcmp(a, "--policy"))
        fprintf(stderr, "ripples-coordinator: warning: --policy is deprecated; use --schedule "
                        "(the Options name)\n");
    } else if (!strcmp(a, "--seed")) {
      cli->cfg.gg.seed = strtoull(v, NULL, 0);
    } else { /* --token */
      cli->token = v;
      cli->token_from = "from --token";
      fprintf(stderr, "ripples-coordinator: warning: --token puts the job token in the command "
                      "line, which other users of this host can read (ps); prefer "
                      "--token-file FILE or $RIPPLES_COORDINATOR_TOKEN\n");
    }
  }
  if (cli->token_file) {
    if (read_token_file(cli->token_file, cli->token_buf, sizeof cli->token_buf) != 0) {
      fprintf(stderr, "ripples-coordinator: cannot read token file '%s'\n", cli->token_file);
      return 2;
    }
    cli->token = cli->token_buf;
    cli->token_from = "read from the token file";
  }
  return -1;
}

/* --hosts: exactly `workers` comma-separated integers into labels. */
static int parse_hosts(const char *hosts, int workers, int *labels) {
  const char *p = hosts;
  for (int r = 0; r < workers; r++) {
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || (*end != ',' && *end != '\0') || (*end == '\0' && r != workers - 1)) {
      fprintf(stderr, "ripples-coordinator: --hosts needs %d comma-separated integers\n",
              workers);
      return -1;
    }
    labels[r] = (int)v;
    p = *end ? end + 1 : end;
  }
  if (*p) {
    fprintf(stderr, "ripples-coordinator: --hosts has more than %d labels\n", workers);
    return -1;
  }
  return 0;
}

int rpl_coord_cli_config(rpl_coord_cli *cli, int **labels) {
  *labels = NULL;
  int workers = cli->cfg.gg.nworkers;
  if (workers < 1) {
    fprintf(stderr, "ripples-coordinator: --workers N is required\n");
    rpl_coord_cli_usage(stderr);
    return 2;
  }
  if (!cli->token && !cli->write_token && !cli->print_token) {
    fprintf(stderr, "ripples-coordinator: a new job token must reach the workers: pass "
                    "--write-token FILE (created 0600) or --print-token, or give one with "
                    "--token-file / $RIPPLES_COORDINATOR_TOKEN\n");
    return 2;
  }
  rpl_error err;
  if (rpl_policy_parse(cli->policy, &cli->cfg.gg.policy, &err) != RPL_OK) {
    fprintf(stderr, "ripples-coordinator: %s\n", err.msg);
    return 2;
  }
  int *l = malloc(sizeof(int) * (size_t)workers);
  if (!l) return 1;
  for (int r = 0; r < workers; r++) l[r] = cli->per_host ? r / cli->per_host : 0;
  if (cli->hosts && parse_hosts(cli->hosts, workers, l) != 0) {
    free(l);
    return 2;
  }
  cli->cfg.token_hex = cli->token;
  cli->cfg.gg.host_of = l;
  *labels = l;
  return -1;
}

/* --status: the table of a running coordinator's workers, or its document with --json. */
static int print_status(const rpl_coord_cli *cli) {
  if (!cli->token) {
    fprintf(stderr, "ripples-coordinator: --status needs the job token (--token, "
                    "--token-file or $RIPPLES_COORDINATOR_TOKEN)\n");
    return 2;
  }
  rpl_error err;
  char *json = NULL;
  if (rpl_gg_query_status(cli->status, cli->token, cli->timeout_ms, &json, &err) != RPL_OK) {
    fprintf(stderr, "ripples-coordinator: %s\n", err.msg);
    return 1;
  }
  if (cli->as_json) {
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

/* Serves until SIGINT/SIGTERM. */
static int serve(rpl_coord_cli *cli) {
  int *labels;
  int rc = rpl_coord_cli_config(cli, &labels);
  if (rc >= 0) return rc;
  rpl_error err;
  rpl_coord *c;
  if (rpl_coord_create(&cli->cfg, &c, &err) != RPL_OK) {
    fprintf(stderr, "ripples-coordinator: %s\n", err.msg);
    free(labels);
    return 1;
  }
  free(labels);
  g_coord = c;
  struct sigaction sa, old_int, old_term;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  rpl_status st = RPL_OK;
  const char *write_token = cli->write_token;
  if (write_token && write_token_file(write_token, rpl_coord_token(c)) != 0) {
    fprintf(stderr, "ripples-coordinator: cannot write token file '%s': %s\n", write_token,
            strerror(errno));
    rc = 1;
    goto out;
  }
  if (cli->print_token)
    printf("ripples-coordinator: %s for %d workers at %s token %s%s\n", cli->policy,
           cli->cfg.gg.nworkers, rpl_coord_endpoint(c), rpl_coord_token(c),
           cli->cfg.standby ? " (standby)" : "");
  else
    printf("ripples-coordinator: %s for %d workers at %s token %s%s%s%s\n", cli->policy,
           cli->cfg.gg.nworkers, rpl_coord_endpoint(c),
           cli->token_from ? cli->token_from : "generated", write_token ? ", written to " : "",
           write_token ? write_token : "", cli->cfg.standby ? " (standby)" : "");
  fflush(stdout);
  if (!strncmp(rpl_coord_endpoint(c), "tcp://127.", 10) ||
      !strncmp(rpl_coord_endpoint(c), "tcp://[::1]", 11))
    fprintf(stderr, "ripples-coordinator: listening on loopback only; a multi-host job must "
                    "pass --bind tcp://<interface-ip>:29600 (the address its workers reach)\n");
  st = rpl_coord_run(c, &err);
  if (st != RPL_OK) fprintf(stderr, "ripples-coordinator: %s\n", err.msg);
  rc = st == RPL_OK ? 0 : 1;
out:
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  g_coord = NULL;
  rpl_coord_destroy(c);
  return rc;
}

int rpl_coord_cli_main(int argc, char **argv) {
  rpl_coord_cli cli;
  int rc = rpl_coord_cli_parse(argc, argv, &cli);
  if (rc < 0) rc = cli.status ? print_status(&cli) : serve(&cli);
  /* The Python entry point shares this process's stdio with Python's own buffers. */
  fflush(stdout);
  fflush(stderr);
  return rc;
}
