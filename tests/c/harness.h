/*
 * harness.h - what the core's C tests share: the checks (check.h), an in-memory key-value
 * store standing in for the c10d store, ops run synchronously (run_op) or submitted and waited
 * on later (req), ranks run as threads (run_world) over each transport, and small clock and
 * transport-transfer helpers. Tests that play a peer by hand over TCP add loopback.h.
 */
#ifndef RPL_TEST_HARNESS_H
#define RPL_TEST_HARNESS_H

#include <pthread.h>
#include <stdio.h>

#include "check.h"
#include "ripples.h"
#include "transport.h"

/* Monotonic time in seconds, and a sleep of that many seconds. */
double now_s(void);
void sleep_s(double s);

/* A transport transfer of `len` bytes with `peer` (a send if is_send), framed as the seq-th
 * broadcast of tag 1: what the transport-level tests exchange. */
rpl_xfer xfer(int peer, int is_send, void *buf, size_t len, uint64_t seq);

typedef struct mem_store mem_store;

/* Runs `op` and waits for its completion; *err gets the completion's message. */
rpl_status run_op(rpl_comm *c, rpl_op_desc d, rpl_error *err);

/* An op submitted without waiting (rpl_submit), and how it ended. */
typedef struct req {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int submitted, done;
  rpl_status st;
  rpl_error err;
  int order; /* when it completed, counted over all requests of the process */
} req;

/* Submits d, completing into *r; on refusal *r is done with the refusal's status. */
rpl_status submit(rpl_comm *c, rpl_op_desc d, req *r);
/* Waits at most max_s (a safety net: ops time out on their own); -1 if still not done. */
int wait_for(req *r, double max_s);
int is_done(req *r);
/* Waits (bounded) and releases the request's lock and condition. */
void req_free(req *r);

typedef struct job {
  int rank, size;
  mem_store *store;
  double timeout;
  void (*body)(struct job *, rpl_comm *);
  void *arg;      /* the test's own data, shared by all ranks */
  rpl_comm *comm;
} job;

/* How run_world lays ranks out: `hosts` > 0 simulates that many hosts (rank r on host
 * r % hosts: shared memory inside a host, TCP across); `tcp_only` disables shared memory;
 * `ucx` takes UCX instead of TCP across hosts; `single_copy` lets all-reduces of 1 KiB and
 * more among ranks of one host read each other's buffers (otherwise they use the rings);
 * `inline_ops` makes run_op submit with rpl_submit_inline (g_inline_runs counts those that ran);
 * `frame_macs` authenticates every frame on the TCP links. */
typedef struct world_layout {
  int hosts;
  int tcp_only;
  int ucx;
  int single_copy;
  int inline_ops;
  int frame_macs; /* authenticated frames on the TCP links */
} world_layout;
extern world_layout g_layout;
extern int g_inline_runs;

/* Starts `size` ranks as threads, each creating a communicator (small thresholds so the
 * large-message algorithms run on small data) and calling body(job, comm). */
void run_world(int size, double timeout, void (*body)(job *, rpl_comm *), void *arg);

/* Runs `suite` once over each transport: shared memory only (one host), TCP only, and mixed
 * (two simulated hosts: rings inside, sockets across, in the same operation). Leaves g_layout
 * at the last of these. */
void run_on_each_transport(void (*suite)(void));

/* Shutdown tests leave ops pending and count how they end. The callbacks run on the progress
 * thread, which rpl_comm_shutdown joins: read the counts after it, without a lock. */
typedef struct closed_count {
  int calls, closed; /* callbacks run, and how many of them reported RPL_ERR_CLOSED */
  rpl_status other;  /* the last other status, so a failure names what the op got instead */
} closed_count;

/* Submits d[0..n), each completing into *w (d[i].on_done/done_arg are set in place, so a
 * later resubmission of d[i] counts too); CHECKs that every submission was accepted. */
void submit_counting_closed(rpl_comm *c, rpl_op_desc *d, int n, closed_count *w,
                            const char *what);

/* After rpl_comm_shutdown: CHECKs that all n ops submitted into *w ended RPL_ERR_CLOSED. */
void check_all_closed(const closed_count *w, int n, const char *what);

#endif
