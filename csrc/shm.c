/* shm.c - shared-memory rings between ranks of one host (see shm.h). */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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

#define SEG_MAGIC 0x31474553504c52ull /* "RLPSEG1" */
#define PAGE 4096u

/* The first page of a segment. Fields written by other processes are accessed with atomics. */
typedef struct seg_header {
  uint64_t magic;
  uint64_t nonce;
  uint64_t ring_bytes;
  uint32_t nlocal;
  uint32_t pid;
  uint32_t doorbell; /* futex word: rung by anyone who gives this rank something to do */
  uint32_t sleeping; /* the owner is (about to be) in futex_wait */
  uint32_t closed;   /* the owner aborted or shut down */
  uint32_t pad;
  uint32_t broken[]; /* per local peer: the pair fell back to TCP */
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
  unsigned char *mine;   /* our segment */
  unsigned char **peer;  /* peers' segments by rank, NULL if not mapped */
};

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static seg_header *hdr(unsigned char *seg) { return (seg_header *)seg; }

static ring_ctl *ring_at(const rpl_shm *s, unsigned char *seg, int idx) {
  return (ring_ctl *)(seg + s->header_bytes + (size_t)idx * s->ring_stride);
}

static unsigned char *ring_data(ring_ctl *r) { return (unsigned char *)(r + 1); }

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
  s->local_of = malloc(sizeof(int) * (size_t)size);
  s->peer = calloc((size_t)size, sizeof *s->peer);
  if (!s->local_of || !s->peer) {
    rpl_shm_destroy(s);
    return rpl_fail(err, RPL_ERR_NOMEM, "out of memory for shared-memory transport");
  }
  for (int r = 0; r < size; r++) {
    s->local_of[r] = local_of[r];
    if (local_of[r] >= 0) s->nlocal++;
  }
  s->me = local_of[rank];
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
  close(fd);
  if (p == MAP_FAILED) {
    int e = errno;
    rpl_shm_destroy(s);
    return rpl_fail_errno(err, RPL_ERR_SYSTEM, e, "cannot map shared memory");
  }
  s->mine = p;
  seg_header *h = hdr(s->mine);
  h->nonce = nonce;
  h->ring_bytes = ring_bytes;
  h->nlocal = (uint32_t)s->nlocal;
  h->pid = (uint32_t)getpid();
  __atomic_store_n(&h->magic, SEG_MAGIC, __ATOMIC_RELEASE);
  snprintf(name, cap, "%s", s->name);
  *out = s;
  return RPL_OK;
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
  close(fd);
  if (p == MAP_FAILED)
    return rpl_fail(err, RPL_ERR_PEER, "rank %d's shared memory segment %s has an unexpected "
                    "size or cannot be mapped", peer, name);
  seg_header *h = hdr(p);
  if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != SEG_MAGIC ||
      h->ring_bytes != s->ring_bytes || h->nlocal != (uint32_t)s->nlocal) {
    munmap(p, s->seg_bytes);
    return rpl_fail(err, RPL_ERR_PEER, "rank %d's shared memory segment %s is not compatible",
                    peer, name);
  }
  s->peer[peer] = p;
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
  free(s->peer);
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

uint32_t rpl_shm_doorbell(const rpl_shm *s) {
  return __atomic_load_n(&hdr(s->mine)->doorbell, __ATOMIC_SEQ_CST);
}

void rpl_shm_wait(rpl_shm *s, uint32_t seen, double max_s) {
  seg_header *h = hdr(s->mine);
  /* A short spin first: on a quiet machine the peer answers within microseconds. */
  for (int i = 0; i < 200; i++) {
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

rpl_status rpl_shm_check_peer(const rpl_shm *s, int peer, rpl_error *err) {
  seg_header *h = hdr(s->peer[peer]);
  if (__atomic_load_n(&h->closed, __ATOMIC_ACQUIRE))
    return rpl_fail(err, RPL_ERR_PEER,
                    "rank %d closed its shared-memory link (it exited, or aborted after an "
                    "error of its own)", peer);
  if (__atomic_load_n(&hdr(s->mine)->broken[s->local_of[peer]], __ATOMIC_ACQUIRE))
    return rpl_fail(err, RPL_ERR_PEER,
                    "rank %d gave up on an exchange with this rank after an error of its own",
                    peer);
  if (kill((pid_t)h->pid, 0) != 0 && errno == ESRCH)
    return rpl_fail(err, RPL_ERR_PEER, "rank %d (pid %u) has exited", peer, h->pid);
  return RPL_OK;
}

void rpl_shm_break(rpl_shm *s, int peer) {
  if (!s || !s->peer[peer]) return;
  __atomic_store_n(&hdr(s->mine)->broken[s->local_of[peer]], 1, __ATOMIC_RELEASE);
  __atomic_store_n(&hdr(s->peer[peer])->broken[s->me], 1, __ATOMIC_RELEASE);
  ring_bell(s->peer[peer]);
}

void rpl_shm_close(rpl_shm *s) {
  if (!s) return;
  __atomic_store_n(&hdr(s->mine)->closed, 1, __ATOMIC_RELEASE);
  for (int r = 0; r < s->size; r++)
    if (s->peer[r]) ring_bell(s->peer[r]);
}
