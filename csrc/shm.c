/* shm.c - shared-memory rings between ranks of one host (see shm.h). */
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
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define SEG_MAGIC 0x33474553504c52ull /* "RLPSEG3" */
#define PAGE 4096u
#define SPIN_LONG 2000 /* about 50 us of pause instructions */
#define SPIN_SHORT 200
#define CAUSE_LEN 320 /* bytes of a rank's cause kept in its segment */
/* Who broke a pair, as the owner of the segment holding the flag sees it. */
enum { BROKE_BY_PEER = 1, BROKE_BY_OWNER = 2 };

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
  uint32_t pad;
  char cause[CAUSE_LEN]; /* why the owner last gave up on its links, "" if never */
  uint32_t broken[];     /* per local peer: the pair fell back to TCP (BROKE_*) */
} seg_header;

/* Control block in front of every ring; head and tail on their own cache lines. */
typedef struct ring_ctl {
  uint64_t head; /* bytes ever written (by the peer that sends into this ring) */
  char pad1[56];
  uint64_t tail; /* bytes ever consumed (by the segment's owner) */
  char pad2[56];
} ring_ctl;

struct rpl_shm {
  int rank, size, me; /* me: our local index */
  int nlocal;
  int *local_of;
  size_t ring_bytes, ring_stride, header_bytes, seg_bytes;
  char name[64];
  int linked;
  int lock_fd;           /* the anchor's segment, where every local rank holds its lock */
  unsigned char *mine;   /* our segment */
  unsigned char **peer;  /* peers' segments by rank, NULL if not mapped */
  pid_t *peer_pid;       /* by rank: a pid that reads that peer's memory, 0 if none does */
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

/* Tells processes apart (pids do not across namespaces): random per process, re-drawn in a
 * forked child because the pid is mixed in. */
static uint64_t process_seed;
static void draw_seed(void) {
  ssize_t got = getrandom(&process_seed, sizeof process_seed, GRND_NONBLOCK);
  if (got != (ssize_t)sizeof process_seed)
    process_seed = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)clock();
}
static uint64_t process_token(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, draw_seed);
  return (process_seed ^ (uint64_t)getpid() * 0xff51afd7ed558ccdull) | 1u;
}

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

static void ring_bell(unsigned char *seg) {
  seg_header *h = hdr(seg);
  __atomic_fetch_add(&h->doorbell, 1, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&h->sleeping, __ATOMIC_SEQ_CST)) futex(&h->doorbell, FUTEX_WAKE, 1, NULL);
}

rpl_status rpl_shm_create(int rank, int size, const int *local_of, uint64_t nonce,
                          size_t ring_bytes, rpl_shm **out, char *name, size_t cap,
                          rpl_error *err) {
  *out = NULL;
  rpl_shm *s = calloc(1, sizeof *s);
  if (!s) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory for shared-memory transport");
  s->rank = rank;
  s->size = size;
  s->lock_fd = -1;
  s->local_of = malloc(sizeof(int) * (size_t)size);
  s->peer = calloc((size_t)size, sizeof *s->peer);
  s->peer_pid = calloc((size_t)size, sizeof *s->peer_pid);
  if (!s->local_of || !s->peer || !s->peer_pid) {
    rpl_shm_destroy(s);
    return rpl_fail(err, RPL_ERR_NOMEM, "out of memory for shared-memory transport");
  }
  for (int r = 0; r < size; r++) {
    s->local_of[r] = local_of[r];
    if (local_of[r] >= 0) s->nlocal++;
  }
  s->me = local_of[rank];
  /* Spinning pays while every local rank has a core to itself; oversubscribed, it would take
   * the core from the very peer being waited for. */
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  s->spins = cpus >= s->nlocal ? SPIN_LONG : SPIN_SHORT;
  s->ring_bytes = ring_bytes;
  s->ring_stride = round_up(sizeof(ring_ctl) + ring_bytes, PAGE);
  s->header_bytes = round_up(sizeof(seg_header) + sizeof(uint32_t) * (size_t)s->nlocal, PAGE);
  s->seg_bytes = s->header_bytes + s->ring_stride * (size_t)s->nlocal;
  snprintf(s->name, sizeof s->name, "/ripples-%d-%016" PRIx64 "-%d", (int)getpid(), nonce,
           rank);
  int fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    int e = errno;
    rpl_shm_destroy(s);
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, e, "cannot create shared memory segment");
  }
  s->linked = 1;
  if (ftruncate(fd, (off_t)s->seg_bytes) != 0) {
    int e = errno;
    close(fd);
    rpl_shm_destroy(s);
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, e,
                          "cannot size a %zu-byte shared memory segment (is /dev/shm full?)",
                          s->seg_bytes);
  }
  void *p = mmap(NULL, s->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    close(fd);
    rpl_shm_destroy(s);
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, e, "cannot map shared memory");
  }
  s->mine = p;
  seg_header *h = hdr(s->mine);
  h->nonce = nonce;
  h->ring_bytes = ring_bytes;
  h->nlocal = (uint32_t)s->nlocal;
  h->pid = (uint32_t)getpid();
  h->process = process_token();
  h->self_addr = (uint64_t)(uintptr_t)p;
  if (s->me == 0) take_lock(s, fd);
  else close(fd);
  __atomic_store_n(&h->magic, SEG_MAGIC, __ATOMIC_RELEASE);
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

rpl_status rpl_shm_attach(rpl_shm *s, int peer, const char *name, rpl_error *err) {
  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0)
    return rpl_fail_errno(err, RPL_ERR_PEER, errno,
                          "cannot open rank %d's shared memory segment %s", peer, name);
  struct stat st;
  void *p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && (size_t)st.st_size == s->seg_bytes)
    p = mmap(NULL, s->seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return rpl_fail(err, RPL_ERR_PEER, "rank %d's shared memory segment %s has an unexpected "
                    "size or cannot be mapped", peer, name);
  }
  seg_header *h = hdr(p);
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SEG_MAGIC ||
      h->ring_bytes != s->ring_bytes || h->nlocal != (uint32_t)s->nlocal) {
    munmap(p, s->seg_bytes);
    close(fd);
    return rpl_fail(err, RPL_ERR_PEER, "rank %d's shared memory segment %s is not compatible",
                    peer, name);
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
  free(s->peer);
  free(s->peer_pid);
  free(s->local_of);
  free(s);
}

int rpl_shm_usable(const rpl_shm *s, int peer) {
  if (!s || !s->peer[peer]) return 0;
  return !__atomic_load_n(&hdr(s->mine)->broken[s->local_of[peer]], __ATOMIC_ACQUIRE);
}

size_t rpl_shm_write(rpl_shm *s, int peer, const struct iovec *iov, int niov) {
  unsigned char *seg = s->peer[peer];
  ring_ctl *r = ring_at(s, seg, s->me);
  uint64_t head = r->head; /* only we write it */
  uint64_t tail = __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE);
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
    __atomic_store_n(&r->head, head + moved, __ATOMIC_RELEASE);
    ring_bell(seg);
  }
  return moved;
}

size_t rpl_shm_read(rpl_shm *s, int peer, void *buf, size_t len) {
  ring_ctl *r = ring_at(s, s->mine, s->local_of[peer]);
  uint64_t tail = r->tail; /* only we write it */
  uint64_t head = __atomic_load_n(&r->head, __ATOMIC_ACQUIRE);
  size_t n = RPL_MIN(len, (size_t)(head - tail));
  if (!n) return 0;
  unsigned char *data = ring_data(r);
  size_t at = (size_t)(tail % s->ring_bytes);
  size_t first = RPL_MIN(n, s->ring_bytes - at);
  memcpy(buf, data + at, first);
  if (n > first) memcpy((unsigned char *)buf + first, data, n - first);
  __atomic_store_n(&r->tail, tail + n, __ATOMIC_RELEASE);
  ring_bell(s->peer[peer]); /* the writer may be waiting for space */
  return n;
}

size_t rpl_shm_peek(rpl_shm *s, int peer, const void **data, size_t len) {
  ring_ctl *r = ring_at(s, s->mine, s->local_of[peer]);
  uint64_t tail = r->tail;
  uint64_t head = __atomic_load_n(&r->head, __ATOMIC_ACQUIRE);
  size_t at = (size_t)(tail % s->ring_bytes);
  size_t n = RPL_MIN(RPL_MIN(len, (size_t)(head - tail)), s->ring_bytes - at);
  *data = ring_data(r) + at;
  return n;
}

void rpl_shm_consume(rpl_shm *s, int peer, size_t n) {
  ring_ctl *r = ring_at(s, s->mine, s->local_of[peer]);
  __atomic_store_n(&r->tail, r->tail + n, __ATOMIC_RELEASE);
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
  return __atomic_load_n(&hdr(s->peer[peer])->closed, __ATOMIC_ACQUIRE) ||
         __atomic_load_n(&hdr(s->mine)->broken[s->local_of[peer]], __ATOMIC_ACQUIRE);
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

rpl_status rpl_shm_check_peer(const rpl_shm *s, int peer, int probe, char *cause, size_t cap,
                              rpl_error *err) {
  seg_header *h = hdr(s->peer[peer]);
  char why[CAUSE_LEN];
  if (cap) cause[0] = '\0';
  int closed = __atomic_load_n(&h->closed, __ATOMIC_ACQUIRE);
  uint32_t broken =
      __atomic_load_n(&hdr(s->mine)->broken[s->local_of[peer]], __ATOMIC_ACQUIRE);
  int dead = !closed && !broken && probe && rpl_shm_peer_dead(s, peer);
  if (!closed && !broken && !dead) return RPL_OK;
  if (!closed && broken == BROKE_BY_OWNER)
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
  __atomic_store_n(&hdr(s->mine)->broken[s->local_of[peer]], BROKE_BY_OWNER, __ATOMIC_RELEASE);
  __atomic_store_n(&hdr(s->peer[peer])->broken[s->me], BROKE_BY_PEER, __ATOMIC_RELEASE);
  ring_bell(s->peer[peer]);
}

void rpl_shm_close(rpl_shm *s) {
  if (!s) return;
  __atomic_store_n(&hdr(s->mine)->closed, 1, __ATOMIC_RELEASE);
  for (int r = 0; r < s->size; r++)
    if (s->peer[r]) ring_bell(s->peer[r]);
}

int rpl_shm_can_read(const rpl_shm *s, int peer) {
  return rpl_shm_usable(s, peer) && s->peer_pid[peer] > 0;
}

rpl_status rpl_shm_read_peer(const rpl_shm *s, int peer, uint64_t remote, void *local,
                             size_t len, rpl_error *err) {
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
    if (e == ESRCH || rpl_shm_peer_dead(s, peer))
      return rpl_fail(err, RPL_ERR_PEER, "rank %d (pid %u on this host) exited or was killed "
                      "while this rank read its buffer", peer, hdr(s->peer[peer])->pid);
    return rpl_fail_errno(err, RPL_ERR_PEER, e, "cannot read rank %d's buffer (single copy)",
                          peer);
  }
  return RPL_OK;
}
