/* shm.c - shared-memory rings between ranks of one host (see shm.h).
 *
 * What a peer controls is checked, never trusted (docs/design.md §8): a local process that can
 * write a segment can write any of its bytes.
 * - Ring positions. The positions this rank advances (the head of the ring it writes, the tail
 *   of the ring it reads) live in its own struct and are only copied out to shared memory. The
 *   peer's position is checked on every read of it, one comparison (see ring_ok): a ring never
 *   holds more than ring_bytes nor goes backwards. A violation makes the ring look empty/full
 *   and is recorded here, outside shared memory: rpl_shm_usable says no, rpl_shm_peer_flagged
 *   says yes, and rpl_shm_check_peer fails with RPL_ERR_PEER, so the transport fails the
 *   collective on its next wait through the calls it already makes. No copy ever uses an
 *   unchecked length or offset.
 * - Segments. A segment is mapped only if the name published for a rank has our form for that
 *   rank, the object is a regular file owned by our effective uid with mode exactly 0600 and
 *   the size this layout gives, and its header carries the nonce and pid of its name, that
 *   rank and our group size (see rpl_shm_attach).
 * - Randomness: the process token comes from the kernel's CSPRNG, or creation fails. */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "crypto.h"

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define SEG_MAGIC 0x35474553504c52ull /* "RLPSEG5" */
#define SEG_MODE 0600
#define PAGE 4096u
#define SPIN_LONG 2000 /* about 50 us of pause instructions */
#define SPIN_SHORT 200
#define CAUSE_LEN 320 /* bytes of a rank's cause kept in its segment */
/* A pair's state after failures, one slot per local peer in each side's segment, each slot
 * written only by the segment's owner (so a peer can never undo what this rank says):
 *   brk      how many times the owner broke the pair (gave up on its streams mid-message);
 *   quiet    the pair epoch at which the owner's link to the peer is closed: it writes no
 *            byte of an older epoch's streams again;
 *   drained  the pair epoch at which the owner discarded what its ring from the peer held.
 * The pair epoch is the sum of both sides' brk. A side drains once the other is quiet at the
 * epoch, and writes again only once both have drained it: every byte left over from a failed
 * exchange is thrown away, none written afterwards is. The pair is usable when quiet, drained
 * and the peer's drained all equal the epoch (initially all 0). See rpl_shm_rearm. */
typedef struct pair_slot {
  uint32_t brk, quiet, drained, pad;
} pair_slot;

/* The first page of a segment. Fields written by other processes are accessed with atomics. */
typedef struct seg_header {
  uint64_t magic;
  uint64_t nonce;
  uint64_t ring_bytes;
  uint64_t process;  /* the owner process's token (see process_token) */
  uint64_t self_addr; /* where the owner mapped this segment: the single-copy probe reads it */
  uint32_t nlocal;
  uint32_t pid;      /* for messages only: it means nothing in another pid namespace */
  uint32_t doorbell; /* futex word: rung by anyone who gives this rank something to do */
  uint32_t sleeping; /* the owner is (about to be) in futex_wait */
  uint32_t closed;   /* the owner aborted or shut down */
  uint32_t locked;   /* the owner holds its liveness lock (see take_lock) */
  uint32_t cause_seq; /* seqlock over cause: odd while the owner rewrites it */
  uint32_t rank;     /* the owner's rank and its group's size, checked at attach */
  uint32_t size;
  uint32_t pad;
  char cause[CAUSE_LEN]; /* why the owner last gave up on its links, "" if never */
  pair_slot pair[];      /* per local peer (see pair_slot) */
} seg_header;

/* Control block in front of every ring; head and tail on their own cache lines. */
typedef struct ring_ctl {
  uint64_t head; /* bytes ever written (by the peer that sends into this ring) */
  char pad1[56];
  uint64_t tail; /* bytes ever consumed (by the segment's owner) */
  char pad2[56];
} ring_ctl;

/* This rank's view of the rings with one peer: the positions only it advances (the copies in
 * shared memory are written from these, never read back) and the peer's as last checked. */
typedef struct ring_pos {
  uint64_t rx_tail, rx_head; /* the ring the peer writes into (in our segment) */
  uint64_t tx_head, tx_tail; /* the ring we write into (in the peer's segment) */
  int bad;                   /* 0, or which ring failed its check (BAD_RX / BAD_TX) */
  uint64_t bad_head, bad_tail;
  uint32_t my_brk, peer_brk; /* both sides' brk when the pair was last armed (error messages) */
} ring_pos;
enum { BAD_RX = 1, BAD_TX = 2 };

struct rpl_shm {
  int rank, size, me; /* me: our local index */
  int nlocal;
  int *local_of;
  size_t ring_bytes, ring_stride, header_bytes, seg_bytes;
  char name[64];
  int linked;
  int lock_fd;           /* the anchor's segment, where every local rank holds its lock */
  int own_fd;            /* our segment, locked (byte 0) while we live; -1 for the anchor */
  unsigned char *mine;   /* our segment */
  unsigned char **peer;  /* peers' segments by rank, NULL if not mapped */
  pid_t *peer_pid;       /* by rank: a pid that reads that peer's memory, 0 if none does */
  ring_pos *pos;         /* by rank */
  int spins;             /* polls of the doorbell before sleeping on it (rpl_shm_wait) */
};

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static seg_header *hdr(unsigned char *seg) { return (seg_header *)seg; }

static ring_ctl *ring_at(const rpl_shm *s, unsigned char *seg, int idx) {
  return (ring_ctl *)(seg + s->header_bytes + (size_t)idx * s->ring_stride);
}

static unsigned char *ring_data(ring_ctl *r) { return (unsigned char *)(r + 1); }

/* Liveness. Every local rank holds a POSIX record lock on one byte (its local index) of the
 * anchor's segment (local index 0's) until it ends; a peer asks the kernel (F_GETLK) whether
 * someone still holds the byte. The kernel drops a process's record locks when it closes its
 * files during exit, before the process becomes a zombie: a SIGKILLed rank whose parent has not
 * reaped it reads as dead (kill(pid, 0) still succeeds on a zombie, and pidfd_open would need
 * the pid to mean the same in both pid namespaces). The lock lives on the file, so it works
 * across pid namespaces (ranks that share /dev/shm but not pids), a recycled pid cannot make a
 * dead rank look alive, and a child forked by the rank (a data loader) does not inherit it.
 * One shared file: one descriptor per communicator, however many local peers. Two limits,
 * both only hiding a death, never inventing one: F_GETLK does not report the caller's own
 * locks, so peers in this process (ranks as threads, in the C tests) are not probed; and a
 * process drops its locks on a file when it closes any descriptor of it, so the anchor's
 * segment stays open once, in lock_fd, until rpl_shm_destroy. */
static struct flock lock_byte(short type, int local) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = local;
  fl.l_len = 1;
  return fl;
}

/* Keeps `fd` (the anchor's segment) and locks our byte in it. Without the lock (a filesystem
 * without record locks) peers fall back to the closed flag and the timeout. */
static void take_lock(rpl_shm *s, int fd) {
  s->lock_fd = fd;
  struct flock fl = lock_byte(F_WRLCK, s->me);
  if (fcntl(fd, F_SETLK, &fl) == 0)
    __atomic_store_n(&hdr(s->mine)->locked, 1, __ATOMIC_RELEASE);
}

/* Tells processes apart (pids do not across namespaces): random per process (the kernel's
 * CSPRNG, no weaker fallback), different in a forked child because the pid is mixed in. */
static uint64_t process_seed;
static rpl_status seed_status;
static rpl_error seed_err;
static void draw_seed(void) {
  seed_status = rpl_random_bytes(&process_seed, sizeof process_seed, &seed_err);
}
static rpl_status process_token(uint64_t *out, rpl_error *err) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, draw_seed);
  if (seed_status != RPL_OK) {
    if (err) *err = seed_err;
    return seed_status;
  }
  *out = (process_seed ^ (uint64_t)getpid() * 0xff51afd7ed558ccdull) | 1u;
  return RPL_OK;
}

/* A ring position read from shared memory is valid when it lies in [seen, limit], where
 * `seen` is the value last checked and `limit - seen` is at most the ring's size: the head of
 * a ring we read is in [last head, our tail + ring_bytes], the tail of a ring we write is in
 * [last tail, our head]. One unsigned comparison: a value below `seen` wraps to a huge
 * difference. */
static inline int ring_ok(uint64_t got, uint64_t seen, uint64_t limit) {
  return got - seen <= limit - seen;
}

/* Records that the ring with `peer` failed its check (first failure kept). Returns 0, what the
 * caller returns as "nothing moved"; the transport then fails the run on its next wait (see
 * the top of this file). */
__attribute__((cold, noinline)) static size_t ring_corrupt(rpl_shm *s, int peer, int which,
                                                           uint64_t head, uint64_t tail) {
  ring_pos *q = &s->pos[peer];
  if (!q->bad) {
    __atomic_store_n(&q->bad, which, __ATOMIC_RELAXED); /* rpl_shm_path reads it */
    q->bad_head = head;
    q->bad_tail = tail;
  }
  return 0;
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

static void ring_bell(unsigned char *seg) {
  seg_header *h = hdr(seg);
  __atomic_fetch_add(&h->doorbell, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&h->sleeping, __ATOMIC_SEQ_CST)) futex(&h->doorbell, FUTEX_WAKE, 1, NULL);
}

/* The object and its per-rank tables, before any segment exists. */
static rpl_status shm_alloc(int rank, int size, const int *local_of, rpl_shm **out,
                            rpl_error *err) {
  rpl_shm *s = calloc(1, sizeof *s);
  if (!s) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory for shared-memory transport");
  s->rank = rank;
  s->size = size;
  s->lock_fd = -1;
  s->own_fd = -1;
  s->local_of = malloc(sizeof(int) * (size_t)size);
  s->peer = calloc((size_t)size, sizeof *s->peer);
  s->peer_pid = calloc((size_t)size, sizeof *s->peer_pid);
  s->pos = calloc((size_t)size, sizeof *s->pos);
  if (!s->local_of || !s->peer || !s->peer_pid || !s->pos) {
    rpl_shm_destroy(s);
    return rpl_fail(err, RPL_ERR_NOMEM, "out of memory for shared-memory transport");
  }
  for (int r = 0; r < size; r++) {
    s->local_of[r] = local_of[r];
    if (local_of[r] >= 0) s->nlocal++;
  }
  s->me = local_of[rank];
  *out = s;
  return RPL_OK;
}

/* The segment's layout (a header page, then one ring per local rank) and the spin budget. */
static void plan_layout(rpl_shm *s, size_t ring_bytes) {
  /* Spinning pays while every local rank has a core to itself; oversubscribed, it would take
   * the core from the very peer being waited for. */
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  s->spins = cpus >= s->nlocal ? SPIN_LONG : SPIN_SHORT;
  s->ring_bytes = ring_bytes;
  s->ring_stride = round_up(sizeof(ring_ctl) + ring_bytes, PAGE);
  s->header_bytes = round_up(sizeof(seg_header) + sizeof(pair_slot) * (size_t)s->nlocal, PAGE);
  s->seg_bytes = s->header_bytes + s->ring_stride * (size_t)s->nlocal;
}

/* Creates, sizes and maps our segment (s->mine); *fd stays open for the caller. On failure
 * the caller destroys s, which unlinks the name once created. */
static rpl_status map_segment(rpl_shm *s, uint64_t nonce, int *fd_out, rpl_error *err) {
  snprintf(s->name, sizeof s->name, "/ripples-%d-%016" PRIx64 "-%d", (int)getpid(), nonce,
           s->rank);
  int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, SEG_MODE);
  if (fd < 0)
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, errno, "cannot create shared memory segment");
  s->linked = 1;
  /* Exactly 0600 whatever the umask: peers refuse any other mode (see rpl_shm_attach). */
  if (fchmod(fd, SEG_MODE) != 0 || ftruncate(fd, (off_t)s->seg_bytes) != 0) {
    int e = errno;
    close(fd);
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, e,
                          "cannot size a %zu-byte shared memory segment (is /dev/shm full?)",
                          s->seg_bytes);
  }
  void *p = mmap(NULL, s->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, e, "cannot map shared memory");
  }
  s->mine = p;
  *fd_out = fd;
  return RPL_OK;
}

/* Fills our segment's header, takes our liveness lock, and publishes the magic last. */
static void publish_header(rpl_shm *s, uint64_t nonce, uint64_t token, int fd) {
  seg_header *h = hdr(s->mine);
  h->nonce = nonce;
  h->ring_bytes = s->ring_bytes;
  h->nlocal = (uint32_t)s->nlocal;
  h->pid = (uint32_t)getpid();
  h->process = token;
  h->self_addr = (uint64_t)(uintptr_t)s->mine;
  h->rank = (uint32_t)s->rank;
  h->size = (uint32_t)s->size;
  if (s->me == 0) {
    take_lock(s, fd); /* byte 0 of our own segment: the anchor's liveness byte is ours */
  } else {
    /* Byte 0 of our own segment says we live to whoever finds the segment left behind (the
     * sweep of ripples_pg/backend/_incarnation.py), whatever pid namespace it is in. */
    struct flock fl = lock_byte(F_WRLCK, 0);
    s->own_fd = fd;
    (void)fcntl(fd, F_SETLK, &fl); /* without record locks, the sweep goes by pid alone */
  }
  __atomic_store_n(&h->magic, SEG_MAGIC, __ATOMIC_RELEASE);
}

rpl_status rpl_shm_create(int rank, int size, const int *local_of, uint64_t nonce,
                          size_t ring_bytes, rpl_shm **out, char *name, size_t cap,
                          rpl_error *err) {
  *out = NULL;
  rpl_shm *s = NULL;
  rpl_status st = shm_alloc(rank, size, local_of, &s, err);
  if (st != RPL_OK) return st;
  uint64_t token = 0;
  int fd = -1;
  if (ring_bytes == 0 || ring_bytes > RPL_SHM_MAX_RING)
    st = rpl_fail(err, RPL_ERR_INVALID,
                  "shared-memory ring size %zu is out of range (1 byte to %zu bytes)",
                  ring_bytes, (size_t)RPL_SHM_MAX_RING);
  else
    st = process_token(&token, err);
  if (st == RPL_OK) {
    plan_layout(s, ring_bytes);
    st = map_segment(s, nonce, &fd, err);
  }
  if (st != RPL_OK) {
    rpl_shm_destroy(s);
    return st;
  }
  publish_header(s, nonce, token, fd);
  snprintf(name, cap, "%s", s->name);
  *out = s;
  return RPL_OK;
}

/* Single copy. process_vm_readv needs the peer's pid as this process sees it and the right
 * to read its memory (same user, ptrace policy, seccomp): the segment header records the
 * owner's pid and where the owner mapped the segment, so reading those bytes through the
 * peer's pid must give back what our own mapping shows. A pid from another pid namespace (or
 * reused by another process), or a refusal, fails the comparison: the pair keeps the rings. */
static pid_t probe_single_copy(const seg_header *h) {
  unsigned char got[40];
  struct iovec local = {got, sizeof got}, remote = {(void *)(uintptr_t)h->self_addr, sizeof got};
  pid_t pid = (pid_t)h->pid;
  if (pid <= 0 || process_vm_readv(pid, &local, 1, &remote, 1, 0) != (ssize_t)sizeof got)
    return 0;
  return memcmp(got, h, sizeof got) == 0 ? pid : 0;
}

/* Parses a segment name as rpl_shm_create writes it ("/ripples-<pid>-<nonce>-<rank>", in
 * exactly that spelling); 0 if it is not one. */
static int parse_name(const char *name, unsigned *pid, uint64_t *nonce, int *rank) {
  char again[64];
  int used = 0;
  if (sscanf(name, "/ripples-%u-%16" SCNx64 "-%d%n", pid, nonce, rank, &used) != 3 ||
      name[used] != '\0')
    return 0;
  snprintf(again, sizeof again, "/ripples-%d-%016" PRIx64 "-%d", (int)*pid, *nonce, *rank);
  return strcmp(again, name) == 0;
}

/* Why the open segment `fd` is refused, or NULL: a regular shared-memory object, owned by our
 * effective uid, mode exactly 0600, of the size our layout gives. The uid check is what stops
 * a local user who can write the c10d store from pointing us at a segment of theirs; the mode
 * check refuses a segment others could write. */
static const char *refuse_file(const rpl_shm *s, int fd, char *why, size_t cap) {
  struct stat st;
  if (fstat(fd, &st) != 0) return "it cannot be examined (fstat failed)";
  if (!S_ISREG(st.st_mode)) return "it is not a regular shared-memory object";
  if (st.st_uid != geteuid()) {
    snprintf(why, cap, "it is owned by uid %u, not by this process's uid %u",
             (unsigned)st.st_uid, (unsigned)geteuid());
    return why;
  }
  if ((st.st_mode & 07777) != SEG_MODE) {
    snprintf(why, cap, "its mode is %04o, not %04o", (unsigned)(st.st_mode & 07777), SEG_MODE);
    return why;
  }
  if (st.st_size < 0 || (uint64_t)st.st_size != (uint64_t)s->seg_bytes) {
    snprintf(why, cap, "its size is %lld bytes, not the %zu this group's layout gives",
             (long long)st.st_size, s->seg_bytes);
    return why;
  }
  return NULL;
}

/* Why the mapped header `h` is refused, or NULL: it must carry our layout (magic, ring size,
 * local ranks), the nonce and pid of the name it was found under, the peer's rank and our
 * group's size. */
static const char *refuse_header(const rpl_shm *s, const seg_header *h, int peer, unsigned pid,
                                 uint64_t nonce, char *why, size_t cap) {
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SEG_MAGIC)
    return "it is not a ripples segment of this version (wrong magic)";
  if (h->ring_bytes != s->ring_bytes || h->nlocal != (uint32_t)s->nlocal) {
    snprintf(why, cap, "its layout (ring %" PRIu64 " bytes, %u local ranks) is not this rank's "
             "(ring %zu bytes, %d local ranks)", h->ring_bytes, h->nlocal, s->ring_bytes,
             s->nlocal);
    return why;
  }
  if (h->nonce != nonce || h->pid != pid) {
    snprintf(why, cap, "its header (nonce %016" PRIx64 ", pid %u) does not match its name",
             h->nonce, h->pid);
    return why;
  }
  if (h->rank != (uint32_t)peer || h->size != (uint32_t)s->size) {
    snprintf(why, cap, "its header names rank %u of a group of %u, not rank %d of %d", h->rank,
             h->size, peer, s->size);
    return why;
  }
  return NULL;
}

rpl_status rpl_shm_attach(rpl_shm *s, int peer, const char *name, rpl_error *err) {
  unsigned pid;
  uint64_t nonce;
  int named;
  if (!parse_name(name, &pid, &nonce, &named) || named != peer)
    return rpl_fail(err, RPL_ERR_PEER, "rank %d's shared memory segment is refused: the name "
                    "published for it (%.80s) is not /ripples-<pid>-<nonce>-%d", peer, name,
                    peer);
  int fd = shm_open(name, O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0)
    return rpl_fail_errno(err, RPL_ERR_PEER, errno,
                          "cannot open rank %d's shared memory segment %s", peer, name);
  char why[160];
  const char *bad = refuse_file(s, fd, why, sizeof why);
  if (bad) {
    close(fd);
    return rpl_fail(err, RPL_ERR_PEER, "rank %d's shared memory segment %s is refused: %s",
                    peer, name, bad);
  }
  void *p = mmap(NULL, s->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    return rpl_fail_errno(err, RPL_ERR_PEER, e, "cannot map rank %d's shared memory segment %s",
                          peer, name);
  }
  seg_header *h = hdr(p);
  if ((bad = refuse_header(s, h, peer, pid, nonce, why, sizeof why)) != NULL) {
    munmap(p, s->seg_bytes);
    close(fd);
    return rpl_fail(err, RPL_ERR_PEER, "rank %d's shared memory segment %s is refused: %s",
                    peer, name, bad);
  }
  s->peer[peer] = p;
  s->peer_pid[peer] = probe_single_copy(h);
  if (s->local_of[peer] == 0 && s->lock_fd < 0) take_lock(s, fd);
  else close(fd);
  return RPL_OK;
}

void rpl_shm_unlink(rpl_shm *s) {
  if (s && s->linked) shm_unlink(s->name);
  if (s) s->linked = 0;
}

void rpl_shm_destroy(rpl_shm *s) {
  if (!s) return;
  rpl_shm_unlink(s);
  if (s->peer)
    for (int r = 0; r < s->size; r++)
      if (s->peer[r]) munmap(s->peer[r], s->seg_bytes);
  if (s->mine) munmap(s->mine, s->seg_bytes);
  if (s->lock_fd >= 0) close(s->lock_fd); /* drops our lock: peers still waiting see us gone */
  if (s->own_fd >= 0) close(s->own_fd);
  free(s->peer);
  free(s->peer_pid);
  free(s->pos);
  free(s->local_of);
  free(s);
}

static pair_slot *my_slot(const rpl_shm *s, int peer) {
  return &hdr(s->mine)->pair[s->local_of[peer]];
}

static pair_slot *peer_slot(const rpl_shm *s, int peer) {
  return &hdr(s->peer[peer])->pair[s->me];
}

static uint32_t ld(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

/* The pair epoch (see pair_slot). */
static uint32_t pair_epoch(const rpl_shm *s, int peer) {
  return ld(&my_slot(s, peer)->brk) + ld(&peer_slot(s, peer)->brk);
}

/* Armed at the current epoch: both sides drained it and this side is quiet at it. */
static int pair_armed(const rpl_shm *s, int peer) {
  const pair_slot *m = my_slot(s, peer), *o = peer_slot(s, peer);
  uint32_t od = ld(&o->drained), e = pair_epoch(s, peer);
  return ld(&m->quiet) == e && ld(&m->drained) == e && od == e;
}

int rpl_shm_usable(const rpl_shm *s, int peer) {
  if (!s || !s->peer[peer] || __atomic_load_n(&s->pos[peer].bad, __ATOMIC_RELAXED)) return 0;
  return pair_armed(s, peer);
}

rpl_shm_pair rpl_shm_rearm(rpl_shm *s, int peer) {
  if (!s || !s->peer[peer] || s->pos[peer].bad) return RPL_SHM_NONE;
  pair_slot *m = my_slot(s, peer);
  const pair_slot *o = peer_slot(s, peer);
  /* The peer's slot first: an epoch computed after it covers every break it had seen. */
  uint32_t oq = ld(&o->quiet), od = ld(&o->drained), e = pair_epoch(s, peer);
  if (ld(&m->quiet) != e) { /* our caller's link is closed: nothing older leaves this side */
    __atomic_store_n(&m->quiet, e, __ATOMIC_RELEASE);
    ring_bell(s->peer[peer]);
  }
  if (oq == e && ld(&m->drained) != e) {
    /* The peer writes nothing of an older epoch any more, and nothing new until we say we
     * drained: everything in the ring now is left over. */
    ring_ctl *r = ring_at(s, s->mine, s->local_of[peer]);
    ring_pos *q = &s->pos[peer];
    uint64_t head = __atomic_load_n(&r->head, __ATOMIC_ACQUIRE);
    if (!ring_ok(head, q->rx_head, q->rx_tail + s->ring_bytes)) {
      ring_corrupt(s, peer, BAD_RX, head, q->rx_tail);
      return RPL_SHM_NONE;
    }
    q->rx_head = q->rx_tail = head;
    __atomic_store_n(&r->tail, head, __ATOMIC_RELEASE);
    __atomic_store_n(&m->drained, e, __ATOMIC_RELEASE);
    ring_bell(s->peer[peer]);
  }
  if (!pair_armed(s, peer) || od != e) return RPL_SHM_REARMING;
  s->pos[peer].my_brk = ld(&m->brk);
  s->pos[peer].peer_brk = ld(&o->brk);
  return RPL_SHM_READY;
}

int rpl_shm_has_ring(const rpl_shm *s, int peer) {
  return s && peer >= 0 && peer < s->size && s->peer[peer] &&
         !__atomic_load_n(&s->pos[peer].bad, __ATOMIC_RELAXED);
}

const char *rpl_shm_path(const rpl_shm *s, int peer) {
  if (!s || peer < 0 || peer >= s->size || !s->peer[peer]) return NULL;
  if (__atomic_load_n(&s->pos[peer].bad, __ATOMIC_RELAXED)) return "tcp";
  if (__atomic_load_n(&hdr(s->peer[peer])->closed, __ATOMIC_ACQUIRE)) return "closed";
  if (rpl_shm_peer_dead(s, peer)) return "dead"; /* one fcntl: stats only */
  if (!pair_armed(s, peer)) return "shm-resuming";
  return s->peer_pid[peer] > 0 ? "shm+single-copy" : "shm";
}

size_t rpl_shm_write(rpl_shm *s, int peer, const struct iovec *iov, int niov) {
  unsigned char *seg = s->peer[peer];
  ring_ctl *r = ring_at(s, seg, s->me);
  ring_pos *q = &s->pos[peer];
  uint64_t head = q->tx_head; /* ours; the copy in shared memory is never read back */
  uint64_t tail = __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE);
  if (__builtin_expect(!ring_ok(tail, q->tx_tail, head), 0))
    return ring_corrupt(s, peer, BAD_TX, head, tail);
  q->tx_tail = tail;
  size_t space = s->ring_bytes - (size_t)(head - tail), moved = 0;
  unsigned char *data = ring_data(r);
  for (int i = 0; i < niov && space > 0; i++) {
    size_t n = RPL_MIN(iov[i].iov_len, space);
    size_t at = (size_t)((head + moved) % s->ring_bytes);
    size_t first = RPL_MIN(n, s->ring_bytes - at);
    memcpy(data + at, iov[i].iov_base, first);
    if (n > first) memcpy(data, (unsigned char *)iov[i].iov_base + first, n - first);
    moved += n;
    space -= n;
    if (n < iov[i].iov_len) break;
  }
  if (moved) {
    q->tx_head = head + moved;
    __atomic_store_n(&r->head, head + moved, __ATOMIC_RELEASE);
    ring_bell(seg);
  }
  return moved;
}

size_t rpl_shm_read(rpl_shm *s, int peer, void *buf, size_t len) {
  ring_ctl *r = ring_at(s, s->mine, s->local_of[peer]);
  ring_pos *q = &s->pos[peer];
  uint64_t tail = q->rx_tail; /* ours; the copy in shared memory is never read back */
  uint64_t head = __atomic_load_n(&r->head, __ATOMIC_ACQUIRE);
  if (__builtin_expect(!ring_ok(head, q->rx_head, tail + s->ring_bytes), 0))
    return ring_corrupt(s, peer, BAD_RX, head, tail);
  q->rx_head = head;
  size_t n = RPL_MIN(len, (size_t)(head - tail));
  if (!n) return 0;
  unsigned char *data = ring_data(r);
  size_t at = (size_t)(tail % s->ring_bytes);
  size_t first = RPL_MIN(n, s->ring_bytes - at);
  memcpy(buf, data + at, first);
  if (n > first) memcpy((unsigned char *)buf + first, data, n - first);
  q->rx_tail = tail + n;
  __atomic_store_n(&r->tail, tail + n, __ATOMIC_RELEASE);
  ring_bell(s->peer[peer]); /* the writer may be waiting for space */
  return n;
}

size_t rpl_shm_peek(rpl_shm *s, int peer, const void **data, size_t len) {
  ring_ctl *r = ring_at(s, s->mine, s->local_of[peer]);
  ring_pos *q = &s->pos[peer];
  uint64_t tail = q->rx_tail;
  uint64_t head = __atomic_load_n(&r->head, __ATOMIC_ACQUIRE);
  *data = ring_data(r);
  if (__builtin_expect(!ring_ok(head, q->rx_head, tail + s->ring_bytes), 0))
    return ring_corrupt(s, peer, BAD_RX, head, tail);
  q->rx_head = head;
  size_t at = (size_t)(tail % s->ring_bytes);
  size_t n = RPL_MIN(RPL_MIN(len, (size_t)(head - tail)), s->ring_bytes - at);
  *data = ring_data(r) + at;
  return n;
}

void rpl_shm_consume(rpl_shm *s, int peer, size_t n) {
  ring_ctl *r = ring_at(s, s->mine, s->local_of[peer]);
  ring_pos *q = &s->pos[peer];
  q->rx_tail += n;
  __atomic_store_n(&r->tail, q->rx_tail, __ATOMIC_RELEASE);
  ring_bell(s->peer[peer]); /* the writer may be waiting for space */
}

uint32_t rpl_shm_doorbell(const rpl_shm *s) {
  return __atomic_load_n(&hdr(s->mine)->doorbell, __ATOMIC_SEQ_CST);
}

void rpl_shm_wait(rpl_shm *s, uint32_t seen, double max_s) {
  seg_header *h = hdr(s->mine);
  /* A spin first: on a quiet machine the peer answers within microseconds. */
  for (int i = 0; i < s->spins; i++) {
    if (__atomic_load_n(&h->doorbell, __ATOMIC_SEQ_CST) != seen) return;
    cpu_relax();
  }
  if (max_s <= 0) return;
  struct timespec ts = {(time_t)max_s, (long)((max_s - (double)(time_t)max_s) * 1e9)};
  __atomic_store_n(&h->sleeping, 1, __ATOMIC_SEQ_CST);
  /* Returns at once if the doorbell moved after `seen` was read: no lost wake-up. */
  futex(&h->doorbell, FUTEX_WAIT, seen, &ts);
  __atomic_store_n(&h->sleeping, 0, __ATOMIC_SEQ_CST);
}

void rpl_shm_ring_self(rpl_shm *s) { ring_bell(s->mine); }

int rpl_shm_peer_flagged(const rpl_shm *s, int peer) {
  return s->pos[peer].bad || __atomic_load_n(&hdr(s->peer[peer])->closed, __ATOMIC_ACQUIRE) ||
         !pair_armed(s, peer);
}

int rpl_shm_peer_dead(const rpl_shm *s, int peer) {
  seg_header *h = hdr(s->peer[peer]);
  if (s->lock_fd < 0 || !__atomic_load_n(&h->locked, __ATOMIC_ACQUIRE) ||
      h->process == hdr(s->mine)->process)
    return 0;
  struct flock fl = lock_byte(F_WRLCK, s->local_of[peer]);
  if (fcntl(s->lock_fd, F_GETLK, &fl) != 0) return 0; /* cannot tell: assume alive */
  return fl.l_type == F_UNLCK;
}

/* Copies the owner's cause out of a segment (seqlock reader: a torn copy is retried). */
static void read_cause(const seg_header *h, char *out, size_t cap) {
  char buf[CAUSE_LEN];
  buf[0] = '\0';
  for (int tries = 0; tries < 100; tries++) {
    uint32_t a = __atomic_load_n(&h->cause_seq, __ATOMIC_ACQUIRE);
    if (a & 1) {
      cpu_relax();
      continue;
    }
    for (size_t i = 0; i < CAUSE_LEN; i++)
      buf[i] = __atomic_load_n(&h->cause[i], __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&h->cause_seq, __ATOMIC_RELAXED) == a) break;
    buf[0] = '\0';
  }
  buf[CAUSE_LEN - 1] = '\0';
  if (cap) snprintf(out, cap, "%s", buf);
}

void rpl_shm_set_cause(rpl_shm *s, const char *cause) {
  if (!s || !cause) return;
  seg_header *h = hdr(s->mine);
  uint32_t seq = __atomic_load_n(&h->cause_seq, __ATOMIC_RELAXED);
  /* One writer at a time; a second thread giving up at the same moment has the same story. */
  if ((seq & 1) || !__atomic_compare_exchange_n(&h->cause_seq, &seq, seq + 1, 0,
                                                __ATOMIC_RELAXED, __ATOMIC_RELAXED))
    return;
  __atomic_thread_fence(__ATOMIC_RELEASE);
  size_t n = strlen(cause);
  if (n > CAUSE_LEN - 1) n = CAUSE_LEN - 1;
  for (size_t i = 0; i < CAUSE_LEN; i++)
    __atomic_store_n(&h->cause[i], i < n ? cause[i] : '\0', __ATOMIC_RELAXED);
  __atomic_store_n(&h->cause_seq, seq + 2, __ATOMIC_RELEASE);
}

rpl_status rpl_shm_check_peer(const rpl_shm *s, int peer, int probe, int resuming, char *cause,
                              size_t cap, rpl_error *err) {
  seg_header *h = hdr(s->peer[peer]);
  char why[CAUSE_LEN];
  if (cap) cause[0] = '\0';
  const ring_pos *q = &s->pos[peer];
  if (q->bad)
    return rpl_fail(err, RPL_ERR_PEER,
                    "rank %d's shared-memory ring is corrupt: head %" PRIu64 " tail %" PRIu64
                    " ring %zu bytes (the ring %s; a process that can write the segment "
                    "changed it)", peer, q->bad_head, q->bad_tail, s->ring_bytes,
                    q->bad == BAD_RX ? "it writes into this rank" : "this rank writes into it");
  int closed = __atomic_load_n(&h->closed, __ATOMIC_ACQUIRE);
  /* Broken since the pair was last armed (only a link in use can be: a resuming pair is
   * checked with `resuming`), by whom. */
  int by_peer = !resuming && ld(&peer_slot(s, peer)->brk) != q->peer_brk;
  int by_me = !resuming && ld(&my_slot(s, peer)->brk) != q->my_brk;
  int broken = by_peer || by_me;
  int dead = !closed && !broken && probe && rpl_shm_peer_dead(s, peer);
  if (!closed && !broken && !dead) return RPL_OK;
  if (!closed && by_me && !by_peer)
    return rpl_fail(err, RPL_ERR_PEER,
                    "this rank gave up on its shared-memory link with rank %d after an earlier "
                    "error, while a message was under way on it", peer);
  read_cause(h, why, sizeof why);
  if (why[0]) snprintf(cause, cap, "%s", why);
  int origin;
  const char *text;
  rpl_status code = rpl_cause_split(why, &origin, &text);
  if (why[0] && code == RPL_ERR_MISMATCH) /* the same error as where it was found */
    return rpl_fail(err, RPL_ERR_MISMATCH, "%s [found by rank %d]", text, origin);
  if (dead)
    return rpl_fail(err, RPL_ERR_PEER, "rank %d (pid %u on this host) exited or was killed%s%s",
                    peer, h->pid, text[0] ? ", after an error of its own: " : "", text);
  if (closed && text[0])
    return rpl_fail(err, RPL_ERR_PEER, "rank %d aborted after an error of its own: %s", peer,
                    text);
  if (closed)
    return rpl_fail(err, RPL_ERR_PEER,
                    "rank %d closed its shared-memory link (it exited, or aborted after an "
                    "error of its own)", peer);
  if (text[0])
    return rpl_fail(err, RPL_ERR_PEER,
                    "rank %d gave up on an exchange with this rank after an error of its own: %s",
                    peer, text);
  return rpl_fail(err, RPL_ERR_PEER,
                  "rank %d gave up on an exchange with this rank after an error of its own",
                  peer);
}

void rpl_shm_break(rpl_shm *s, int peer) {
  if (!s || !s->peer[peer]) return;
  __atomic_fetch_add(&my_slot(s, peer)->brk, 1u, __ATOMIC_RELEASE);
  ring_bell(s->peer[peer]);
}

void rpl_shm_close(rpl_shm *s) {
  if (!s) return;
  __atomic_store_n(&hdr(s->mine)->closed, 1, __ATOMIC_RELEASE);
  for (int r = 0; r < s->size; r++)
    if (s->peer[r]) ring_bell(s->peer[r]);
}

int rpl_shm_can_read(const rpl_shm *s, int peer) {
  /* A pair being rebuilt still counts: the handshake that precedes every read rebuilds it. */
  return s && s->peer[peer] && !__atomic_load_n(&s->pos[peer].bad, __ATOMIC_RELAXED) &&
         s->peer_pid[peer] > 0;
}

/* A single-copy read of `peer`'s buffer failed with errno `e`. A peer that gave up first (an
 * error of its own, e.g. a third rank's death) left its cause in its segment before it exited
 * or let go of the buffer: that cause is the one to report and pass on (into `cause`, as
 * rpl_shm_check_peer does), not the peer's own exit. */
static rpl_status read_failed(const rpl_shm *s, int peer, int e, char *cause, size_t cap,
                              rpl_error *err) {
  char why[CAUSE_LEN];
  int origin;
  const char *text;
  read_cause(hdr(s->peer[peer]), why, sizeof why);
  if (cap) snprintf(cause, cap, "%s", why);
  rpl_status code = rpl_cause_split(why, &origin, &text);
  if (why[0] && code == RPL_ERR_MISMATCH) /* the same error as where it was found */
    return rpl_fail(err, RPL_ERR_MISMATCH, "%s [found by rank %d]", text, origin);
  if (e == ESRCH || rpl_shm_peer_dead(s, peer))
    return rpl_fail(err, RPL_ERR_PEER, "rank %d (pid %u on this host) exited or was killed "
                    "while this rank read its buffer%s%s", peer, hdr(s->peer[peer])->pid,
                    text[0] ? ", after an error of its own: " : "", text);
  if (text[0]) /* the cause may be stale (a peer clears it only when a run succeeds): errno */
    return rpl_fail_errno(err, RPL_ERR_PEER, e, "rank %d gave up on an exchange with this rank "
                          "after an error of its own (%s), and its buffer could not be read "
                          "(single copy)", peer, text);
  return rpl_fail_errno(err, RPL_ERR_PEER, e, "cannot read rank %d's buffer (single copy)",
                        peer);
}

rpl_status rpl_shm_read_peer(const rpl_shm *s, int peer, uint64_t remote, void *local,
                             size_t len, char *cause, size_t cap, rpl_error *err) {
  if (cap) cause[0] = '\0';
  unsigned char *dst = local;
  while (len > 0) {
    struct iovec l = {dst, len}, r = {(void *)(uintptr_t)remote, len};
    ssize_t got = process_vm_readv(s->peer_pid[peer], &l, 1, &r, 1, 0);
    if (got > 0) {
      dst += got;
      remote += (uint64_t)got;
      len -= (size_t)got;
      continue;
    }
    int e = got == 0 ? EFAULT : errno;
    if (e == EINTR) continue;
    return read_failed(s, peer, e, cause, cap, err);
  }
  return RPL_OK;
}
