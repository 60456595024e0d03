/*
 * fuzz_link.c - what a peer sends on a data link, after the handshake and during it, is
 * parsed without crashing, without reading or writing out of bounds, and without growing
 * memory without bound: the transport's handshake (wire.h) and frame-header handling.
 *
 * One input = one connection to a fresh rank-1 transport that waits in a run:
 *   byte 0, bits 0-1: what rank 1 waits for (a p2p receive of tag 7, an any-source receive,
 *                     a collective receive of 64 bytes, or a p2p batch of two receives);
 *   bit 2:            send the input as the handshake itself (HS1, then HS3) instead of a
 *                     valid handshake followed by the input as frames.
 * The fuzzer plays rank 0 and holds the link key, so inputs reach the frame parser.
 *
 * ctest runs the standalone driver (FUZZ_STANDALONE): valid frames, mutated. A libFuzzer
 * campaign (clang, from the repository root):
 *   clang -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=fuzzer,address,undefined -Icsrc -Itests/c \
 *     fuzz/fuzz_link.c csrc/common.c csrc/crypto.c csrc/kernels.c csrc/transport*.c \
 *     csrc/shm.c csrc/ucx.c csrc/wire.c -lpthread -lm -o /tmp/fuzz_link
 *   /tmp/fuzz_link -max_total_time=3600 -max_len=4096 /tmp/fuzz_link_corpus
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "crypto.h"
#include "loopback.h"
#include "transport.h"
#include "wire.h"

static const unsigned char KEY[RPL_TR_KEY_LEN] = {1, 2, 3, 4, 5, 6, 7, 8};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct waiter {
  rpl_tr *tr;
  int mode;
  unsigned char buf[2][64];
  rpl_status st;
} waiter;

static void *wait_main(void *p) {
  waiter *w = p;
  rpl_xfer xs[2];
  memset(xs, 0, sizeof xs);
  int n = 1;
  for (int i = 0; i < 2; i++) {
    xs[i].peer = 0;
    xs[i].buf = w->buf[i];
    xs[i].len = sizeof w->buf[i];
    xs[i].meta.op = RPL_OP_SEND;
    xs[i].meta.dtype = RPL_UINT8;
    xs[i].meta.tag = 7 + (unsigned)i;
    xs[i].meta.count = sizeof w->buf[i];
  }
  rpl_error err;
  double deadline = now_s() + 0.5;
  switch (w->mode) {
    case 0: w->st = rpl_tr_run_p2p(w->tr, xs, 1, deadline, &err); break;
    case 1:
      xs[0].peer = RPL_TR_ANY;
      w->st = rpl_tr_run_p2p(w->tr, xs, 1, deadline, &err);
      break;
    case 2:
      xs[0].meta.op = RPL_OP_BROADCAST;
      xs[0].meta.seq = 1;
      xs[0].meta.tag = 1;
      w->st = rpl_tr_run(w->tr, xs, 1, deadline, &err);
      break;
    default:
      n = 2;
      while (now_s() < deadline && !(xs[0].done && xs[1].done))
        if ((w->st = rpl_tr_run_p2p(w->tr, xs, n, deadline, &err)) != RPL_OK) break;
  }
  return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  int mode = data[0] & 3, raw_handshake = data[0] & 4;
  data++;
  size--;
  rpl_tr *t1;
  rpl_error err;
  if (rpl_tr_create(1, 2, "127.0.0.1", 0, &t1, &err) != RPL_OK) abort();
  rpl_tr_set_key(t1, KEY);
  char a1[128];
  rpl_tr_address(t1, a1, sizeof a1);
  /* Rank 0's address: a port nobody listens on (rank 1 only accepts from it). */
  if (rpl_tr_set_peer(t1, 0, "127.0.0.1:9:0:0", &err) != RPL_OK) abort();
  waiter w = {.tr = t1, .mode = mode};
  pthread_t th;
  pthread_create(&th, NULL, wait_main, &w);
  int fd = dial(a1);
  if (fd >= 0) {
    if (raw_handshake) {
      send(fd, data, size, MSG_NOSIGNAL);
    } else {
      unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE], hs3[RPL_HS3_SIZE], n[16] = {9};
      rpl_hs1_make(hs1, 0, 1, 2, id_of(a1), n);
      send(fd, hs1, sizeof hs1, MSG_NOSIGNAL);
      if (read_n(fd, hs2, sizeof hs2, 1.0) == (int)sizeof hs2) {
        if (!rpl_hs2_check(hs2, KEY, hs1, 1)) abort(); /* the genuine acceptor proves it */
        rpl_hs3_make(hs3, KEY, hs1, hs2);
        send(fd, hs3, sizeof hs3, MSG_NOSIGNAL);
        send(fd, data, size, MSG_NOSIGNAL);
      }
    }
    shutdown(fd, SHUT_WR);
  }
  pthread_join(th, NULL);
  if (fd >= 0) close(fd);
  rpl_tr_destroy(t1);
  return 0;
}

#ifdef FUZZ_STANDALONE
/* A frame header as the transport writes it (rpl_tr_encode_header in transport_frame.c). */
static size_t frame(unsigned char *p, uint8_t op, uint32_t tag, uint64_t seq, uint64_t count,
                    uint64_t len) {
  memset(p, 0, 40);
  const uint32_t magic = 0x31444c52u;
  memcpy(p, &magic, 4);
  p[4] = op;
  p[5] = RPL_UINT8;
  memcpy(p + 8, &tag, 4);
  memcpy(p + 16, &seq, 8);
  memcpy(p + 24, &count, 8);
  memcpy(p + 32, &len, 8);
  return 40;
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t next(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)rng;
}

int main(int argc, char **argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 200;
  unsigned char in[1 + 4096];
  for (int it = 0; it < iters; it++) {
    size_t n = 1;
    in[0] = (unsigned char)(next() & 7);
    /* Seeds: valid frames (p2p of tag 7/8, a broadcast, a goodbye), then random mutations of
     * bytes, lengths (huge, zero) and cut-offs. */
    int frames = 1 + (int)(next() % 3);
    for (int f = 0; f < frames && n + 40 + 64 <= sizeof in; f++) {
      uint8_t op = next() % 4 == 0 ? RPL_OP_BROADCAST : RPL_OP_SEND;
      uint64_t len = next() % 5 == 0 ? (uint64_t)next() << (next() % 32) : 64;
      n += frame(in + n, op, 7 + next() % 2, op == RPL_OP_SEND ? 0 : 1, 64, len);
      size_t body = len < 64 ? (size_t)len : 64;
      memset(in + n, 0xab, body);
      n += body;
    }
    int muts = (int)(next() % 6);
    for (int m = 0; m < muts; m++) in[1 + next() % (n - 1)] ^= (unsigned char)(1u << (next() % 8));
    if (next() % 4 == 0) n = 1 + next() % n;
    LLVMFuzzerTestOneInput(in, n);
  }
  /* A flood of unexpected messages past the stash's cap, then EOF. */
  size_t n = 1;
  in[0] = 0;
  while (n + 40 <= sizeof in) n += frame(in + n, RPL_OP_SEND, 9, 0, 0, 0);
  LLVMFuzzerTestOneInput(in, n);
  printf("fuzz_link: %d inputs, 1 passed, 0 failed\n", iters + 1);
  return 0;
}
#endif
