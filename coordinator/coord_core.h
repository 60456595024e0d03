/* The coordinator's I/O-free core: what the ZeroMQ loop (coord_service.c) and the fuzz target
 * share. It owns the policy state and per-worker routing; replies go out through a callback. */
#ifndef RPL_COORD_CORE_H
#define RPL_COORD_CORE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "coord_straggler.h"
#include "rpl_coord.h"

#define RPL_ROUTE_MAX 255

/* Wrong-token messages answered per second at most (the rest are only counted): a stranger
 * cannot make the coordinator spend more than this on it, whatever it sends. */
#define COORD_BAD_TOKEN_REPLIES_PER_S 10
/* Status bytes (documents and rank summaries) answered per second, beyond the first answer of
 * each second: a recorded STATUS query replayed in a loop cannot make the coordinator's thread
 * build documents back to back (15.7 MB and 120 ms each at 65,536 workers). */
#define COORD_STATUS_BYTES_PER_S (32u << 20)

/* A session's opening (PROTOCOL.md, "Sessions"): the coordinator's nonce in a CHALLENGE is
 * a cookie -- the time it was issued and a MAC of it under the instance's secret -- so a
 * replayed opening costs a reply and no state. The answer must come within this many ms. A
 * worker's session is opened only by an answer to a challenge issued after the last one its
 * rank answered, and a status query's answer is taken once (COORD_STATUS_USED answers per
 * COORD_CHALLENGE_MS at most: more are told to ask again), so no answer can be replayed. */
#define COORD_CHALLENGE_MS 10000
#define COORD_STATUS_USED 4096
/* ERROR(NOT_REGISTERED) to a rank that holds no session here (we cannot check its MAC, so
 * the answer is MACed with the token): at most one per rank every this many ms. */
#define COORD_NOT_REGISTERED_MS 200

/* Sends `len` bytes to the peer named by route (a zmq routing id). Returns 0 on success,
 * COORD_SEND_GONE if no peer of that route is connected, -1 on another failure. */
#define COORD_SEND_GONE 1
typedef int (*coord_send_fn)(void *ctx, const uint8_t *route, size_t route_len,
                             const void *msg, size_t len);

/* A worker's binding (PROTOCOL.md, "Connections"): a session's opening ties rank r to the
 * route it came from and to the session's key; only that route speaks for r (heartbeats, MACed
 * with the key, from any route) until the binding is given up (dead, left, or silent for
 * COORD_REBIND_BEATS heartbeat intervals). */
#define COORD_REBIND_BEATS 2
/* Probes (see may_rebind in coord_core.c) a worker's bound connection may hold unread: a
 * client reads that connection only while it waits for a reply, so each foreign HELLO's probe
 * would otherwise queue there until the queue is full and the worker's next GROUP is lost. */
#define COORD_MAX_PROBES 4

typedef struct coord_worker {
  uint8_t route[RPL_ROUTE_MAX]; /* the bound route: where its replies go */
  uint8_t route_len;            /* 0 = not bound (no session here) */
  uint8_t key[RPL_TOKEN_LEN];   /* the session's key (valid while bound) */
  uint64_t opened_tick;         /* issue tick of the challenge its last verified opening answered */
  double not_registered_at;     /* when it was last told NOT_REGISTERED */
  uint32_t req_seq;             /* sequence number of its outstanding request */
  uint32_t last_seq[2];         /* last accepted seq: [0] bound route, [1] heartbeats */
  uint8_t seq_valid[2];
  uint8_t unreachable;          /* a reply to the bound route failed: that peer is gone */
  uint8_t probes;               /* probes sent to the bound route since it last spoke */
  uint8_t *unsent;              /* the answer to its request that its queue refused (malloc'd,
                                   sent again at each tick until it goes), or NULL */
  size_t unsent_len;
  int32_t host_label;
  int seen;                     /* has sent anything valid */
  int hello;                    /* has registered (HELLO) with this instance */
  double last_seen;             /* last accepted message from the bound routes */
} coord_worker;

typedef struct coord_core {
  rpl_gg *gg;
  int nworkers;
  uint8_t token[RPL_TOKEN_LEN];
  char token_hex[2 * RPL_TOKEN_LEN + 1];
  uint8_t secret[32];           /* this instance's, for its challenges' cookies; never sent */
  uint64_t last_tick;           /* the last challenge's issue tick (ms; strictly rising) */
  uint64_t status_used[COORD_STATUS_USED]; /* issue ticks of status challenges answered */
  int status_used_next;
  uint32_t heartbeat_ms, dead_ms;
  int join_ms;
  int standby;                  /* started as a failover coordinator (rpl_coord_config) */
  double start;
  coord_worker *w;
  uint8_t *out;                 /* encode buffer */
  size_t out_cap;
  int *members;                 /* [nworkers] */
  coord_send_fn send;
  void *send_ctx;
  atomic_ullong messages, malformed, bad_token, errors_sent, dead_declared, send_failures;
  atomic_ullong wrong_route, replayed, rebinds, bad_token_quiet, probes_withheld;
  atomic_ullong challenges, bad_session;
  atomic_ullong connections_dropped; /* by the service's cap (coord_service.c) */
  double bad_token_window;      /* start of the second bad_token_replies counts in */
  int bad_token_replies;
  double status_window;         /* start of the second status_bytes counts in */
  size_t status_bytes;          /* status answered in it (bytes), and how many answers */
  int status_answers;
  atomic_uchar *gone;           /* [nworkers]: left or dead, readable from other threads */
  coord_straggler attr;         /* straggler attribution (coord_straggler.h) */
} coord_core;

rpl_status coord_core_init(coord_core *core, const rpl_coord_config *cfg, rpl_error *err);
void coord_core_free(coord_core *core);
/* Handles one received message (payload of one frame from `route`) at time `now` (seconds).
 * Returns 1 when its sender proved it holds the token (or its session's key), else 0. */
int coord_core_handle(coord_core *core, const uint8_t *route, size_t route_len,
                      const void *msg, size_t len, double now);
/* Moves the policy's clock to `now` (ending waits for partners that are over) and sends what
 * that decided. Returns when the next wait ends (same clock as now), or < 0 if none. */
double coord_core_advance(coord_core *core, double now);
/* Declares dead the workers silent for too long. */
void coord_core_tick(coord_core *core, double now);
/* Workers neither left nor dead, not counting `except_rank` (-1: count all). Any thread. */
int coord_core_active(const coord_core *core, int except_rank);
/* The status document (malloc'd JSON, caller frees), or NULL when out of memory. At most
 * COORD_STATUS_LIMIT bytes plus one pending group: workers and pending groups past it are
 * left out and counted ("workers_omitted", "pending_omitted"). */
#define COORD_STATUS_LIMIT (RPL_PROTO_MAX_BODY - (1u << 20))
char *coord_core_status_json(coord_core *core, double now, size_t *len);
/* The summary for rank `rank` (a STATUS with rank >= 0): its attribution and the slowest
 * ranks', a few hundred bytes whatever the job's size. */
char *coord_core_rank_json(coord_core *core, int rank, double now, size_t *len);

#endif
