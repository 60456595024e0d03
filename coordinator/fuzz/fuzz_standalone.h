/* The standalone driver shared by the coordinator's fuzz targets (FUZZ_STANDALONE builds: any C
 * compiler, no libFuzzer). A target defines LLVMFuzzerTestOneInput and a seed generator, and its
 * main returns fuzz_standalone_main(...):
 *   NAME --write-corpus DIR   writes nseeds seed inputs (libFuzzer's starting corpus)
 *   NAME FILE...              replays inputs (a crash file, say)
 *   NAME [ITERATIONS]         a deterministic mutation loop over seeds (default 20000): bit
 *                             flips, overwritten bytes, truncations */
#ifndef RPL_FUZZ_STANDALONE_H
#define RPL_FUZZ_STANDALONE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* seed(out, cap, pick) writes one seed input chosen by pick into out[0..cap), returns its size;
 * s0 starts the mutation loop's generator. */
static int fuzz_standalone_main(int argc, char **argv, const char *name, int nseeds, uint64_t s0,
                                size_t (*seed)(uint8_t *out, size_t cap, uint64_t pick)) {
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
  uint64_t s = s0;
  for (long it = 0; it < iters; it++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    size_t n = seed(buf, sizeof buf, s);
    int muts = (int)((s >> 40) % 8);
    for (int k = 0; k < muts && n > 0; k++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
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

#endif
