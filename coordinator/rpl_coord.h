/*
 * rpl_coord.h - the Group Generator service: a ZeroMQ ROUTER that runs a dynamic policy
 * (csrc/sched) for one job. Runs embedded (a thread started by rank 0, rpl_coord_start) or
 * standalone (rpl_coord_run in the ripples-coordinator binary). Protocol: PROTOCOL.md.
 */
#ifndef RPL_COORD_H
#define RPL_COORD_H

#include <stdint.h>

#include "rpl_sched.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rpl_coord_config {
  const char *bind;        /* zmq endpoint; NULL = "tcp://127.0.0.1:*" (a free port). Bind the
                              address the job advertises, not every interface (PROTOCOL.md) */
  const char *token_hex;   /* the job token; NULL = generate one (rpl_coord_token) */
  rpl_gg_config gg;        /* policy and its knobs (the trace hook is ignored) */
  int heartbeat_ms;        /* period asked of clients; 0 = 1000; else within
                            * [RPL_HEARTBEAT_MIN_MS, RPL_HEARTBEAT_MAX_MS] (rpl_sched_proto.h) */
  int dead_ms;             /* a worker silent this long is dead; 0 = 10 * heartbeat_ms; else at
                            * least RPL_DEAD_MIN_BEATS heartbeat intervals */
  int join_ms;             /* a worker never heard from within this is dead; 0 = 120000,
                              negative = wait for ever */
  int standby;             /* a failover coordinator: every worker starts out dead (in no
                              group, not waited for) until it registers with HELLO */
  const char *const *host_names; /* optional: the host name of every rank (copied), shown by
                              the status and the slow-worker lines; NULL = the host labels */
  /* Where the coordinator's few log lines go (a worker becoming persistently slow or
   * recovering, coordinator/coord_straggler.h): each call is one line ending in '\n', from the
   * service's thread. NULL = stderr. Must not call back into the coordinator. */
  void (*log)(void *ctx, const char *line);
  void *log_ctx;
} rpl_coord_config;

typedef struct rpl_coord rpl_coord;

/* Creates the service and binds its socket, so rpl_coord_endpoint is known at once. */
rpl_status rpl_coord_create(const rpl_coord_config *cfg, rpl_coord **out, rpl_error *err);
/* Serves on a new thread ("rpl-gg-coord") until rpl_coord_stop. */
rpl_status rpl_coord_start(rpl_coord *c, rpl_error *err);
/* Serves on the calling thread until rpl_coord_stop (from another thread or a signal
 * handler: it only sets a flag). */
rpl_status rpl_coord_run(rpl_coord *c, rpl_error *err);
/* Asks the service to stop; joins the thread if rpl_coord_start made one. Idempotent. */
void rpl_coord_stop(rpl_coord *c);
/* Stops if needed and frees everything. */
void rpl_coord_destroy(rpl_coord *c);

/* The endpoint clients connect to (the bound one, with the port resolved). */
const char *rpl_coord_endpoint(const rpl_coord *c);
/* The job token as 32 hex digits. */
const char *rpl_coord_token(const rpl_coord *c);

/* How many workers have neither left nor been declared dead, not counting `except_rank`
 * (-1: count all). Readable from any thread while the service runs: an embedding process
 * waits on it before it stops the service, so that workers still training keep their
 * coordinator. */
int rpl_coord_active_workers(const rpl_coord *c, int except_rank);

typedef struct rpl_coord_counters {
  uint64_t messages;       /* received, valid or not */
  uint64_t malformed;      /* dropped: failed parsing, wrong framing, unexpected type */
  uint64_t bad_token;      /* rejected: wrong job token */
  uint64_t errors_sent;    /* ERROR replies */
  uint64_t dead_declared;  /* workers declared dead (missed heartbeats or never joined) */
  uint64_t send_failures;  /* replies a peer was no longer there to take */
  uint64_t wrong_route;    /* refused: a rank's message from a connection it is not bound to */
  uint64_t replayed;       /* dropped: seq not above the last accepted one of that session, or
                              an answer to a challenge taken already */
  uint64_t rebinds;        /* a rank bound to a new connection (failover, restart) */
  uint64_t probes_withheld; /* foreign HELLOs refused without probing the live connection
                              (COORD_MAX_PROBES unread probes there already) */
  uint64_t bad_token_quiet;/* wrong-token messages left unanswered (reply rate limit) */
  uint64_t challenges;     /* CHALLENGEs sent: openings of sessions and status queries */
  uint64_t bad_session;    /* dropped: an answer to a challenge that is not ours, too old, or
                              fails its MAC; or a message failing its rank's session key */
  uint64_t connections_dropped; /* connections closed by the cap on connections, oldest
                              of those that never proved the token first */
} rpl_coord_counters;

/* Readable from any thread while the service runs. */
void rpl_coord_get_counters(const rpl_coord *c, rpl_coord_counters *out);

/* The status document (JSON text, as rpl_gg_query_status returns it) as the table that
 * `ripples-coordinator --status` prints: one row per worker (rank, host, state, steps/s, step,
 * slowdown, groups of one, last seen). Fills *out (malloc'd, NUL-terminated, caller frees);
 * RPL_ERR_INVALID if the text is not a status document. coordinator/status_table.c. */
rpl_status rpl_coord_status_table(const char *json, size_t len, char **out, rpl_error *err);

#ifdef __cplusplus
}
#endif

#endif
