/* Fuzz target for the coordinator's input path: the protocol parser and the message handler
 * (policy included) behind it. Input: a sequence of messages, each prefixed by a 2-byte
 * little-endian length; every reply the coordinator produces must itself parse.
 *
 * libFuzzer (clang):   coordinator/fuzz/run_libfuzzer.sh [seconds]
 * Standalone (any cc): fuzz_coord_smoke [iterations] | --write-corpus DIR | FILE...
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../coord_core.h"

#define FUZZ_WORKERS 6
static const char *FUZZ_TOKEN = "00000000000000000000000000000000";

static int check_reply(void *ctx, const uint8_t *route, size_t route_len, const void *msg,
                       size_t len) {
  (void)ctx;
  (void)route;
  (void)route_len;
  rpl_msg m;
  rpl_error err;
  if (rpl_msg_parse(msg, len, FUZZ_WORKERS, &m, &err) != RPL_OK) {
    fprintf(stderr, "coordinator produced an unparsable reply: %s\n", err.msg);
    abort();
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* Parser alone, with several job sizes. */
  rpl_msg m;
  rpl_error err;
  for (int mw = 0; mw <= FUZZ_WORKERS; mw += 3) rpl_msg_parse(data, size, mw, &m, &err);
  if (size < 1) return 0;
  /* A fresh coordinator core per input; the first byte picks the policy and knobs. */
  rpl_coord_config cfg;
  memset(&cfg, 0, sizeof cfg);
  int host_of[FUZZ_WORKERS] = {0, 0, 0, 1, 1, 2};
  cfg.token_hex = FUZZ_TOKEN;
  cfg.gg.policy = (rpl_policy)(data[0] % RPL_POLICY_COUNT);
  cfg.gg.nworkers = FUZZ_WORKERS;
  cfg.gg.host_of = host_of;
  cfg.gg.group_size = 1 + (data[0] >> 2) % 4;
  cfg.gg.inter_intra = (data[0] >> 4) & 1;
  cfg.gg.c_thres = ((data[0] >> 5) & 1) ? -1 : 0;
  cfg.standby = (data[0] >> 6) & 1; /* a failover coordinator: every worker starts out dead */
  cfg.heartbeat_ms = 100;
  cfg.dead_ms = 1000;
  cfg.join_ms = -1;
  coord_core core;
  if (coord_core_init(&core, &cfg, &err) != RPL_OK) abort();
  core.send = check_reply;
  double now = 0;
  size_t pos = 1;
  while (pos + 2 <= size) {
    size_t len = (size_t)data[pos] | (size_t)data[pos + 1] << 8;
    pos += 2;
    if (len > size - pos) len = size - pos;
    /* Copy so reads past the message are caught by ASan. */
    uint8_t *msg = malloc(len ? len : 1);
    memcpy(msg, data + pos, len);
    uint8_t route[2] = {(uint8_t)(pos & 0xff), 1};
    coord_core_handle(&core, route, sizeof route, msg, len, now);
    free(msg);
    pos += len;
    now += 0.3;
    coord_core_tick(&core, now);
  }
  size_t jl;
  free(coord_core_status_json(&core, now, &jl));
  coord_core_free(&core);
  return 0;
}

#ifdef FUZZ_STANDALONE
/* Valid messages of every kind a worker sends, as seeds for mutation. */
static size_t seed_messages(uint8_t *out, size_t cap, uint64_t pick) {
  size_t pos = 0;
  out[pos++] = (uint8_t)pick;
  for (int i = 0; i < 8; i++) {
    rpl_msg m;
    memset(&m, 0, sizeof m);
    static const int types[] = {RPL_MSG_HELLO, RPL_MSG_REQUEST, RPL_MSG_DONE,  RPL_MSG_HEARTBEAT,
                                RPL_MSG_FENCE, RPL_MSG_UNFENCE, RPL_MSG_LEAVE, RPL_MSG_STATUS};
    m.type = (uint8_t)types[(pick >> (3 * i)) % 8];
    m.rank = m.type == RPL_MSG_STATUS ? -1 : (int32_t)((pick >> i) % FUZZ_WORKERS);
    m.seq = (uint32_t)i;
    m.nworkers = FUZZ_WORKERS;
    m.round = (pick >> 5) % 3;
    m.group_id = 1 + (pick >> 9) % 5;
    uint8_t b[256];
    size_t n = rpl_msg_encode(&m, NULL, b, sizeof b);
    if (!n || pos + 2 + n > cap) break;
    out[pos++] = (uint8_t)n;
    out[pos++] = (uint8_t)(n >> 8);
    memcpy(out + pos, b, n);
    pos += n;
  }
  return pos;
}

int main(int argc, char **argv) {
  uint8_t buf[4096];
  if (argc == 3 && strcmp(argv[1], "--write-corpus") == 0) {
    for (int k = 0; k < 64; k++) {
      char path[1024];
      snprintf(path, sizeof path, "%s/seed-%02d", argv[2], k);
      FILE *f = fopen(path, "wb");
      if (!f) return 1;
      size_t n = seed_messages(buf, sizeof buf, (uint64_t)k * 0x9e3779b97f4a7c15ull);
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
  /* Deterministic mutation loop: seeds with random flips, insertions, truncations. */
  long iters = argc >= 2 ? atol(argv[1]) : 20000;
  uint64_t s = 0x1234;
  for (long it = 0; it < iters; it++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    size_t n = seed_messages(buf, sizeof buf, s);
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
  printf("fuzz_coord smoke: %ld inputs, no crash\n", iters);
  return 0;
}
#endif
