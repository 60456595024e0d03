/*
 * test_liveness.c - a dead peer is noticed within about a second on every transport, and the
 * error names the rank that died, also on ranks that only waited for a live peer that waited
 * for the dead one.
 *
 * Ranks here are real processes (fork), because what is tested is how a process's death shows:
 * a SIGKILLed child that nobody has reaped yet is a zombie, which kill(pid, 0) still finds.
 * Rank 0 is this process and does the checking; the other ranks report through a shared
 * board. Every wait in the scenarios has a 30 s deadline, far above the bounds checked.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "ripples.h"
#include "shm.h"
#include "transport.h"

#define MAXR 4
#define DEADLINE_S 30.0
#define DETECT_S 2.0 /* bound on noticing a death (the design target is ~0.1-1 s) */

/* What the ranks share: addresses, segment names, a barrier, and each rank's outcome. */
typedef struct board {
  int arrived;
  int outcome_set[MAXR];
  rpl_status status[MAXR];
  double elapsed[MAXR];
  char msg[MAXR][RPL_ERRMSG_LEN];
  char addr[MAXR][64];
  char shm[MAXR][64];
  pid_t pid[MAXR]; /* as this process sees them (a rank in another pid namespace reports it) */
} board;

static board *g_board;
static int g_barriers; /* barriers passed by this process in the current scenario */
static int g_ucx;      /* links not on shared memory are UCX endpoints, not sockets */
static int g_late;     /* chain: rank 0 reads from rank 1 only after rank 1 gave up */

static void new_board(void) {
  memset(g_board, 0, sizeof *g_board);
  g_barriers = 0;
}

/* All `n` ranks arrive; 0 if some rank never did within 20 s. */
static int barrier(int n) {
  g_barriers++;
  __atomic_add_fetch(&g_board->arrived, 1, __ATOMIC_SEQ_CST);
  double end = now_s() + 20.0;
  while (__atomic_load_n(&g_board->arrived, __ATOMIC_SEQ_CST) < n * g_barriers)
    if (now_s() > end) return 0;
    else sleep_s(0.001);
  return 1;
}

static void report_outcome(int rank, rpl_status st, double elapsed, const char *msg) {
  g_board->status[rank] = st;
  g_board->elapsed[rank] = elapsed;
  snprintf(g_board->msg[rank], sizeof g_board->msg[rank], "%s", msg);
  __atomic_store_n(&g_board->outcome_set[rank], 1, __ATOMIC_SEQ_CST);
}

/* Waits (bounded) for rank r's outcome. */
static int await_outcome(int r) {
  double end = now_s() + DEADLINE_S + 5.0;
  while (!__atomic_load_n(&g_board->outcome_set[r], __ATOMIC_SEQ_CST))
    if (now_s() > end) return 0;
    else sleep_s(0.001);
  return 1;
}

/* A rank that has nothing left to do stays alive (until killed), so that what its peers see
 * comes from what it did, not from its exit. Bounded, in case rank 0 died. */
static void linger(void) {
  for (int i = 0; i < 600; i++) sleep_s(0.1);
  _exit(0);
}

/* ---- one rank's transport -------------------------------------------------------------- */

typedef struct node {
  int rank, size;
  rpl_tr *tr;
  rpl_shm *shm; /* owned by tr */
} node;

/* host[r]: ranks with equal values share memory (-1: TCP to everyone). */
static int node_up(node *nd, int rank, int size, const int *host) {
  rpl_error err;
  memset(nd, 0, sizeof *nd);
  nd->rank = rank;
  nd->size = size;
  if (rpl_tr_create(rank, size, "127.0.0.1", g_ucx, &nd->tr, &err) != RPL_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, err.msg);
    return 0;
  }
  rpl_tr_address(nd->tr, g_board->addr[rank], sizeof g_board->addr[rank]);
  int local_of[MAXR], nlocal = 0;
  for (int r = 0; r < size; r++)
    local_of[r] = host[rank] >= 0 && host[r] == host[rank] ? nlocal++ : -1;
  if (nlocal > 1 &&
      rpl_shm_create(rank, size, local_of, 42, 64 * 1024, &nd->shm, g_board->shm[rank],
                     sizeof g_board->shm[rank], &err) != RPL_OK) {
    fprintf(stderr, "rank %d: %s\n", rank, err.msg);
    return 0;
  }
  if (!barrier(size)) return 0;
  for (int r = 0; r < size; r++) {
    if (r == rank) continue;
    if (rpl_tr_set_peer(nd->tr, r, g_board->addr[r], &err) != RPL_OK) return 0;
    if (nd->shm && local_of[r] >= 0 &&
        rpl_shm_attach(nd->shm, r, g_board->shm[r], &err) != RPL_OK) {
      fprintf(stderr, "rank %d: %s\n", rank, err.msg);
      return 0;
    }
  }
  if (nd->shm) rpl_tr_set_shm(nd->tr, nd->shm);
  if (!barrier(size)) return 0;
  if (nd->shm) rpl_shm_unlink(nd->shm);
  return 1;
}

/* Every pair exchanges one small message: connections and rings are in use afterwards. */
static int warm_up(node *nd) {
  rpl_xfer xs[2 * MAXR];
  unsigned char out[16] = {1}, in[MAXR][16];
  int n = 0;
  for (int r = 0; r < nd->size; r++) {
    if (r == nd->rank) continue;
    xs[n++] = xfer(r, 1, out, sizeof out, 1);
    xs[n++] = xfer(r, 0, in[r], sizeof in[r], 1);
  }
  rpl_error err;
  rpl_status st = rpl_tr_run(nd->tr, xs, n, now_s() + DEADLINE_S, &err);
  if (st != RPL_OK) fprintf(stderr, "rank %d warm-up: %s\n", nd->rank, err.msg);
  return st == RPL_OK;
}

/* Runs `xs` with the scenario deadline; returns the status, the time taken and the message. */
static rpl_status timed_run(node *nd, rpl_xfer *xs, int n, double *elapsed, rpl_error *err) {
  err->msg[0] = '\0';
  double t0 = now_s();
  rpl_status st = rpl_tr_run(nd->tr, xs, n, t0 + DEADLINE_S, err);
  *elapsed = now_s() - t0;
  return st;
}

static pid_t spawn(void (*fn)(int rank, void *arg), int rank, void *arg) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    fn(rank, arg);
    _exit(0);
  }
  return pid;
}

static void kill_all(const pid_t *pids, int n) {
  for (int i = 0; i < n; i++)
    if (pids[i] > 0) kill(pids[i], SIGKILL);
  for (int i = 0; i < n; i++)
    if (pids[i] > 0) waitpid(pids[i], NULL, 0);
  /* A rank killed before its unlink leaves its segment behind: remove it for it, so the
   * suite leaves /dev/shm as it found it (a mapped segment outlives its name). */
  for (int r = 0; r < MAXR; r++)
    if (g_board->shm[r][0]) {
      shm_unlink(g_board->shm[r]);
      g_board->shm[r][0] = '\0';
    }
}

/* CHECKs that the ranks came up (`up`); if not, kills this scenario's n children, so the
 * caller can just return. */
static int came_up(int up, const pid_t *kids, int n, const char *what) {
  CHECK(up, "%s: ranks did not come up", what);
  if (!up) kill_all(kids, n);
  return up;
}

/* Waits (without reaping) until `pid` has exited: it is a zombie from then on. */
static int wait_zombie(pid_t pid) {
  siginfo_t si;
  memset(&si, 0, sizeof si);
  return waitid(P_PID, (id_t)pid, &si, WEXITED | WNOWAIT) == 0;
}

static int names_rank(const char *msg, int rank) {
  char want[32];
  snprintf(want, sizeof want, "rank %d ", rank);
  return strstr(msg, want) != NULL;
}

/* ---- the liveness primitive ------------------------------------------------------------ */

static const int ONE_HOST[MAXR] = {0, 0, 0, 0};
static const int NO_SHM[MAXR] = {-1, -1, -1, -1};

static void idle_rank(int rank, void *arg) {
  const int *host = arg;
  node nd;
  if (!node_up(&nd, rank, 2, host)) _exit(1);
  linger();
}

/* `victim`: the child's rank; rank 0 is the anchor whose segment holds every rank's lock. */
static void zombie_is_dead(int victim) {
  new_board();
  pid_t child = spawn(idle_rank, victim, (void *)ONE_HOST);
  node nd;
  int me = 1 - victim;
  int up = node_up(&nd, me, 2, ONE_HOST);
  if (!came_up(up, &child, 1, "zombie")) return;
  rpl_error err;
  char cause[64];
  CHECK(rpl_shm_check_peer(nd.shm, victim, 1, 0, cause, sizeof cause, &err) == RPL_OK,
        "zombie: a live peer must pass the check: %s", err.msg);
  CHECK(!rpl_shm_peer_dead(nd.shm, victim), "zombie: a live peer reads as dead");

  kill(child, SIGKILL);
  CHECK(wait_zombie(child), "zombie: waitid(WNOWAIT) failed");
  /* The reason for the lock: the unreaped child still answers kill(pid, 0). */
  CHECK(kill(child, 0) == 0, "zombie: expected kill(pid, 0) to succeed on a zombie");
  CHECK(rpl_shm_peer_dead(nd.shm, victim), "zombie: a killed, unreaped peer reads as alive");
  rpl_status st = rpl_shm_check_peer(nd.shm, victim, 1, 0, cause, sizeof cause, &err);
  CHECK(st == RPL_ERR_PEER && names_rank(err.msg, victim),
        "zombie: check_peer gave %s '%s'", rpl_status_name(st), err.msg);
  /* Without the probe only the flags count: nothing announced. */
  CHECK(rpl_shm_check_peer(nd.shm, victim, 0, 0, cause, sizeof cause, &err) == RPL_OK,
        "zombie: the flags-only check should not probe");
  rpl_tr_destroy(nd.tr);
  kill_all(&child, 1);
}

static void rank_with_cause(int rank, void *arg) {
  (void)arg;
  node nd;
  if (!node_up(&nd, rank, 2, ONE_HOST)) _exit(1);
  rpl_shm_set_cause(nd.shm, "7|2|rank 2 (pid 99) exited or was killed");
  if (!barrier(2)) _exit(1); /* the cause is set */
  if (!barrier(2)) _exit(1); /* the peer read while this rank lived */
}

/* A peer that gave up after an error of its own (a third rank's death) and then exited, or let
 * go of its buffer, while this rank read that buffer (single copy): the error names the first
 * cause, not only the peer. */
static void test_read_names_first_cause(void) {
  new_board();
  pid_t child = spawn(rank_with_cause, 1, NULL);
  node nd;
  int up = node_up(&nd, 0, 2, ONE_HOST) && barrier(2);
  if (!came_up(up, &child, 1, "read cause")) return;
  unsigned char buf[16];
  char cause[320]; /* a segment's cause, whole */
  rpl_error err;
  CHECK(rpl_shm_can_read(nd.shm, 1), "read cause: no single-copy path to the peer");
  /* alive, its buffer gone (an address it never mapped) */
  rpl_status st = rpl_shm_read_peer(nd.shm, 1, 4096, buf, sizeof buf, cause, sizeof cause, &err);
  CHECK(st == RPL_ERR_PEER && names_rank(err.msg, 1) && names_rank(err.msg, 2) &&
            strstr(err.msg, "after an error of its own") && strstr(err.msg, "Bad address") &&
            strcmp(cause, "7|2|rank 2 (pid 99) exited or was killed") == 0,
        "read cause (live peer): %s '%s' cause '%s'", rpl_status_name(st), err.msg, cause);
  CHECK(barrier(2), "read cause: the peer did not arrive");
  CHECK(wait_zombie(child), "read cause: waitid(WNOWAIT) failed");
  st = rpl_shm_read_peer(nd.shm, 1, 4096, buf, sizeof buf, cause, sizeof cause, &err);
  CHECK(st == RPL_ERR_PEER && names_rank(err.msg, 1) && names_rank(err.msg, 2) &&
            strstr(err.msg, "exited or was killed while this rank read its buffer"),
        "read cause (exited peer): %s '%s'", rpl_status_name(st), err.msg);
  rpl_tr_destroy(nd.tr);
  kill_all(&child, 1);
}

static void test_zombie_is_dead(void) { zombie_is_dead(1); }
static void test_dead_anchor(void) { zombie_is_dead(0); }

/* Two ranks of one host as shm objects in this process (segments named in na/nb), attached
 * to each other when `attach`; 0 if creating them failed (already reported). */
static int shm_pair(uint64_t nonce, rpl_shm **a, rpl_shm **b, char na[64], char nb[64],
                    int attach) {
  int local_of[2] = {0, 1};
  rpl_error err;
  *a = *b = NULL;
  CHECK(rpl_shm_create(0, 2, local_of, nonce, 4096, a, na, 64, &err) == RPL_OK, "%s", err.msg);
  CHECK(rpl_shm_create(1, 2, local_of, nonce, 4096, b, nb, 64, &err) == RPL_OK, "%s", err.msg);
  if (!*a || !*b) return 0;
  if (attach) {
    CHECK(rpl_shm_attach(*a, 1, nb, &err) == RPL_OK, "%s", err.msg);
    CHECK(rpl_shm_attach(*b, 0, na, &err) == RPL_OK, "%s", err.msg);
  }
  return 1;
}

/* Ranks as threads of one process (the other C tests) must never read as dead: F_GETLK does
 * not see the caller's own locks. */
static void test_same_process_never_dead(void) {
  rpl_shm *a, *b;
  char na[64], nb[64];
  rpl_error err;
  if (!shm_pair(7, &a, &b, na, nb, 1)) return;
  CHECK(!rpl_shm_peer_dead(a, 1) && !rpl_shm_peer_dead(b, 0),
        "same process: a peer in this process reads as dead");
  /* A cause travels with a break. */
  rpl_shm_set_cause(b, "rank 3 (pid 99) exited or was killed");
  rpl_shm_break(b, 0);
  char cause[128];
  rpl_status st = rpl_shm_check_peer(a, 1, 1, 0, cause, sizeof cause, &err);
  CHECK(st == RPL_ERR_PEER && names_rank(err.msg, 1) && names_rank(err.msg, 3) &&
            strcmp(cause, "rank 3 (pid 99) exited or was killed") == 0,
        "break with a cause: %s '%s' cause '%s'", rpl_status_name(st), err.msg, cause);
  rpl_shm_destroy(a);
  rpl_shm_destroy(b);
}

/* A broken pair is rebuilt, not given up: once both sides have closed their links, what a
 * failed exchange left in the rings is thrown away and the next bytes arrive intact. */
static void test_broken_pair_is_rebuilt(void) {
  rpl_shm *a, *b;
  char na[64], nb[64];
  rpl_error err;
  if (!shm_pair(9, &a, &b, na, nb, 1)) return;
  CHECK(rpl_shm_rearm(a, 1) == RPL_SHM_READY && rpl_shm_usable(b, 0),
        "a pair never broken is ready");
  for (int round = 0; round < 3; round++) {
    /* Half a message each way, then b gives up on the exchange (round 1: a does). */
    char stale[100];
    memset(stale, 'x', sizeof stale);
    struct iovec iv = {stale, sizeof stale};
    CHECK(rpl_shm_write(a, 1, &iv, 1) == sizeof stale && rpl_shm_write(b, 0, &iv, 1) == sizeof stale,
          "round %d: stale writes", round);
    rpl_shm_break(round == 1 ? a : b, round == 1 ? 1 : 0);
    char cause[64];
    CHECK(!rpl_shm_usable(a, 1) && !rpl_shm_usable(b, 0) &&
              strcmp(rpl_shm_path(a, 1), "shm-resuming") == 0,
          "round %d: a broken pair is not usable on either side", round);
    CHECK(rpl_shm_check_peer(a, 1, 0, 0, cause, sizeof cause, &err) == RPL_ERR_PEER,
          "round %d: a link in use fails on a broken pair", round);
    CHECK(rpl_shm_check_peer(a, 1, 0, 1, cause, sizeof cause, &err) == RPL_OK,
          "round %d: a pair being rebuilt is not an error: %s", round, err.msg);
    /* Each side's steps in turn; neither is ready before both have drained. */
    int ra = rpl_shm_rearm(a, 1); /* a is quiet */
    int rb = rpl_shm_rearm(b, 0); /* b is quiet and drains a's stale bytes */
    CHECK(ra == RPL_SHM_REARMING && rb == RPL_SHM_REARMING, "round %d: ready early: %d %d",
          round, ra, rb);
    ra = rpl_shm_rearm(a, 1); /* a drains b's stale bytes: both drained */
    rb = rpl_shm_rearm(b, 0);
    CHECK(ra == RPL_SHM_READY && rb == RPL_SHM_READY && rpl_shm_usable(a, 1) &&
              rpl_shm_usable(b, 0) && strncmp(rpl_shm_path(b, 0), "shm", 3) == 0 &&
              strcmp(rpl_shm_path(b, 0), "shm-resuming") != 0,
          "round %d: not rebuilt: %d %d", round, ra, rb);
    char got[16];
    CHECK(rpl_shm_read(b, 0, got, sizeof got) == 0 && rpl_shm_read(a, 1, got, sizeof got) == 0,
          "round %d: stale bytes survived the rebuild", round);
    struct iovec fresh = {"fresh", 5};
    CHECK(rpl_shm_write(a, 1, &fresh, 1) == 5 && rpl_shm_read(b, 0, got, sizeof got) == 5 &&
              memcmp(got, "fresh", 5) == 0,
          "round %d: the first bytes after the rebuild are not what was written", round);
    CHECK(rpl_shm_check_peer(b, 0, 0, 0, cause, sizeof cause, &err) == RPL_OK,
          "round %d: rebuilt pair still flagged: %s", round, err.msg);
  }
  rpl_shm_destroy(a);
  rpl_shm_destroy(b);
}

/* Every creator locks its own segment while it lives, so a segment left behind (a rank killed
 * during set-up) is told from a live one by its lock, not by a pid that may belong to another
 * namespace (the sweep in ripples_pg/backend/_incarnation.py). Another process must see the lock. */
static void test_own_segment_locked(void) {
  rpl_shm *a, *b;
  char na[64], nb[64];
  if (!shm_pair(11, &a, &b, na, nb, 0)) return;
  const char *names[2] = {na, nb};
  for (int i = 0; i < 2; i++) {
    pid_t child = fork();
    if (child == 0) { /* locks are per process: only another one sees ours */
      int fd = shm_open(names[i], O_RDWR, 0);
      struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
      _exit(fd >= 0 && fcntl(fd, F_SETLK, &fl) != 0 ? 0 : 1);
    }
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "rank %d's own segment is not locked while it lives", i);
  }
  rpl_shm_destroy(a);
  rpl_shm_destroy(b);
}

/* A peer in another pid namespace (a container sharing /dev/shm): the pid in its segment
 * means nothing here, and must never make it look dead; its death is still seen. Needs the
 * right to create a pid namespace (skipped without it). */
static void pidns_rank(int rank, void *arg) {
  if (unshare(CLONE_NEWPID) != 0) {
    report_outcome(rank, RPL_ERR_UNSUPPORTED, 0, "unshare(CLONE_NEWPID) not permitted");
    linger();
  }
  pid_t inner = fork(); /* pid 1 of the new namespace */
  if (inner == 0) idle_rank(rank, arg);
  g_board->pid[rank] = inner; /* as the outer namespace sees it */
  report_outcome(rank, RPL_OK, 0, "");
  linger();
}

static void test_other_pid_namespace(void) {
  new_board();
  pid_t outer = spawn(pidns_rank, 1, (void *)ONE_HOST);
  if (!await_outcome(1) || g_board->status[1] != RPL_OK) {
    printf("  (skipped: %s)\n", g_board->msg[1]);
    kill_all(&outer, 1);
    return;
  }
  node nd;
  int up = node_up(&nd, 0, 2, ONE_HOST);
  if (!came_up(up, &outer, 1, "pidns")) return;
  rpl_error err;
  char cause[64];
  sleep_s(0.05);
  CHECK(rpl_shm_check_peer(nd.shm, 1, 1, 0, cause, sizeof cause, &err) == RPL_OK,
        "pidns: a live peer in another pid namespace reads as dead: %s", err.msg);
  pid_t inner = g_board->pid[1];
  kill(inner, SIGKILL);
  double t0 = now_s();
  rpl_status st = RPL_OK;
  while (st == RPL_OK && now_s() - t0 < DETECT_S) {
    st = rpl_shm_check_peer(nd.shm, 1, 1, 0, cause, sizeof cause, &err);
    if (st == RPL_OK) sleep_s(0.01);
  }
  CHECK(st == RPL_ERR_PEER && names_rank(err.msg, 1),
        "pidns: death not seen within %g s: %s '%s'", DETECT_S, rpl_status_name(st), err.msg);
  rpl_tr_destroy(nd.tr);
  kill_all(&outer, 1);
}

/* ---- waits in the run loop --------------------------------------------------------------- */

/* Rank 1 of a chain: waits for rank 2 (which dies), then gives up on its links as the engine
 * does after a failed collective, and stays alive. */
static void chain_middle(int rank, void *arg) {
  const int *host = arg;
  node nd;
  if (!node_up(&nd, rank, 3, host) || !warm_up(&nd) || !barrier(3)) _exit(1);
  unsigned char buf[16];
  rpl_xfer x = xfer(2, 0, buf, sizeof buf, 2);
  rpl_error err;
  double el;
  rpl_status st = timed_run(&nd, &x, 1, &el, &err);
  if (g_late) report_outcome(rank, st, el, err.msg); /* rank 0 is not reading yet */
  rpl_tr_abort(nd.tr);
  if (!g_late) report_outcome(rank, st, el, err.msg);
  linger();
}

static void chain_victim(int rank, void *arg) {
  node nd;
  if (!node_up(&nd, rank, 3, arg) || !warm_up(&nd) || !barrier(3)) _exit(1);
  linger(); /* until rank 0 kills it */
}

/* 0 waits for 1, 1 waits for 2, 2 is killed: both fail soon, and both name rank 2. With
 * g_late, rank 0 starts reading from rank 1 only once rank 1 has given up: what rank 1 said
 * before closing must still be there (UCX drops what a peer has not read once an endpoint
 * disconnects, so rank 1 keeps its links open until its goodbyes are read). */
static void chain(const char *what, const int *host) {
  new_board();
  pid_t kids[2] = {spawn(chain_middle, 1, (void *)host), spawn(chain_victim, 2, (void *)host)};
  node nd;
  int up = node_up(&nd, 0, 3, host) && warm_up(&nd) && barrier(3);
  if (!came_up(up, kids, 2, what)) return;
  sleep_s(0.2); /* rank 1 is asleep in its wait by now */
  kill(kids[1], SIGKILL); /* not reaped until the end: a zombie */
  if (g_late) {
    CHECK(await_outcome(1), "%s: rank 1 did not report", what);
    sleep_s(0.1); /* rank 1 is in its abort */
  }
  unsigned char buf[16];
  rpl_xfer x = xfer(1, 0, buf, sizeof buf, 2);
  rpl_error err;
  double el;
  rpl_status st = timed_run(&nd, &x, 1, &el, &err);
  CHECK(st == RPL_ERR_PEER && (g_late || el < DETECT_S) && names_rank(err.msg, 1) &&
            names_rank(err.msg, 2),
        "%s: rank 0 (waiting for live rank 1) got %s after %.2f s: '%s'", what,
        rpl_status_name(st), el, err.msg);
  CHECK(await_outcome(1), "%s: rank 1 did not report", what);
  CHECK(g_board->status[1] == RPL_ERR_PEER && g_board->elapsed[1] < DETECT_S &&
            names_rank(g_board->msg[1], 2),
        "%s: rank 1 (waiting for dead rank 2) got %s after %.2f s: '%s'", what,
        rpl_status_name(g_board->status[1]), g_board->elapsed[1], g_board->msg[1]);
  rpl_tr_destroy(nd.tr);
  kill_all(kids, 2);
}

static void test_chain_shm(void) { chain("chain over shared memory", ONE_HOST); }
static void test_chain_tcp(void) { chain("chain over TCP", NO_SHM); }
static void test_chain_tcp_late(void) {
  g_late = 1;
  chain("chain over TCP, read late", NO_SHM);
  g_late = 0;
}

/* Over UCX, read late only: with rank 0 reading at once, its peers, which do not drive their
 * UCX workers between runs here (a progress thread does in the engine), leave each graceful
 * close waiting out its 5 s bound. tests/test_peer_death.py covers UCX both ways. */
static void test_chain_ucx_late(void) {
  if (!rpl_has_ucx()) return; /* this build has no UCX */
  g_ucx = g_late = 1;
  chain("chain over UCX, read late", NO_SHM);
  g_ucx = g_late = 0;
}

/* Rank 0 waits on a ring peer and a TCP peer at once (the TCP one never sends): the ring peer
 * is still watched, and its death ends the wait. */
static const int MIXED[MAXR] = {0, 0, 1, 2};

static void mixed_rank(int rank, void *arg) {
  node nd;
  if (!node_up(&nd, rank, 3, MIXED) || !warm_up(&nd) || !barrier(3)) _exit(1);
  if (rank == 2) linger();
  sleep_s(0.2); /* rank 0 is in its wait by now */
  raise(SIGKILL);
}

static void test_mixed_wait(void) {
  new_board();
  pid_t kids[2] = {spawn(mixed_rank, 1, NULL), spawn(mixed_rank, 2, NULL)};
  node nd;
  int up = node_up(&nd, 0, 3, MIXED) && warm_up(&nd) && barrier(3);
  if (!came_up(up, kids, 2, "mixed")) return;
  unsigned char a[16], b[16];
  rpl_xfer xs[2] = {xfer(1, 0, a, sizeof a, 2), xfer(2, 0, b, sizeof b, 2)};
  rpl_error err;
  double el;
  rpl_status st = timed_run(&nd, xs, 2, &el, &err);
  CHECK(st == RPL_ERR_PEER && el < DETECT_S && names_rank(err.msg, 1),
        "mixed: got %s after %.2f s: '%s'", rpl_status_name(st), el, err.msg);
  rpl_tr_destroy(nd.tr);
  kill_all(kids, 2);
}

/* Rank 0 only sends to rank 1 (more than the socket buffers hold), which never reads and is
 * killed: the send fails at once. */
static void mute_rank(int rank, void *arg) {
  node nd;
  if (!node_up(&nd, rank, 2, NO_SHM) || !warm_up(&nd) || !barrier(2)) _exit(1);
  sleep_s(0.3);
  raise(SIGKILL);
}

static void test_tcp_send_to_dead(void) {
  new_board();
  pid_t kid = spawn(mute_rank, 1, NULL);
  node nd;
  int up = node_up(&nd, 0, 2, NO_SHM) && warm_up(&nd) && barrier(2);
  if (!came_up(up, &kid, 1, "send")) return;
  size_t len = 64u << 20;
  unsigned char *big = calloc(1, len);
  rpl_xfer x = xfer(1, 1, big, len, 2);
  rpl_error err;
  double el;
  rpl_status st = timed_run(&nd, &x, 1, &el, &err);
  CHECK(st == RPL_ERR_PEER && el < DETECT_S && names_rank(err.msg, 1),
        "send: got %s after %.2f s: '%s'", rpl_status_name(st), el, err.msg);
  free(big);
  rpl_tr_destroy(nd.tr);
  kill_all(&kid, 1);
}

/* Rank 1 waits to accept rank 0's connection; rank 0 dies before connecting. */
static void never_connects(int rank, void *arg) {
  node nd;
  if (!node_up(&nd, rank, 2, NO_SHM) || !barrier(2)) _exit(1);
  if (arg) { /* the live variant: connect late, then send */
    sleep_s(1.5);
    unsigned char buf[16] = {7};
    rpl_xfer x = xfer(1, 1, buf, sizeof buf, 2);
    rpl_error err;
    rpl_status st = rpl_tr_run(nd.tr, &x, 1, now_s() + DEADLINE_S, &err);
    report_outcome(rank, st, 0, err.msg);
    linger();
  }
  raise(SIGKILL);
}

static void accept_from(int live) {
  new_board();
  pid_t kid = spawn(never_connects, 0, live ? (void *)1 : NULL);
  node nd;
  int up = node_up(&nd, 1, 2, NO_SHM) && barrier(2);
  if (!came_up(up, &kid, 1, "accept")) return;
  unsigned char buf[16];
  rpl_xfer x = xfer(0, 0, buf, sizeof buf, 2);
  rpl_error err;
  double el;
  rpl_status st = timed_run(&nd, &x, 1, &el, &err);
  if (live) {
    CHECK(st == RPL_OK && buf[0] == 7, "accept (live): got %s: '%s'", rpl_status_name(st),
          err.msg);
    CHECK(await_outcome(0) && g_board->status[0] == RPL_OK, "accept (live): sender got '%s'",
          g_board->msg[0]);
  } else {
    CHECK(st == RPL_ERR_PEER && el < DETECT_S + 1.0 && names_rank(err.msg, 0),
          "accept: got %s after %.2f s: '%s'", rpl_status_name(st), el, err.msg);
  }
  rpl_tr_destroy(nd.tr);
  kill_all(&kid, 1);
}

static void test_accept_from_dead(void) { accept_from(0); }
static void test_accept_from_late(void) { accept_from(1); }

/* A live peer that never sends: a run whose caller gives up ends then, as RPL_ERR_PEER (a
 * partial round whose coordinator was lost while handing its group out), on a ring and on
 * TCP alike, long before its deadline. */
static void silent_rank(int rank, void *arg) {
  node nd;
  if (!node_up(&nd, rank, 2, (const int *)arg) || !warm_up(&nd) || !barrier(2)) _exit(1);
  linger();
}

static double g_give_up_at;
static int give_up_later(void *arg) {
  (void)arg;
  return now_s() >= g_give_up_at;
}

static void given_up(const char *what, const int *host) {
  new_board();
  pid_t kid = spawn(silent_rank, 1, (void *)host);
  node nd;
  int up = node_up(&nd, 0, 2, host) && warm_up(&nd) && barrier(2);
  if (!came_up(up, &kid, 1, what)) return;
  unsigned char buf[16];
  rpl_xfer x = xfer(1, 0, buf, sizeof buf, 2);
  rpl_error err;
  double t0 = now_s();
  g_give_up_at = t0 + 0.3;
  rpl_status st = rpl_tr_run_until(nd.tr, &x, 1, t0 + DEADLINE_S, give_up_later, NULL, &err);
  double el = now_s() - t0;
  CHECK(st == RPL_ERR_PEER && el >= 0.3 && el < DEADLINE_S / 2,
        "%s: got %s after %.2f s: '%s'", what, rpl_status_name(st), el, err.msg);
  /* The hook was for that run only: the next one waits for its deadline as before. */
  rpl_tr_reset_peer(nd.tr, 1);
  st = rpl_tr_run(nd.tr, &x, 1, now_s() + 0.5, &err);
  CHECK(st == RPL_ERR_TIMEOUT, "%s, next run: got %s: '%s'", what, rpl_status_name(st),
        err.msg);
  rpl_tr_destroy(nd.tr);
  kill_all(&kid, 1);
}

static void test_given_up_shm(void) { given_up("given up on a ring", ONE_HOST); }
static void test_given_up_tcp(void) { given_up("given up on TCP", NO_SHM); }

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  g_board = mmap(NULL, sizeof *g_board, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1,
                 0);
  if (g_board == MAP_FAILED) return 2;
  struct {
    const char *name;
    void (*fn)(void);
  } tests[] = {
      {"a killed, unreaped peer (zombie) is dead", test_zombie_is_dead},
      {"the same, when it held the shared lock file", test_dead_anchor},
      {"a failed single-copy read names the peer's first cause", test_read_names_first_cause},
      {"ranks of one process are never dead", test_same_process_never_dead},
      {"a broken ring pair is rebuilt", test_broken_pair_is_rebuilt},
      {"a creator locks its own segment", test_own_segment_locked},
      {"a peer in another pid namespace", test_other_pid_namespace},
      {"chain over shared memory", test_chain_shm},
      {"chain over TCP", test_chain_tcp},
      {"chain over TCP, rank 0 reading late", test_chain_tcp_late},
      {"chain over UCX, rank 0 reading late (none without UCX)", test_chain_ucx_late},
      {"ring peer watched while TCP is pending", test_mixed_wait},
      {"TCP send to a killed peer", test_tcp_send_to_dead},
      {"accepting from a peer that died", test_accept_from_dead},
      {"accepting from a live peer that connects late", test_accept_from_late},
      {"a run its caller gives up, on a ring", test_given_up_shm},
      {"a run its caller gives up, on TCP", test_given_up_tcp},
  };
  for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
    long before = g_fail;
    double t0 = now_s();
    tests[i].fn();
    printf("%s %s (%.2f s)\n", g_fail == before ? "ok  " : "FAIL", tests[i].name, now_s() - t0);
    fflush(stdout);
  }
  return report("liveness");
}
