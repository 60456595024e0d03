/* fuzz_standalone.h - the main() of both coordinator fuzz targets when built without libFuzzer
 * (FUZZ_STANDALONE: ctest's smoke runs, run_libfuzzer.sh's seed corpus, replaying a crash):
 *   PROG [N]                 N deterministic mutations of the seeds (default 20000): bit
 *                            flips, random and 0xff bytes, truncations
 *   PROG --write-corpus DIR  writes the seeds to DIR/seed-NN
 *   PROG FILE...             replays inputs, e.g. a crash-* file libFuzzer left
 * Also what the two seed generators share (framing a message, the generator, a message's start).
 * Header-only (static), so run_libfuzzer.sh builds each target from its one source file. */
#ifndef RPL_FUZZ_STANDALONE_H
#define RPL_FUZZ_STANDALONE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpl_sched_proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Appends one input message as the targets read them: a 2-byte little-endian length, then
 * `nprefix` bytes read before the message (fuzz_coord's route byte), then the n bytes of msg.
 * Returns the new end, or pos unchanged (nothing written) if it does not fit in cap. */
static size_t fuzz_frame(uint8_t *out, size_t pos, size_t cap, const uint8_t *prefix,
                         size_t nprefix, const uint8_t *msg, size_t n) {
  if (!n || pos + 2 + nprefix + n > cap) return pos;
  out[pos++] = (uint8_t)n;
  out[pos++] = (uint8_t)(n >> 8);
  if (nprefix) memcpy(out + pos, prefix, nprefix); /* prefix may be NULL then */
  memcpy(out + pos + nprefix, msg, n);
  return pos + nprefix + n;
}

/* Appends message m (with members, if any) encoded and framed as fuzz_frame does; `sign`
 * sets length bit 15, which has the target MAC the message after mutation as a peer holding
 * the key would. Returns the new end, or pos unchanged if it does not fit. */
static size_t fuzz_put_msg(uint8_t *out, size_t pos, size_t cap, const uint8_t *prefix,
                           size_t nprefix, const rpl_msg *m, const int *members, int sign) {
  uint8_t b[512];
  size_t n = rpl_msg_encode(m, members, b, sizeof b);
  size_t end = fuzz_frame(out, pos, cap, prefix, nprefix, b, n);
  if (sign && end != pos) out[pos + 1] |= 0x80;
  return end;
}

/* The generator of the mutation loop and the seeds: one step of a 64-bit LCG. */
static uint64_t fuzz_next(uint64_t s) {
  return s * 6364136223846793005ull + 1442695040888963407ull;
}

/* What every seed message starts from: zeroed, with its type, rank, seq and the job's token. */
static rpl_msg fuzz_msg(int type, int32_t rank, uint32_t seq, const char *token_hex) {
  rpl_msg m;
  memset(&m, 0, sizeof m);
  rpl_error err;
  if (rpl_token_from_hex(token_hex, m.token, &err) != RPL_OK) abort();
  m.type = (uint8_t)type;
  m.rank = rank;
  m.seq = seq;
  return m;
}

/* seed(out, cap, pick) writes one seed input of at most cap bytes (pick chooses which) and
 * returns its length; `s` starts the mutation loop's generator. */
static int fuzz_standalone_main(int argc, char **argv, const char *name, int nseeds,
                                size_t (*seed)(uint8_t *, size_t, uint64_t), uint64_t s) {
  uint8_t buf[4096];
  if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0) {
    for (int k = 0; k < nseeds; k++) {
      char path[1024];
      snprintf(path, sizeof path, "%s/seed-%02d", argv[2], k);
      FILE *f = fopen(path, "wb");
      if (!f) return 1;
      size_t n = seed(buf, sizeof buf, (uint64_t)k * 0x9e3779b97f4a7c15ull);
      fwrite(buf, 1, n, f);
      fclose(f);
    }
    return 0;
  }
  if (argc >= 2 && (argv[1][0] < '0' || argv[1][0] > '9')) { /* replay files */
    for (int i = 1; i < argc; i++) {
      FILE *f = fopen(argv[i], "rb");
      if (!f) return 1;
      size_t n = fread(buf, 1, sizeof buf, f);
      fclose(f);
      LLVMFuzzerTestOneInput(buf, n);
    }
    printf("replayed %d inputs\n", argc - 1);
    return 0;
  }
  long iters = argc >= 2 ? atol(argv[1]) : 20000;
  for (long it = 0; it < iters; it++) {
    s = fuzz_next(s);
    size_t n = seed(buf, sizeof buf, s);
    int muts = (int)((s >> 40) % 8);
    for (int k = 0; k < muts && n > 0; k++) {
      s = fuzz_next(s);
      size_t at = (s >> 33) % n;
      switch ((s >> 20) % 4) {
        case 0: buf[at] ^= (uint8_t)(1u << ((s >> 10) % 8)); break;
        case 1: buf[at] = (uint8_t)(s >> 50); break;
        case 2: n = at + 1; break;
        default: buf[at] = 0xff; break;
      }
    }
    LLVMFuzzerTestOneInput(buf, n);
  }
  printf("%s smoke: %ld inputs, no crash\n", name, iters);
  return 0;
}

#endif /* RPL_FUZZ_STANDALONE_H */
