/*
 * rpl_coord_cli.h - the ripples-coordinator command line, defined once: its flags, defaults,
 * help text and messages. The binary (coordinator/main.c) and `python -m
 * ripples_pg.coordinator` (through ripples_pg._C) both run rpl_coord_cli_main.
 *
 *   ripples-coordinator --bind tcp://10.0.0.5:29600 --workers 16 --per-host 4 \
 *                       --write-token ~/.ripples-token
 *   RIPPLES_COORDINATOR_TOKEN=$(cat ~/.ripples-token) ripples-coordinator --status tcp://10.0.0.5:29600
 *
 * Messages go to stderr, prefixed "ripples-coordinator: "; results (the serving line, the
 * status) to stdout. Exit status: 0 done, 1 the service or the query failed, 2 bad usage.
 */
#ifndef RPL_COORD_CLI_H
#define RPL_COORD_CLI_H

#include <stdio.h>

#include "rpl_coord.h"

#ifdef __cplusplus
extern "C" {
#endif

#define RPL_COORD_CLI_DEFAULT_BIND "tcp://127.0.0.1:29600"

/* What the flags asked for. Strings point into argv, the environment or token_buf: the
 * struct must not outlive argv nor be copied while token points into token_buf. */
typedef struct rpl_coord_cli {
  const char *status;     /* --status ENDPOINT: query a running coordinator instead of serving */
  int as_json;            /* --json: the status document rather than the table */
  int timeout_ms;         /* --timeout-ms: the status query's reply timeout */
  const char *token;      /* --token, --token-file, else $RIPPLES_COORDINATOR_TOKEN
                             (or the old $RIPPLES_GG_TOKEN); NULL = generate */
  const char *token_from; /* where token came from, for the serving line */
  const char *token_file; /* --token-file PATH (read into token_buf) */
  const char *write_token;/* --write-token PATH */
  int print_token;        /* --print-token */
  const char *policy;     /* --policy (parsed into cfg.gg.policy by rpl_coord_cli_config) */
  const char *hosts;      /* --hosts LABEL,... (wins over --per-host) */
  int per_host;           /* --per-host L */
  rpl_coord_config cfg;   /* every other flag, as rpl_coord_create takes it */
  char token_buf[128];    /* --token-file's contents */
} rpl_coord_cli;

/* Writes the help text to f. */
void rpl_coord_cli_usage(FILE *f);

/* Parses argv[1..argc-1] into *cli (defaults first) and reads --token-file. Returns -1 to go
 * on, else the exit status to end with: 0 after --help (usage on stdout), 2 after a bad flag
 * (its message on stderr). */
int rpl_coord_cli_parse(int argc, char *const *argv, rpl_coord_cli *cli);

/* Completes cli->cfg for serving: checks --workers and that a new token reaches the workers,
 * parses the policy and sets cfg.gg.host_of to *labels (malloc'd, the caller frees; NULL on
 * failure). Returns -1 to go on, else the exit status (2, its message on stderr). */
int rpl_coord_cli_config(rpl_coord_cli *cli, int **labels);

/* The whole command: parses argv, then prints the status of a running coordinator or serves
 * until SIGINT/SIGTERM (handlers installed for the run, the previous ones restored after).
 * Returns the exit status; stdout and stderr are flushed. Blocks: call it without any lock
 * a signal would need. */
int rpl_coord_cli_main(int argc, char **argv);

#ifdef __cplusplus
}
#endif

#endif
