/*
 * ripples.h - the one public header of the ripples C core.
 *
 * The core knows nothing about torch. A caller (the C++ shim in shim/, or a C test)
 * creates one communicator per process group, hands it plain (pointer, count, dtype) buffers
 * and gets a completion callback per operation.
 *
 * Threads: every communicator owns one progress thread ("rpl-prog") that executes its
 * collectives one at a time, in the order they were submitted, driving shared-memory rings
 * and non-blocking sockets. Consecutive send/recv operations progress together (as gloo's
 * do: a recv posted before the matching send on both sides completes), and a collective
 * starts once every earlier send/recv has completed. A small collective may instead run on
 * the caller's thread when nothing else is queued (rpl_submit_inline, the latency path).
 * Completion callbacks run on that thread: they must return quickly and must not submit
 * or wait on operations of the same communicator (hand the completion to another thread).
 *
 * Errors: every function returns an rpl_status and, on failure, fills the caller's
 * rpl_error with a message that names the cause. After a communication error (timeout,
 * dead peer, size mismatch detected on the wire) a communicator is "broken": its sockets are
 * closed so that peers fail fast too, and every later operation fails with RPL_ERR_ABORTED
 * quoting the first error.
 */
#ifndef RIPPLES_H
#define RIPPLES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RPL_VERSION_MAJOR 0
#define RPL_VERSION_MINOR 1

typedef enum {
  RPL_OK = 0,
  RPL_ERR_INVALID = 1,     /* bad argument: shapes, ranks, roots, counts */
  RPL_ERR_UNSUPPORTED = 2, /* dtype/op combination the core does not reduce */
  RPL_ERR_MISMATCH = 3,    /* peers disagree on the operation (sizes, dtypes, kind) */
  RPL_ERR_TIMEOUT = 4,     /* an operation exceeded the communicator's timeout */
  RPL_ERR_PEER = 5,        /* a peer closed its connection or could not be reached */
  RPL_ERR_SYSTEM = 6,      /* an OS call failed (errno text in the message) */
  RPL_ERR_CLOSED = 7,      /* the communicator was shut down */
  RPL_ERR_ABORTED = 8,     /* the communicator is broken by an earlier error */
  RPL_ERR_NOMEM = 9
} rpl_status;

#define RPL_ERRMSG_LEN 512
typedef struct rpl_error {
  rpl_status code;
  char msg[RPL_ERRMSG_LEN];
} rpl_error;

/* Element types; values are stable (they go on the wire). */
typedef enum {
  RPL_BOOL = 0,
  RPL_UINT8 = 1,
  RPL_INT8 = 2,
  RPL_INT16 = 3,
  RPL_INT32 = 4,
  RPL_INT64 = 5,
  RPL_FLOAT16 = 6,
  RPL_BFLOAT16 = 7,
  RPL_FLOAT32 = 8,
  RPL_FLOAT64 = 9,
  RPL_DTYPE_COUNT = 10
} rpl_dtype;

/* Reduction operators. AVG is SUM followed by a division by the number of contributors;
 * it is defined for floating dtypes only. BAND/BOR/BXOR are defined for integers and bool. */
typedef enum {
  RPL_SUM = 0,
  RPL_AVG = 1,
  RPL_PRODUCT = 2,
  RPL_MIN = 3,
  RPL_MAX = 4,
  RPL_BAND = 5,
  RPL_BOR = 6,
  RPL_BXOR = 7,
  RPL_REDOP_COUNT = 8
} rpl_redop;

size_t rpl_dtype_size(rpl_dtype dtype);           /* 0 for an unknown dtype */
const char *rpl_dtype_name(rpl_dtype dtype);      /* "float32", ...; "?" if unknown */
const char *rpl_redop_name(rpl_redop op);         /* "SUM", ... */
const char *rpl_status_name(rpl_status status);   /* "RPL_ERR_TIMEOUT", ... */
int rpl_dtype_is_floating(rpl_dtype dtype);
int rpl_has_ucx(void); /* 1 if this build can use UCX (rpl_comm_config.use_ucx) */

/* RPL_OK if `op` can reduce `dtype` (err untouched), else RPL_ERR_UNSUPPORTED with a message. */
rpl_status rpl_reduce_check(rpl_dtype dtype, rpl_redop op, rpl_error *err);

/* ---- Key-value store, provided by the caller (the c10d store in the shim) ---------------- */

typedef struct rpl_store {
  void *ctx;
  /* Publish `len` bytes under `key`. */
  rpl_status (*set)(void *ctx, const char *key, const void *val, size_t len, rpl_error *err);
  /* Block until `key` exists (or the store's own timeout), then copy at most `cap` bytes into
   * `buf` and set *len to the value's full length. */
  rpl_status (*get)(void *ctx, const char *key, void *buf, size_t cap, size_t *len,
                    rpl_error *err);
} rpl_store;

/* ---- Communicator -------------------------------------------------------------------------- */

typedef struct rpl_comm_config {
  int rank;                /* 0 <= rank < size */
  int size;                /* >= 1 */
  double timeout_s;        /* per operation, from the moment it starts executing; > 0 */
  const char *bind_addr;   /* IPv4 address peers use to reach us; NULL means "127.0.0.1" */
  const char *name;        /* short label used in thread names and messages; may be NULL */
  size_t small_bytes;      /* latency-optimised algorithms at or below this; 0 = default */
  size_t chunk_bytes;      /* pipeline chunk for large broadcasts; 0 = default */
  const char *host_key;    /* ranks with equal keys talk through shared memory; NULL = this
                            * machine's hostname and boot id */
  int tcp_only;            /* never use shared memory */
  int use_ucx;             /* reach peers not on shared memory through UCX instead of TCP
                            * (fails if this build has no UCX: rpl_has_ucx) */
  size_t ring_bytes;       /* shared-memory ring per peer pair; 0 = default (1 MiB) */
  size_t single_copy_bytes; /* all-reduce buffers of at least this many bytes, over ranks of
                             * one host, are read straight from the peers' memory (cross-
                             * memory attach) where the OS allows; 0 = never (the rings,
                             * which measured faster: see docs/limitations.md) */
  const char *job_secret;  /* keys the links' authentication together with a salt read from
                            * the store; NULL or "" = the salt alone, so that whoever can read
                            * the store can also authenticate (docs/security.md). Every rank
                            * of the communicator must pass the same one. */
  int frame_macs;          /* authenticate every data frame on TCP links: a 16-byte MAC per
                            * frame, keyed per connection from the link key, checked before
                            * the operation completes (docs/security.md gives its cost).
                            * Shared-memory rings need none (same user); refused with
                            * use_ucx. Every rank must pass the same value. */
} rpl_comm_config;

typedef struct rpl_comm rpl_comm;

/* Publishes this rank's address in `store` and reads every peer's address (so it returns only
 * once every rank of the group has called it). Ranks on the same host map each other's
 * shared-memory rings here; TCP connections are made lazily, on first use. The store is used
 * only during this call. */
rpl_status rpl_comm_create(const rpl_comm_config *cfg, const rpl_store *store, rpl_comm **out,
                           rpl_error *err);

/* Stops accepting operations; operations still queued complete with RPL_ERR_CLOSED, and the
 * executing operation is interrupted and fails with RPL_ERR_CLOSED. Joins the progress
 * thread. Idempotent. */
void rpl_comm_shutdown(rpl_comm *comm);

/* Waits, at most max_s seconds, until no partial round is queued or running (the others
 * stay queued), and returns whether none is. A graceful shutdown calls it first: a round in
 * flight at the end of training (an overlapped one, wrap()'s default) has members exchanging
 * with this worker, and interrupting it would fail the round on all of them. Returns at once
 * once the communicator is shut down or broken. Safe from any thread. */
int rpl_comm_settle_partial(rpl_comm *comm, double max_s);

/* Shuts down if needed and frees everything. */
void rpl_comm_destroy(rpl_comm *comm);

int rpl_comm_rank(const rpl_comm *comm);
int rpl_comm_size(const rpl_comm *comm);

/* ---- Operations ---------------------------------------------------------------------------- */

typedef enum {
  RPL_OP_ALLREDUCE = 1,      /* in[i] reduced in place, i < nin (several buffers = coalesced) */
  RPL_OP_BROADCAST = 2,      /* in[i] in place from root, i < nin */
  RPL_OP_ALLGATHER = 3,      /* in[0] -> out[r] for every rank r (nout == size) */
  RPL_OP_REDUCE_SCATTER = 4, /* in[r] (nin == size, all the count of out[0]) -> out[0] */
  RPL_OP_ALLTOALL = 5,       /* in[r] -> peer r's out[me]; nin == nout == size; counts may differ */
  RPL_OP_GATHER = 6,         /* in[0] -> root's out[r] (nout == size at root, 0 elsewhere) */
  RPL_OP_SCATTER = 7,        /* root's in[r] (nin == size at root) -> out[0] */
  RPL_OP_REDUCE = 8,         /* in[0] reduced into root's in[0]; non-root buffers untouched */
  RPL_OP_BARRIER = 9,        /* no buffers */
  RPL_OP_SEND = 10,          /* in[0] to rank `root`, matched by `tag` */
  RPL_OP_RECV = 11,          /* out[0] from rank `root` (or RPL_ANY_SOURCE), matched by `tag` */
  RPL_OP_PARTIAL_ALLREDUCE = 12 /* in[i] reduced over this round's group only (see below) */
} rpl_op_kind;

const char *rpl_op_name(rpl_op_kind kind);

/* RECV's root for "whichever rank sends a message with this tag first" (gloo's
 * recvAnysource): the sender's rank is written to *desc.source before on_done. */
#define RPL_ANY_SOURCE (-1)

typedef struct rpl_buf {
  void *ptr;       /* contiguous; may be NULL when count == 0 */
  size_t count;    /* elements */
  rpl_dtype dtype;
} rpl_buf;

/* Called exactly once per accepted operation, on the progress thread. `err` is NULL on
 * success. See the threading note at the top. */
typedef void (*rpl_done_fn)(void *arg, rpl_status status, const rpl_error *err);

typedef struct rpl_op_desc {
  rpl_op_kind kind;
  rpl_redop redop;         /* ALLREDUCE, REDUCE_SCATTER, REDUCE */
  int root;                /* BROADCAST, GATHER, SCATTER, REDUCE; the peer for SEND/RECV */
  int tag;                 /* SEND/RECV */
  const rpl_buf *in;
  int nin;
  const rpl_buf *out;
  int nout;
  rpl_done_fn on_done;
  void *done_arg;
  double timeout_s;        /* 0 = the communicator's timeout */
  int *source;             /* RECV, optional: the sender's rank, written before on_done */
} rpl_op_desc;

/* Validates and enqueues. The descriptor is copied; the memory its buffers point at must stay
 * valid and untouched until on_done runs. On a non-OK return nothing was enqueued and on_done
 * will not be called. */
rpl_status rpl_submit(rpl_comm *comm, const rpl_op_desc *desc, rpl_error *err);

/* rpl_submit with the latency path: a small exact collective (at most small_bytes of buffers;
 * not a send, recv or partial round) runs on the calling thread if the communicator is idle
 * (nothing queued or running), sparing the hand-offs to and from the progress thread. Then
 * *ran = 1 and on_done has been called, on this thread, before the return. Otherwise *ran = 0
 * and the operation was queued as by rpl_submit. Returns, and validates, as rpl_submit. An
 * operation run here blocks until the peers join, so callers that overlap small collectives
 * with other work should use rpl_submit. */
rpl_status rpl_submit_inline(rpl_comm *comm, const rpl_op_desc *desc, int *ran,
                             rpl_error *err);

/* Counters for stats and tests, one table: X(name, what it counts). From it come the structs
 * (rpl_comm_counters here, rpl_tr_counters in transport.h), their copies, and the keys and
 * docs of ripples_pg.stats() (shim/module.cpp; docs/stats.md is generated from them).
 * All uint64_t, read without stopping the progress thread. The transport's come after the
 * engine's own. */
#define RPL_TR_COUNTERS(X)                                                                   \
  X(bytes_sent, "bytes this rank sent, all operations")                                      \
  X(bytes_received, "bytes this rank received, all operations")                              \
  X(connections, "links opened to peers (TCP or UCX; shared-memory rings are not counted)")  \
  X(ucx_connections, "of connections, UCX endpoints (transport 'ucx')")                      \
  X(single_copy_bytes, "of bytes_received, read straight from local peers' memory")          \
  X(auth_failures, "link handshakes that failed their proof (docs/security.md)")             \
  X(handshakes_dropped, "connections dropped before authenticating: deadline, full")        \
  X(replacements_refused, "authenticated newcomers refused: the link they would replace "    \
                          "was healthy")                                                     \
  X(stash_holds, "times a peer's link was held back for want of stash room")                 \
  X(shm_rebuilt, "shared-memory ring pairs rebuilt after a failed exchange broke them")

#define RPL_COMM_COUNTERS(X)                                                                 \
  X(ops_completed, "operations that completed")                                              \
  X(ops_failed, "operations that failed")                                                    \
  RPL_TR_COUNTERS(X)

#define RPL_COUNTER_FIELD_(name, doc) uint64_t name;
typedef struct rpl_comm_counters {
  RPL_COMM_COUNTERS(RPL_COUNTER_FIELD_)
} rpl_comm_counters;

void rpl_comm_get_counters(const rpl_comm *comm, rpl_comm_counters *out);

/* What carries this rank's traffic with group rank `peer` now: "self", "shm",
 * "shm+single-copy", "shm-resuming" (a ring pair broken by a failed exchange, rebuilt on its
 * next use), "closed" (a same-host peer that left), "dead" (a same-host peer whose process is
 * gone), "tcp" or "ucx" (connected on first use);
 * NULL for a rank outside the group. A static string; read without stopping the progress
 * thread. */
const char *rpl_comm_peer_path(const rpl_comm *comm, int peer);

/* "ADDR:PORT" of this rank's listener, the one peers connect to (for firewall rules and
 * tests). */
void rpl_comm_listen_address(const rpl_comm *comm, char *buf, size_t cap);

/* ---- Partial all-reduce (P-Reduce) ---------------------------------------------------------
 *
 * An RPL_OP_PARTIAL_ALLREDUCE is one *round*: the group generator places this rank in a group
 * G (sorted member ranks, the same on every member), and its buffers are reduced over G only:
 * AVG gives the mean over G, SUM gives (size/|G|) * the sum over G (the unbiased estimate of
 * the global sum, so callers that pre-divide by the world size get the group mean). A group of
 * one moves no data (AVG leaves the buffers as they are; SUM still applies its scaling).
 * Other ops, and any non-floating buffer, make the call an exact all-reduce instead (the same
 * decision on every rank, since every rank passes the same dtypes).
 *
 * Members first exchange a signature (buffer count, sizes, dtypes); if it differs, every
 * member fails with the same RPL_ERR_MISMATCH before any data moves. The reduction runs in
 * scratch memory and is written back only once complete: a failed round leaves the buffers
 * untouched (atomic). Rounds run in the order the group generator produced them.
 *
 * Schedules: "static" computes groups locally (no coordinator); "random", "smart", "adpsgd"
 * ask the coordinator at `endpoint`. With a coordinator, exact collectives on this
 * communicator fence it first (the coordinator then leaves it out of new groups) and unfence
 * it as soon as no exact collective of the process runs any more (it is back in at once, not
 * at its next partial round); shutdown tells the coordinator it left. */

typedef enum { RPL_ON_FAILURE_RAISE = 0, RPL_ON_FAILURE_SKIP = 1 } rpl_on_failure;

/* The communicators of one process that must fence each other: a worker blocked in an exact
 * collective on *any* of them cannot serve a group the coordinator forms for another, so an
 * exact collective on one fences every dynamic schedule in the domain (each once, until the
 * last exact collective of the domain ends). Create one per process; destroy it after its communicators. */
typedef struct rpl_domain rpl_domain;
rpl_status rpl_domain_create(rpl_domain **out, rpl_error *err);
void rpl_domain_destroy(rpl_domain *domain);

/* Compressed partial rounds (docs/compression.md): a round whose buffers are all float32 and
 * whose group spans more than one host (by host_of) sends its data quantised, with error
 * feedback; the reduction stays in float32. Values stable (they go into the signature). */
typedef enum {
  RPL_COMPRESS_NONE = 0,
  RPL_COMPRESS_BF16 = 1,
  RPL_COMPRESS_FP16 = 2,
  RPL_COMPRESS_INT8 = 3, /* blockwise absmax, one float32 scale per 128 elements */
  RPL_COMPRESS_COUNT = 4
} rpl_compress;
const char *rpl_compress_name(rpl_compress mode); /* "none", "bf16", "fp16", "int8"; "?" */

typedef struct rpl_partial_config {
  const char *schedule;      /* "static", "random", "smart" or "adpsgd" */
  const int *host_of;        /* host label of every rank (size entries); NULL = one host */
  const char *endpoint;      /* the coordinator, for every schedule but "static" */
  const char *token_hex;     /* the job's coordinator token */
  double timeout_s;          /* deadline of one round; 0 = the communicator's timeout */
  rpl_on_failure on_failure; /* SKIP: a failed round leaves the buffers, counts, and succeeds */
  int trace;                 /* keep a per-round trace for rpl_comm_trace() */
  rpl_domain *domain;        /* fence domain (see above); NULL = this communicator alone */
  rpl_compress compression;  /* every member of a group must set the same (else MISMATCH) */
} rpl_partial_config;

/* Enables partial rounds (once, before the first one). Connects to the coordinator for
 * dynamic schedules and fails with RPL_ERR_PEER naming the endpoint if it is unreachable. */
rpl_status rpl_comm_enable_partial(rpl_comm *comm, const rpl_partial_config *cfg,
                                   rpl_error *err);

#define RPL_HIST_BUCKETS 17 /* group sizes 0..15, and 16 or more */

/* The partial rounds' statistics, one table as the counters': X(type, name, what it means).
 * group_sizes, the one array, follows them. */
#define RPL_PARTIAL_STATS(X)                                                                 \
  X(uint64_t, rounds, "partial calls that ran (reduced, no-op, skipped or failed)")          \
  X(uint64_t, reduced, "rounds that moved data (a group of two or more)")                   \
  X(uint64_t, singletons, "rounds in a group of one")                                        \
  X(uint64_t, passed, "rounds the coordinator's adaptive period passed (no averaging "       \
                      "meant; not counted as groups of one)")                                \
  X(uint64_t, given, "rounds over a group given to them (give_group(), "                   \
                     "rpl_comm_partial_give) instead of the schedule's; counted as any "     \
                     "round in the other keys too")                                          \
  X(uint32_t, period, "the adaptive period in the coordinator's last answer (1: every "      \
                      "round averages; 0: no answer yet, or the static schedule)")           \
  X(uint64_t, skipped, "failed rounds absorbed by on_failure='skip'")                        \
  X(uint64_t, failed, "failed rounds reported as errors")                                    \
  X(uint64_t, exact_fallbacks, "partial calls reduced exactly (non-floating buffer or op)")  \
  X(uint64_t, fences, "fences sent to the coordinator before exact collectives")             \
  X(uint64_t, unfences, "unfences sent when they ended")                                     \
  X(uint64_t, rounds_since_group, "rounds since the last one in a group of two or more "     \
                                  "(groups of one, skipped and failed rounds)")              \
  X(uint64_t, singleton_run_max, "the longest such run")                                     \
  X(uint64_t, coordinator_failovers, "times this worker registered with another (or a "      \
                                     "restarted) coordinator after losing its own")          \
  X(uint64_t, bytes, "payload bytes of rounds that moved data")                              \
  X(uint64_t, wire_bytes, "bytes this rank sent moving them (after the signature "           \
                          "exchange; frame headers included; compressed where it applied)")  \
  X(uint64_t, compressed, "rounds that moved data compressed")                               \
  X(uint64_t, compress_fallbacks, "rounds eligible for compression that ran uncompressed: "  \
                                  "a member held a non-finite value or one beyond the "      \
                                  "mode's range")                                            \
  X(double, group_s, "seconds obtaining groups (the coordinator round trip)")                \
  X(double, wait_s, "seconds waiting for the group's members (signature exchange)")          \
  X(double, reduce_s, "seconds moving, reducing and writing back data")                      \
  X(double, confirm_s, "of reduce_s, the members' confirmations that they hold the whole "   \
                       "result: the window in which a round is not atomic")

#define RPL_PARTIAL_STAT_FIELD_(type, name, doc) type name;
typedef struct rpl_partial_stats {
  RPL_PARTIAL_STATS(RPL_PARTIAL_STAT_FIELD_)
  uint64_t group_sizes[RPL_HIST_BUCKETS]; /* rounds by group size; the last bucket: 16 or more */
} rpl_partial_stats;

void rpl_comm_partial_stats(const rpl_comm *comm, rpl_partial_stats *out);

#define RPL_TRACE_MEMBERS 64 /* members recorded per trace entry (nmembers may be larger) */
#define RPL_TRACE_CAPACITY 8192 /* entries kept per communicator (the newest) */

typedef struct rpl_trace_entry {
  uint64_t round;           /* this rank's partial-round number, from 0 */
  uint64_t group_id;        /* the same on every member of the group */
  int status;               /* rpl_status of the round */
  int nmembers;
  int members[RPL_TRACE_MEMBERS];
} rpl_trace_entry;

/* Copies trace entries with index >= `from` (indices count every round since tracing began;
 * the oldest are dropped past RPL_TRACE_CAPACITY) into out[0..cap); returns how many. */
size_t rpl_comm_trace(const rpl_comm *comm, uint64_t from, rpl_trace_entry *out, size_t cap);

/* How this rank's last partial round ended, kept whether tracing is on or not. */
typedef struct rpl_round_outcome {
  uint64_t round;    /* this rank's partial-round number, from 0 */
  uint64_t group_id; /* as the trace's */
  int status;        /* rpl_status of the round (before on_failure = SKIP absorbed it) */
  int nmembers;      /* as the trace's: 0 when the round failed before it had a group */
  int moved;         /* 1 if data moved between members and was written back */
  int given;         /* 1 if its group was given (rpl_comm_partial_give) */
} rpl_round_outcome;

/* Copies the last partial round's outcome into *out and its first `cap` members (sorted group
 * ranks; cap = rpl_comm_size() holds them all) into members[]. Returns 0, writing nothing,
 * before the first round (or with partial rounds off), else 1. Safe from any thread. */
int rpl_comm_partial_last(const rpl_comm *comm, rpl_round_outcome *out, int *members, int cap);

/* The group of this rank's partial round number `round` (as rpl_round_outcome.round counts;
 * while no partial round is queued or running, the next one's number is the `rounds`
 * statistic), as soon as the round has it -- before its data moves. Waits up to timeout_s.
 * Returns 1 with *out (round, group_id, nmembers, given; status 0 and moved 0, whatever the
 * round's end) and its first `cap` members; 0 when that round ended without a group (a failed
 * request: rpl_comm_partial_last says why) or a later round's group is already known; -1 when
 * the wait timed out. A group of one and the adaptive period's pass (group_id 0) are groups
 * too. Lets one process hand a round's group to others (rpl_comm_partial_give) while its own
 * round still moves data. Safe from any thread. */
int rpl_comm_partial_group(const rpl_comm *comm, uint64_t round, double timeout_s,
                           rpl_round_outcome *out, int *members, int cap);

/* Gives this rank's next partial round its group: members[0..n) (group ranks, strictly
 * increasing, this rank among them) and group_id (the run's sequence on the wire: every
 * member passes the same, nonzero when n > 1). That round asks no schedule and no coordinator
 * (and tells the coordinator nothing); everything else is a round's as above, and it counts
 * as one (its round number included). Used to make several groups average with the same
 * members: one runs its schedule's round, the others are given its outcome
 * (rpl_comm_partial_last). A round takes the group from the moment it starts, so the call is
 * refused (RPL_ERR_INVALID) while a partial round is queued or running, and while a group
 * given earlier waits for its round (except for the round rpl_comm_partial_expect announced);
 * a call that falls back to an exact all-reduce (see above) leaves it for the next round. Safe
 * from any thread. */
rpl_status rpl_comm_partial_give(rpl_comm *comm, const int *members, int n, uint64_t group_id,
                                 rpl_error *err);

/* Makes this rank's next partial round take its group from rpl_comm_partial_give even when
 * the group is given after the round was submitted: the round waits for it, up to its
 * deadline (then RPL_ERR_TIMEOUT; a give after that is refused), instead of asking its
 * schedule. Lets a caller submit the round in order with its other operations on the group
 * before it knows the group (FSDP's shard ranks, whose group shard 0 hands over later).
 * Refused (RPL_ERR_INVALID) while a partial round is queued or running, or when the next
 * round already has or expects a given group. Safe from any thread. */
rpl_status rpl_comm_partial_expect(rpl_comm *comm, rpl_error *err);

/* Takes this communicator out of its fence domain: its exact collectives stop fencing the
 * other communicators' dynamic schedules, and theirs stop fencing its own. Only for a group
 * whose collectives no partial round of another group can wait for: FSDP's shard group, whose
 * ranks reach their partial rounds together (ripples_pg.fsdp). Its fences would otherwise end
 * every compute step the coordinator measures and cancel the groups pending for its ranks.
 * Refused (RPL_ERR_INVALID) while an operation is queued or running; RPL_ERR_CLOSED after
 * shutdown. A no-op where partial rounds are off (such a group fences nothing). */
rpl_status rpl_comm_fence_alone(rpl_comm *comm, rpl_error *err);

#ifdef __cplusplus
}
#endif

#endif /* RIPPLES_H */
