/*
 * test_shm_bounds.c - shared memory that a local peer controls is checked, never trusted
 * (csrc/shm.c; docs/design.md §8).
 *
 * Ring positions: a pair of real segments (rpl_shm_create + rpl_shm_attach, two ranks in this
 * process) whose head or tail is then overwritten as a process that can write the segment
 * could: more than the ring holds, going backwards, a tail past the head. The read, peek or
 * write moves nothing (reads are sized far beyond the ring, so an unchecked length would be a
 * wild memcpy that ASan reports), the pair stops being usable and rpl_shm_check_peer fails
 * with RPL_ERR_PEER naming the rank and the positions.
 *
 * Segments: attach refuses a segment whose mode is not 0600, whose owner is not our uid (run
 * as root, the test chowns one; otherwise that case is skipped and says so), whose size is
 * not the layout's, whose name is not rpl_shm_create's form for that rank, or whose header
 * does not carry the name's nonce, the rank, or the group size (segments linked under another
 * name in /dev/shm). Creation refuses an out-of-range ring size.
 *
 * End to end: the transport turns a corrupt ring into a failed run (RPL_ERR_PEER, the same
 * message), at once, through the rpl_shm_* calls it already makes.
 *
 * Where the ring positions sit is shm.c's private layout; the test finds them as shm.c lays
 * them out and first checks that the word it found holds what was written (a layout change
 * fails here, loudly, rather than testing nothing).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "shm.h"
#include "transport.h"

#define RING (64u * 1024u)
#define PAGE 4096u
#define RING_CTL 128u /* head, then tail 64 bytes later (shm.c's ring_ctl) */

typedef struct pair {
  rpl_shm *s[2];
  char name[2][96];
  unsigned char *seg[2]; /* our own extra mapping of each segment: "the other process" */
  size_t seg_bytes;
} pair;

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static void pair_open(pair *p, uint64_t nonce) {
  memset(p, 0, sizeof *p);
  int local_of[2] = {0, 1};
  rpl_error err;
  for (int r = 0; r < 2; r++)
    CHECK(rpl_shm_create(r, 2, local_of, nonce + (uint64_t)r, RING, &p->s[r], p->name[r],
                         sizeof p->name[r], &err) == RPL_OK,
          "create rank %d: %s", r, err.msg);
  CHECK(rpl_shm_attach(p->s[0], 1, p->name[1], &err) == RPL_OK, "attach 0->1: %s", err.msg);
  CHECK(rpl_shm_attach(p->s[1], 0, p->name[0], &err) == RPL_OK, "attach 1->0: %s", err.msg);
  /* Header: one page (it is far smaller); rings: control block + data, page-rounded. */
  p->seg_bytes = PAGE + 2 * round_up(RING_CTL + RING, PAGE);
  for (int r = 0; r < 2; r++) {
    int fd = shm_open(p->name[r], O_RDWR, 0);
    CHECK(fd >= 0, "shm_open %s: %s", p->name[r], strerror(errno));
    p->seg[r] = mmap(NULL, p->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHECK(p->seg[r] != MAP_FAILED, "mmap %s", p->name[r]);
    close(fd);
  }
}

static void pair_unmap(pair *p) {
  for (int r = 0; r < 2; r++)
    if (p->seg[r] && p->seg[r] != MAP_FAILED) munmap(p->seg[r], p->seg_bytes);
}

static void pair_close(pair *p) {
  pair_unmap(p);
  for (int r = 0; r < 2; r++) rpl_shm_destroy(p->s[r]);
}

/* The head (or tail) of the ring in `owner`'s segment that local rank `writer` sends into. */
static volatile uint64_t *pos_word(pair *p, int owner, int writer, int tail) {
  size_t off = PAGE + (size_t)writer * round_up(RING_CTL + RING, PAGE) + (tail ? 64 : 0);
  return (volatile uint64_t *)(p->seg[owner] + off);
}

static size_t send_bytes(rpl_shm *s, int peer, size_t n) {
  static unsigned char src[RING];
  memset(src, 0x5a, sizeof src);
  struct iovec iov = {src, n};
  return rpl_shm_write(s, peer, &iov, 1);
}

/* `s` must now refuse the pair with `peer`, with a message naming it as corrupt. */
static void check_corrupt(rpl_shm *s, int peer, const char *what) {
  rpl_error err;
  char cause[64];
  CHECK(!rpl_shm_usable(s, peer), "%s: the pair is still usable", what);
  CHECK(rpl_shm_peer_flagged(s, peer), "%s: the pair is not flagged", what);
  rpl_status st = rpl_shm_check_peer(s, peer, 1, 0, cause, sizeof cause, &err);
  char want[64];
  snprintf(want, sizeof want, "rank %d's shared-memory ring is corrupt: head ", peer);
  CHECK(st == RPL_ERR_PEER && strstr(err.msg, want) && strstr(err.msg, "ring 65536 bytes"),
        "%s: check_peer -> %d: %s", what, (int)st, st ? err.msg : "");
}

static unsigned char big[4 * RING]; /* reads sized far beyond the ring */

static void test_ring_positions(void) {
  pair p;
  /* A sane exchange first: what is written is read back; the layout is where we think. */
  pair_open(&p, 0x1000);
  CHECK(send_bytes(p.s[0], 1, 777) == 777, "write 777 bytes");
  CHECK(*pos_word(&p, 1, 0, 0) == 777, "ring layout changed: head is not where the test "
        "looks (update RING_CTL/PAGE here)");
  CHECK(rpl_shm_read(p.s[1], 0, big, sizeof big) == 777, "read 777 bytes back");
  CHECK(*pos_word(&p, 1, 0, 1) == 777, "ring layout changed: tail is not where the test looks");
  CHECK(rpl_shm_usable(p.s[1], 0) && !rpl_shm_peer_flagged(p.s[1], 0), "sane pair usable");

  /* 1. Head more than a ring ahead of the tail: read and peek move nothing. (Unchecked, the
   * read of 3 rings' worth would copy from past the end of the segment.) */
  *pos_word(&p, 1, 0, 0) = 777 + 3 * RING + 12345;
  CHECK(rpl_shm_read(p.s[1], 0, big, sizeof big) == 0, "read of a corrupt ring moved bytes");
  const void *d;
  CHECK(rpl_shm_peek(p.s[1], 0, &d, sizeof big) == 0, "peek of a corrupt ring moved bytes");
  check_corrupt(p.s[1], 0, "head beyond tail + ring");
  /* The other direction of the pair is untouched. */
  CHECK(rpl_shm_usable(p.s[0], 1), "the writer's view is still usable");
  pair_close(&p);

  /* 2. Head far below the tail (wraps to a huge length unsigned). */
  pair_open(&p, 0x2000);
  CHECK(send_bytes(p.s[0], 1, 100) == 100, "write 100");
  CHECK(rpl_shm_read(p.s[1], 0, big, 100) == 100, "read 100");
  *pos_word(&p, 1, 0, 0) = 3;
  CHECK(rpl_shm_peek(p.s[1], 0, &d, sizeof big) == 0, "peek with head below tail moved bytes");
  check_corrupt(p.s[1], 0, "head below tail");
  pair_close(&p);

  /* 3. Head going backwards but still at or above our tail: only monotonicity catches it. */
  pair_open(&p, 0x3000);
  CHECK(send_bytes(p.s[0], 1, 100) == 100, "write 100");
  CHECK(rpl_shm_read(p.s[1], 0, big, 40) == 40, "read 40");
  *pos_word(&p, 1, 0, 0) = 60;
  CHECK(rpl_shm_read(p.s[1], 0, big, sizeof big) == 0, "read with a head that went back");
  check_corrupt(p.s[1], 0, "head going backwards");
  pair_close(&p);

  /* 4. The tail of the ring we write, moved past our head by its owner: no write. */
  pair_open(&p, 0x4000);
  CHECK(send_bytes(p.s[0], 1, 100) == 100, "write 100");
  *pos_word(&p, 1, 0, 1) = 100 + 5;
  CHECK(send_bytes(p.s[0], 1, RING) == 0, "write with a tail past the head moved bytes");
  check_corrupt(p.s[0], 1, "tail past head");
  pair_close(&p);

  /* 5. A tail going backwards: the space it claims would overwrite unread bytes. */
  pair_open(&p, 0x5000);
  CHECK(send_bytes(p.s[0], 1, 100) == 100, "write 100");
  CHECK(rpl_shm_read(p.s[1], 0, big, 100) == 100, "read 100");
  CHECK(send_bytes(p.s[0], 1, 10) == 10, "write 10 (sees tail 100)");
  *pos_word(&p, 1, 0, 1) = 50;
  CHECK(send_bytes(p.s[0], 1, 10) == 0, "write with a tail that went back moved bytes");
  check_corrupt(p.s[0], 1, "tail going backwards");
  pair_close(&p);

  /* 6. No false alarm: a long sane exchange, wrapping the ring many times, stays usable. */
  pair_open(&p, 0x6000);
  size_t total = 0;
  for (int i = 0; i < 200; i++) {
    size_t w = send_bytes(p.s[0], 1, 40000);
    size_t r = rpl_shm_read(p.s[1], 0, big, sizeof big);
    CHECK(w == r, "round %d: wrote %zu read %zu", i, w, r);
    total += r;
  }
  CHECK(total == 200u * 40000u && rpl_shm_usable(p.s[1], 0) && rpl_shm_usable(p.s[0], 1),
        "a long sane exchange: %zu bytes, pair usable", total);
  pair_close(&p);
}

/* Attaching `name` as rank `peer` of `s` must fail naming the peer and `reason`. */
static void check_refused(rpl_shm *s, int peer, const char *name, const char *reason,
                          const char *what) {
  rpl_error err;
  rpl_status st = rpl_shm_attach(s, peer, name, &err);
  char want[48];
  snprintf(want, sizeof want, "rank %d's shared memory segment", peer);
  CHECK(st == RPL_ERR_PEER && strstr(err.msg, want) && strstr(err.msg, reason),
        "%s: attach -> %d: %s (want '%s')", what, (int)st, st ? err.msg : "", reason);
}

/* A hard link to segment `name` under another name, in the directory glibc's shm_open uses. */
static int link_as(const char *name, const char *alias) {
  char a[160], b[160];
  snprintf(a, sizeof a, "/dev/shm%s", name);
  snprintf(b, sizeof b, "/dev/shm%s", alias);
  return link(a, b);
}

static void unlink_alias(const char *alias) {
  char b[160];
  snprintf(b, sizeof b, "/dev/shm%s", alias);
  unlink(b);
}

static void test_attach_checks(void) {
  int local3[3] = {0, 1, 2};
  rpl_error err;
  rpl_shm *s[3];
  char name[3][96];
  for (int r = 0; r < 3; r++)
    CHECK(rpl_shm_create(r, 3, local3, 0xabc000 + (uint64_t)r, RING, &s[r], name[r],
                         sizeof name[r], &err) == RPL_OK, "create %d: %s", r, err.msg);
  struct stat st;
  char path[160];
  snprintf(path, sizeof path, "/dev/shm%s", name[1]);
  CHECK(stat(path, &st) == 0 && (st.st_mode & 07777) == 0600, "own segment is created 0600");

  /* Names: not our form, or our form for another rank. */
  check_refused(s[0], 1, "/etc-passwd", "is not /ripples-<pid>-<nonce>-1", "foreign name");
  check_refused(s[0], 1, name[2], "is not /ripples-<pid>-<nonce>-1", "another rank's name");
  char sloppy[120];
  snprintf(sloppy, sizeof sloppy, "%s ", name[1]);
  check_refused(s[0], 1, sloppy, "is not /ripples-", "trailing junk in the name");

  /* Header vs name: rank 2's segment linked under a rank-1 name with its own nonce and pid
   * (the header's rank is wrong), and rank 1's under a name with another nonce. */
  unsigned pid = (unsigned)getpid();
  char alias_rank[96], alias_nonce[96];
  snprintf(alias_rank, sizeof alias_rank, "/ripples-%u-%016" PRIx64 "-1", pid,
           (uint64_t)0xabc002);
  snprintf(alias_nonce, sizeof alias_nonce, "/ripples-%u-%016" PRIx64 "-1", pid,
           (uint64_t)0xdead);
  CHECK(link_as(name[2], alias_rank) == 0, "link: %s", strerror(errno));
  CHECK(link_as(name[1], alias_nonce) == 0, "link: %s", strerror(errno));
  check_refused(s[0], 1, alias_rank, "its header names rank 2 of a group of 3, not rank 1 of 3",
                "header rank");
  check_refused(s[0], 1, alias_nonce, "does not match its name", "header nonce");
  unlink_alias(alias_rank);
  unlink_alias(alias_nonce);

  /* File: mode 0644, then a size that is not the layout's, then (as root) another owner. */
  int fd = shm_open(name[1], O_RDWR, 0);
  CHECK(fd >= 0, "shm_open: %s", strerror(errno));
  CHECK(fchmod(fd, 0644) == 0, "fchmod");
  check_refused(s[0], 1, name[1], "its mode is 0644, not 0600", "mode 0644");
  CHECK(fchmod(fd, 0600) == 0, "fchmod back");
  CHECK(fstat(fd, &st) == 0, "fstat");
  CHECK(ftruncate(fd, st.st_size + PAGE) == 0, "grow");
  check_refused(s[0], 1, name[1], "its size is", "grown segment");
  CHECK(ftruncate(fd, st.st_size) == 0, "shrink back");
  if (geteuid() == 0) {
    CHECK(fchown(fd, 4242, (gid_t)-1) == 0, "fchown: %s", strerror(errno));
    check_refused(s[0], 1, name[1], "owned by uid 4242, not by this process's uid 0",
                  "foreign owner");
    CHECK(fchown(fd, 0, (gid_t)-1) == 0, "fchown back");
  } else {
    printf("shm_bounds: not root, the foreign-owner case is skipped\n");
  }
  close(fd);
  /* Restored, it attaches. */
  CHECK(rpl_shm_attach(s[0], 1, name[1], &err) == RPL_OK, "restored segment: %s", err.msg);

  /* Group size: a segment of rank 1 in a group of 3 (rank 2 elsewhere, so the same two local
   * rings) offered to a group of 2. */
  int local_a[3] = {0, 1, -1}, local_b[2] = {0, 1};
  rpl_shm *g3, *g2;
  char n3[96], n2[96];
  CHECK(rpl_shm_create(1, 3, local_a, 0x77, RING, &g3, n3, sizeof n3, &err) == RPL_OK,
        "create: %s", err.msg);
  CHECK(rpl_shm_create(0, 2, local_b, 0x78, RING, &g2, n2, sizeof n2, &err) == RPL_OK,
        "create: %s", err.msg);
  check_refused(g2, 1, n3, "its header names rank 1 of a group of 3, not rank 1 of 2",
                "group size");
  rpl_shm_destroy(g3);
  rpl_shm_destroy(g2);

  /* Ring sizes out of range. */
  rpl_shm *x = NULL;
  char nx[96];
  CHECK(rpl_shm_create(0, 2, local_b, 1, 0, &x, nx, sizeof nx, &err) == RPL_ERR_INVALID && !x,
        "ring of 0 bytes accepted");
  CHECK(rpl_shm_create(0, 2, local_b, 1, RPL_SHM_MAX_RING + 1, &x, nx, sizeof nx, &err) ==
            RPL_ERR_INVALID && !x, "ring over the limit accepted");
  for (int r = 0; r < 3; r++) rpl_shm_destroy(s[r]);
}

/* Two transports over a pair of rings (ranks 0 and 1 in this process). Rank 1 receives from
 * rank 0 with an impossible head in its ring; then rank 0 sends to rank 1 with an impossible
 * tail in the ring it writes. Each run fails with the corrupt-ring error, well before its
 * deadline. */
static void test_transport_fails(void) {
  for (int dir = 0; dir < 2; dir++) {
    pair p;
    pair_open(&p, 0x7000 + (uint64_t)dir * 0x10);
    rpl_tr *tr[2];
    char addr[2][64];
    rpl_error err;
    for (int r = 0; r < 2; r++) {
      CHECK(rpl_tr_create(r, 2, "127.0.0.1", 0, &tr[r], &err) == RPL_OK, "tr: %s", err.msg);
      rpl_tr_address(tr[r], addr[r], sizeof addr[r]);
    }
    for (int r = 0; r < 2; r++) {
      CHECK(rpl_tr_set_peer(tr[r], 1 - r, addr[1 - r], &err) == RPL_OK, "peer: %s", err.msg);
      rpl_tr_set_shm(tr[r], p.s[r]); /* owned by the transport from here */
    }
    int me = dir == 0 ? 1 : 0, peer = 1 - me;
    if (dir == 0) *pos_word(&p, 1, 0, 0) = 5 * (uint64_t)RING; /* head, ring 0 -> 1 */
    else *pos_word(&p, 1, 0, 1) = 12345;                         /* tail past head 0 */
    unsigned char buf[16] = {0};
    rpl_xfer x;
    memset(&x, 0, sizeof x);
    x.peer = peer;
    x.is_send = dir == 1;
    x.buf = buf;
    x.len = sizeof buf;
    x.meta.op = RPL_OP_BROADCAST;
    x.meta.dtype = RPL_UINT8;
    x.meta.tag = 1;
    x.meta.seq = 1;
    x.meta.count = sizeof buf;
    double t0 = now_s();
    rpl_status st = rpl_tr_run(tr[me], &x, 1, t0 + 20.0, &err);
    double took = now_s() - t0;
    char want[64];
    snprintf(want, sizeof want, "rank %d's shared-memory ring is corrupt", peer);
    CHECK(st == RPL_ERR_PEER && strstr(err.msg, want), "%s through the transport -> %d: %s",
          dir == 0 ? "receive" : "send", (int)st, st ? err.msg : "");
    CHECK(took < 2.0, "the corrupt ring took %.2f s to fail the run", took);
    pair_unmap(&p);
    rpl_tr_destroy(tr[0]);
    rpl_tr_destroy(tr[1]);
  }
}

int main(void) {
  test_ring_positions();
  test_transport_fails();
  test_attach_checks();
  return report("shm_bounds");
}
