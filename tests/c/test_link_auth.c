/*
 * test_link_auth.c - a data link carries data only after both ends proved the link key over
 * fresh values (wire.h), and nothing a stranger sends can stall, take over or feed a link:
 *   - a handshake recorded on the wire (through a relay in this test) and replayed is refused,
 *     and the data recorded after it never reaches a receive;
 *   - a connector holding the key is refused while the link it would replace is healthy, and
 *     always for a same-host peer served by a shared-memory ring;
 *   - a connector with another key fails with an error naming the job secret;
 *   - silent, garbage and half-finished connections cost a run no wait;
 *   - a byte changed on the path after the handshake goes unnoticed on a plain link and
 *     fails the run, naming the peer, with authenticated frames (rpl_tr_set_frame_macs).
 * Two transports in this process, each driven by its own thread (as the engine does).
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "crypto.h"
#include "harness.h"
#include "shm.h"
#include "loopback.h"
#include "transport.h"
#include "wire.h"

#define DEADLINE_S 20.0
#define PEND_FLOOD 100 /* more than the transport keeps pending */

typedef struct run_arg {
  rpl_tr *tr;
  rpl_xfer x;
  rpl_status st;
  rpl_error err;
} run_arg;

static void *run_thread(void *p) {
  run_arg *a = p;
  a->st = rpl_tr_run(a->tr, &a->x, 1, now_s() + DEADLINE_S, &a->err);
  return NULL;
}

/* Rank 0 sends `len` bytes of `fill` to rank 1 (seq `seq`); both sides run concurrently. */
static rpl_status exchange(rpl_tr *t0, rpl_tr *t1, uint64_t seq, unsigned char fill,
                           size_t len, rpl_error *err, double *took) {
  unsigned char *out = malloc(len), *in = calloc(1, len);
  memset(out, fill, len);
  run_arg a = {.tr = t0, .x = xfer(1, 1, out, len, seq)};
  run_arg b = {.tr = t1, .x = xfer(0, 0, in, len, seq)};
  double t = now_s();
  pthread_t ta, tb;
  pthread_create(&ta, NULL, run_thread, &a);
  pthread_create(&tb, NULL, run_thread, &b);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  if (took) *took = now_s() - t;
  rpl_status st = a.st != RPL_OK ? a.st : b.st;
  *err = a.st != RPL_OK ? a.err : b.err;
  if (st == RPL_OK)
    for (size_t i = 0; i < len; i++)
      if (in[i] != fill) {
        st = RPL_ERR_MISMATCH;
        snprintf(err->msg, sizeof err->msg, "byte %zu arrived as %u, not %u", i, in[i], fill);
        break;
      }
  free(out);
  free(in);
  return st;
}

/* ---- a relay that records what the connector sends ------------------------------------- */

typedef struct relay {
  int listen_fd, port;
  struct sockaddr_in to;
  unsigned char rec[8192];
  size_t nrec;
  long flip_at; /* > 0: the connector's byte at this offset is changed on the way */
  size_t nfwd;  /* the connector's bytes forwarded so far */
  volatile int stop;
  pthread_t th;
} relay;

static void *relay_main(void *p) {
  relay *r = p;
  int a = accept(r->listen_fd, NULL, NULL);
  if (a < 0) return NULL;
  int b = socket(AF_INET, SOCK_STREAM, 0);
  if (connect(b, (struct sockaddr *)&r->to, sizeof r->to) != 0) {
    close(a);
    close(b);
    return NULL;
  }
  while (!r->stop) {
    struct pollfd ps[2] = {{.fd = a, .events = POLLIN}, {.fd = b, .events = POLLIN}};
    if (poll(ps, 2, 50) <= 0) continue;
    unsigned char buf[65536];
    if (ps[0].revents) {
      ssize_t n = recv(a, buf, sizeof buf, 0);
      if (n <= 0) break;
      size_t room = sizeof r->rec - r->nrec, k = (size_t)n < room ? (size_t)n : room;
      memcpy(r->rec + r->nrec, buf, k);
      r->nrec += k;
      if (r->flip_at > 0 && (size_t)r->flip_at >= r->nfwd &&
          (size_t)r->flip_at < r->nfwd + (size_t)n)
        buf[(size_t)r->flip_at - r->nfwd] ^= 0x01;
      r->nfwd += (size_t)n;
      if (send(b, buf, (size_t)n, MSG_NOSIGNAL) != n) break;
    }
    if (ps[1].revents) {
      ssize_t n = recv(b, buf, sizeof buf, 0);
      if (n <= 0) break;
      if (send(a, buf, (size_t)n, MSG_NOSIGNAL) != n) break;
    }
  }
  close(a);
  close(b);
  return NULL;
}

static void relay_start(relay *r, const char *target_addr) {
  memset(r, 0, sizeof *r);
  unsigned port = 0;
  sscanf(strchr(target_addr, ':') + 1, "%u", &port);
  r->to.sin_family = AF_INET;
  r->to.sin_port = htons((uint16_t)port);
  inet_pton(AF_INET, "127.0.0.1", &r->to.sin_addr);
  r->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  socklen_t sl = sizeof sa;
  bind(r->listen_fd, (struct sockaddr *)&sa, sizeof sa);
  listen(r->listen_fd, 4);
  getsockname(r->listen_fd, (struct sockaddr *)&sa, &sl);
  r->port = ntohs(sa.sin_port);
  pthread_create(&r->th, NULL, relay_main, r);
}

/* Two transports (ranks 0 and 1) on `key`, rank 0 reaching rank 1 through relay r. */
static void relayed_pair(rpl_tr **t0, rpl_tr **t1, const unsigned char *key, relay *r) {
  rpl_error err;
  CHECK(rpl_tr_create(0, 2, "127.0.0.1", 0, t0, &err) == RPL_OK, "%s", err.msg);
  CHECK(rpl_tr_create(1, 2, "127.0.0.1", 0, t1, &err) == RPL_OK, "%s", err.msg);
  rpl_tr_set_key(*t0, key);
  rpl_tr_set_key(*t1, key);
  char a0[128], a1[128], via[128];
  rpl_tr_address(*t0, a0, sizeof a0);
  rpl_tr_address(*t1, a1, sizeof a1);
  relay_start(r, a1);
  snprintf(via, sizeof via, "127.0.0.1:%d:%s", r->port, strchr(strchr(a1, ':') + 1, ':') + 1);
  CHECK(rpl_tr_set_peer(*t0, 1, via, &err) == RPL_OK, "%s", err.msg);
  CHECK(rpl_tr_set_peer(*t1, 0, a0, &err) == RPL_OK, "%s", err.msg);
}

static void relay_stop(relay *r) {
  r->stop = 1;
  pthread_join(r->th, NULL);
  close(r->listen_fd);
}

/* A rank-1 run that waits for seq `seq` from rank 0 while `fn` does something to it. */
typedef struct bg {
  run_arg b;
  unsigned char in[64];
  pthread_t th;
} bg;

static void bg_start(bg *g, rpl_tr *t1, uint64_t seq) {
  memset(g, 0, sizeof *g);
  g->b.tr = t1;
  g->b.x = xfer(0, 0, g->in, sizeof g->in, seq);
  pthread_create(&g->th, NULL, run_thread, &g->b);
}

static rpl_status bg_finish(bg *g, rpl_tr *t0, uint64_t seq, unsigned char fill,
                            rpl_error *err) {
  unsigned char out[64];
  memset(out, fill, sizeof out);
  run_arg a = {.tr = t0, .x = xfer(1, 1, out, sizeof out, seq)};
  run_thread(&a);
  pthread_join(g->th, NULL);
  if (a.st != RPL_OK) {
    *err = a.err;
    return a.st;
  }
  if (g->b.st != RPL_OK) {
    *err = g->b.err;
    return g->b.st;
  }
  for (size_t i = 0; i < sizeof g->in; i++)
    if (g->in[i] != fill) {
      snprintf(err->msg, sizeof err->msg, "rank 1 received byte %u, not %u", g->in[i], fill);
      return RPL_ERR_MISMATCH;
    }
  return RPL_OK;
}

/* After an attack on connection fd: rank 1 closes it, and the run that g waits in still
 * completes over the real link (seq, bytes `fill`). */
static void expect_refused(int fd, bg *g, rpl_tr *t0, uint64_t seq, unsigned char fill,
                           const char *what) {
  unsigned char junk[1];
  CHECK(read_n(fd, junk, 1, 5.0) == 0, "%s: the connection is closed", what);
  close(fd);
  rpl_error err;
  rpl_status st = bg_finish(g, t0, seq, fill, &err);
  CHECK(st == RPL_OK, "%s: the link keeps working: %s", what, err.msg);
}

/* A newcomer holding the key connects to rank 1 at `addr` claiming to be rank 0 and completes
 * the handshake; returns its socket. */
static int newcomer(const char *addr, const unsigned char *key, const char *what) {
  rpl_error err;
  int fd = dial(addr);
  unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE], hs3[RPL_HS3_SIZE], n[16];
  rpl_random_bytes(n, sizeof n, &err);
  rpl_hs1_make(hs1, 0, 1, 2, id_of(addr), n);
  send(fd, hs1, sizeof hs1, MSG_NOSIGNAL);
  CHECK(read_n(fd, hs2, sizeof hs2, 5.0) == RPL_HS2_SIZE, "%s: challenge", what);
  CHECK(rpl_hs2_check(hs2, key, hs1, 1), "%s: the acceptor proves the key", what);
  rpl_hs3_make(hs3, key, hs1, hs2);
  send(fd, hs3, sizeof hs3, MSG_NOSIGNAL);
  return fd;
}

int main(void) {
  rpl_error err;
  unsigned char key[RPL_TR_KEY_LEN], other[RPL_TR_KEY_LEN];
  rpl_random_bytes(key, sizeof key, &err);
  rpl_random_bytes(other, sizeof other, &err);
  /* Rank 0 reaches rank 1 through the recording relay. */
  rpl_tr *t0, *t1;
  relay rl;
  relayed_pair(&t0, &t1, key, &rl);
  char a1[128]; /* rank 1's own listener, for the strangers below */
  rpl_tr_address(t1, a1, sizeof a1);
  rpl_status st = exchange(t0, t1, 1, 0x5a, 64, &err, NULL);
  CHECK(st == RPL_OK, "first exchange: %s", err.msg);
  rpl_tr_counters c;
  rpl_tr_get_counters(t1, &c);
  CHECK(c.connections == 1 && c.auth_failures == 0, "one authenticated link (%llu, %llu)",
        (unsigned long long)c.connections, (unsigned long long)c.auth_failures);
  CHECK(rl.nrec >= RPL_HS1_SIZE + RPL_HS3_SIZE + 40 + 64, "recorded %zu bytes", rl.nrec);

  /* 1. Replay the recorded connection: HS1, then (after a fresh HS2) the old HS3 and the
   * data that followed it. Rank 1 waits in a run meanwhile. */
  {
    bg g;
    bg_start(&g, t1, 2);
    int fd = dial(a1);
    send(fd, rl.rec, RPL_HS1_SIZE, MSG_NOSIGNAL);
    unsigned char hs2[RPL_HS2_SIZE];
    int got = read_n(fd, hs2, sizeof hs2, 5.0);
    CHECK(got == RPL_HS2_SIZE, "a challenge comes back (%d)", got);
    send(fd, rl.rec + RPL_HS1_SIZE, rl.nrec - RPL_HS1_SIZE, MSG_NOSIGNAL);
    expect_refused(fd, &g, t0, 2, 0x33, "a replay");
    rpl_tr_get_counters(t1, &c);
    CHECK(c.auth_failures == 1, "the replay counts as an authentication failure (%llu)",
          (unsigned long long)c.auth_failures);
    CHECK(c.connections == 1, "the replay did not become a link (%llu)",
          (unsigned long long)c.connections);
  }

  /* 2. A connector that holds the key, while the link it would replace is healthy. */
  {
    bg g;
    bg_start(&g, t1, 3);
    int fd = newcomer(a1, key, "a newcomer while the link is healthy");
    expect_refused(fd, &g, t0, 3, 0x44, "a newcomer while the link is healthy");
    rpl_tr_get_counters(t1, &c);
    CHECK(c.replacements_refused == 1, "one replacement refused (%llu)",
          (unsigned long long)c.replacements_refused);
  }

  /* 3. Strangers: silent connections, garbage, a valid HS1 never finished. None delays a
   * run (the old accept path waited up to 5 s for each). */
  {
    int fds[24], k = 0;
    for (int i = 0; i < 8; i++) fds[k++] = dial(a1);
    for (int i = 0; i < 8; i++) {
      fds[k] = dial(a1);
      unsigned char g[RPL_HS1_SIZE];
      memset(g, 0xee, sizeof g);
      send(fds[k++], g, sizeof g, MSG_NOSIGNAL);
    }
    for (int i = 0; i < 8; i++) {
      fds[k] = dial(a1);
      unsigned char hs1[RPL_HS1_SIZE], n[16] = {0};
      rpl_hs1_make(hs1, 0, 1, 2, id_of(a1), n);
      send(fds[k++], hs1, sizeof hs1, MSG_NOSIGNAL);
    }
    double took = 0;
    st = exchange(t0, t1, 4, 0x66, 64, &err, &took);
    CHECK(st == RPL_OK, "a run among strangers: %s", err.msg);
    CHECK(took < 2.0, "strangers delayed the run: %.2f s", took);
    rpl_tr_get_counters(t1, &c);
    CHECK(c.auth_failures >= 1 + 8, "garbage counted (%llu)", (unsigned long long)c.auth_failures);
    for (int i = 0; i < k; i++) close(fds[i]);
  }

  /* 4. A flood beyond the pending table: the oldest are dropped, runs go on. */
  {
    int fds[PEND_FLOOD];
    for (int i = 0; i < PEND_FLOOD; i++) fds[i] = dial(a1);
    double took = 0;
    st = exchange(t0, t1, 5, 0x77, 64, &err, &took);
    CHECK(st == RPL_OK && took < 2.0, "a run during a flood: %s (%.2f s)", err.msg, took);
    rpl_tr_get_counters(t1, &c);
    CHECK(c.handshakes_dropped > 0, "the flood was dropped (%llu)",
          (unsigned long long)c.handshakes_dropped);
    for (int i = 0; i < PEND_FLOOD; i++)
      if (fds[i] >= 0) close(fds[i]);
  }
  relay_stop(&rl);
  rpl_tr_destroy(t0);
  rpl_tr_destroy(t1);

  /* 6. A same-host peer on a ring: a newcomer holding the key and claiming to be it is
   * refused, though no socket link exists to call healthy, and the ring carries on. */
  {
    rpl_tr *s0, *s1;
    CHECK(rpl_tr_create(0, 2, "127.0.0.1", 0, &s0, &err) == RPL_OK, "%s", err.msg);
    CHECK(rpl_tr_create(1, 2, "127.0.0.1", 0, &s1, &err) == RPL_OK, "%s", err.msg);
    rpl_tr_set_key(s0, key);
    rpl_tr_set_key(s1, key);
    int local_of[2] = {0, 1};
    rpl_shm *m0 = NULL, *m1 = NULL;
    char n0[64], n1[64], b0[128], b1[128];
    CHECK(rpl_shm_create(0, 2, local_of, 5, 1 << 16, &m0, n0, sizeof n0, &err) == RPL_OK, "%s",
          err.msg);
    CHECK(rpl_shm_create(1, 2, local_of, 5, 1 << 16, &m1, n1, sizeof n1, &err) == RPL_OK, "%s",
          err.msg);
    CHECK(rpl_shm_attach(m0, 1, n1, &err) == RPL_OK && rpl_shm_attach(m1, 0, n0, &err) == RPL_OK,
          "%s", err.msg);
    rpl_tr_set_shm(s0, m0);
    rpl_tr_set_shm(s1, m1);
    rpl_tr_address(s0, b0, sizeof b0);
    rpl_tr_address(s1, b1, sizeof b1);
    rpl_tr_set_peer(s0, 1, b1, &err);
    rpl_tr_set_peer(s1, 0, b0, &err);
    bg g;
    bg_start(&g, s1, 7);
    int fd = newcomer(b1, key, "a newcomer for a ring peer");
    expect_refused(fd, &g, s0, 7, 0x55, "a newcomer for a ring peer");
    rpl_tr_get_counters(s1, &c);
    CHECK(c.replacements_refused == 1 && c.connections == 0,
          "the ring peer's slot was not handed over (refused %llu, connections %llu)",
          (unsigned long long)c.replacements_refused, (unsigned long long)c.connections);
    CHECK(strncmp(rpl_tr_peer_path(s1, 0), "shm", 3) == 0, "path %s", rpl_tr_peer_path(s1, 0));
    rpl_tr_destroy(s0);
    rpl_tr_destroy(s1);
  }

  /* 5. Another key: the connector fails naming the job secret; no link is made. */
  {
    rpl_tr *u0, *u1;
    rpl_tr_create(0, 2, "127.0.0.1", 0, &u0, &err);
    rpl_tr_create(1, 2, "127.0.0.1", 0, &u1, &err);
    rpl_tr_set_key(u0, key);
    rpl_tr_set_key(u1, other);
    char b0[128], b1[128];
    rpl_tr_address(u0, b0, sizeof b0);
    rpl_tr_address(u1, b1, sizeof b1);
    rpl_tr_set_peer(u0, 1, b1, &err);
    rpl_tr_set_peer(u1, 0, b0, &err);
    unsigned char out[8] = {1}, in[8];
    run_arg a = {.tr = u0, .x = xfer(1, 1, out, 8, 1)};
    run_arg b = {.tr = u1, .x = xfer(0, 0, in, 8, 1)};
    pthread_t ta, tb;
    double t = now_s();
    pthread_create(&tb, NULL, run_thread, &b);
    pthread_create(&ta, NULL, run_thread, &a);
    pthread_join(ta, NULL);
    rpl_tr_interrupt(u1); /* rank 1 would wait for a link that never comes */
    pthread_join(tb, NULL);
    CHECK(a.st == RPL_ERR_PEER && strstr(a.err.msg, "job secret"),
          "wrong key: %s (%s)", rpl_status_name(a.st), a.err.msg);
    CHECK(now_s() - t < DEADLINE_S / 2, "the wrong key is found at once");
    rpl_tr_counters cu;
    rpl_tr_get_counters(u1, &cu);
    CHECK(cu.connections == 0, "no link with a wrong key");
    rpl_tr_destroy(u0);
    rpl_tr_destroy(u1);
  }

  /* 8. On the path after the handshake: a relay changes one payload byte of the second
   * frame. A plain link delivers it changed; with authenticated frames the run fails naming
   * rank 0, and frames of every size before it pass. */
  for (int macs = 0; macs <= 1; macs++) {
    rpl_tr *f0, *f1;
    relay fr;
    relayed_pair(&f0, &f1, key, &fr);
    rpl_tr_set_frame_macs(f0, macs);
    rpl_tr_set_frame_macs(f1, macs);
    size_t first = 3 << 20; /* several reads and writes, and a whole trailer after them */
    size_t wire1 = RPL_HS1_SIZE + RPL_HS3_SIZE + 40 + first + (macs ? RPL_TR_FRAME_TAG : 0);
    fr.flip_at = (long)(wire1 + 40 + 10); /* byte 10 of the second frame's payload */
    st = exchange(f0, f1, 1, 0x33, first, &err, NULL);
    CHECK(st == RPL_OK, "macs %d: a %zu-byte frame: %s", macs, first, err.msg);
    for (uint64_t k = 0; k < 3 && macs; k++) { /* one more of each: empty, tiny, odd */
      static const size_t lens[3] = {0, 1, 4099};
      size_t before = fr.nfwd;
      fr.flip_at = -1;
      st = exchange(f0, f1, 2 + k, 0x44, lens[k], &err, NULL);
      CHECK(st == RPL_OK, "macs: a %zu-byte frame: %s", lens[k], err.msg);
      (void)before;
    }
    if (macs) fr.flip_at = (long)(fr.nfwd + 40 + 10);
    st = exchange(f0, f1, 9, 0x55, 64, &err, NULL);
    if (!macs)
      CHECK(st == RPL_ERR_MISMATCH && strstr(err.msg, "byte 10"),
            "a plain link delivers the changed byte: %s (%s)", rpl_status_name(st), err.msg);
    else
      CHECK(st == RPL_ERR_PEER && strstr(err.msg, "rank 0") && strstr(err.msg, "MAC"),
            "authenticated frames refuse the changed frame: %s (%s)", rpl_status_name(st),
            err.msg);
    relay_stop(&fr);
    rpl_tr_destroy(f0);
    rpl_tr_destroy(f1);
  }
  return report("link_auth");
}
