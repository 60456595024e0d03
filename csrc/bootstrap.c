/* bootstrap.c - a new communicator meets its peers: link key, addresses, shared memory. */
#include "bootstrap.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common.h"
#include "crypto.h"
#include "shm.h"
#include "wire.h"

#define DEFAULT_RING_BYTES (1u << 20)

/* ---- records in the store, sealed with the job secret ------------------------------------
 * The c10d store authenticates nobody. With a job secret, every record this file publishes
 * ends in "|" and 32 hex digits: the first 16 bytes of HMAC-SHA256(key, name || 0 || value).
 * The salt is sealed with HMAC-SHA256(secret, "ripples-store-key/1"), every later record
 * with HMAC-SHA256(secret, "ripples-store-key/1" || salt): a store writer can neither change
 * a record nor move one to another key, rank, group or incarnation (each has its own salt)
 * without a reader noticing and naming it. Without a secret records are plain: anyone who
 * reads the store could compute any key anyway. */
#define SEAL_HEX 32
typedef struct {
  const rpl_store *store;
  int on; /* a job secret is set */
  unsigned char key[RPL_SHA256_LEN];
} sealer;

static void seal_key(sealer *s, const char *secret, const unsigned char *salt, size_t salt_len) {
  static const char label[] = "ripples-store-key/1";
  const void *parts[2] = {label, salt};
  size_t lens[2] = {sizeof label - 1, salt_len};
  s->on = secret && *secret;
  if (s->on) rpl_hmac_sha256(secret, strlen(secret), parts, lens, salt ? 2 : 1, s->key);
}

static void seal_tag(const sealer *s, const char *name, const char *val, size_t n,
                     char hex[SEAL_HEX + 1]) {
  const void *parts[3] = {name, "", val};
  size_t lens[3] = {strlen(name), 1, n};
  unsigned char mac[RPL_SHA256_LEN];
  rpl_hmac_sha256(s->key, sizeof s->key, parts, lens, 3, mac);
  for (int i = 0; i < SEAL_HEX / 2; i++) snprintf(hex + 2 * i, 3, "%02x", mac[i]);
}

static rpl_status seal_set(const sealer *s, const char *name, const char *val, size_t n,
                           rpl_error *err) {
  if (!s->on) return s->store->set(s->store->ctx, name, val, n, err);
  char buf[512];
  if (n + 1 + SEAL_HEX > sizeof buf)
    return rpl_fail(err, RPL_ERR_INVALID, "store record %s: value of %zu bytes", name, n);
  memcpy(buf, val, n);
  buf[n] = '|';
  seal_tag(s, name, val, n, buf + n + 1);
  return s->store->set(s->store->ctx, name, buf, n + 1 + SEAL_HEX, err);
}

/* Reads record `name` into out (NUL-terminated; at most cap - 1 bytes of value), checking its
 * seal when a secret is set. `who` names its writer in errors. */
static rpl_status seal_get(const sealer *s, const char *name, const char *who, char *out,
                           size_t cap, size_t *n, rpl_error *err) {
  char buf[512];
  size_t len = 0;
  rpl_status st = s->store->get(s->store->ctx, name, buf, sizeof buf - 1, &len, err);
  if (st != RPL_OK) return st;
  if (len >= sizeof buf)
    return rpl_fail(err, RPL_ERR_INVALID, "%s published an over-long %s (%zu bytes)", who,
                    name, len);
  buf[len] = '\0';
  const char *bar = strrchr(buf, '|');
  int tagged = bar && (size_t)(buf + len - bar) == 1 + SEAL_HEX;
  if (s->on) {
    char want[SEAL_HEX + 1];
    if (tagged) seal_tag(s, name, buf, (size_t)(bar - buf), want);
    if (!tagged || !rpl_ct_equal(want, bar + 1, SEAL_HEX))
      return rpl_fail(err, RPL_ERR_INVALID,
                      "the store record %s (from %s) %s: it was not written by a rank holding "
                      "this job's secret (a rank started without RIPPLES_JOB_SECRET or with "
                      "another one, or someone else wrote the c10d store)", name, who,
                      tagged ? "fails its MAC with the job secret" : "carries no MAC");
    len = (size_t)(bar - buf);
  } else if (tagged) {
    /* No plain record ends in '|' and 32 hex digits: this one was sealed. Say why, rather
     * than "malformed" later. */
    return rpl_fail(err, RPL_ERR_INVALID, "%s published %s sealed with a job secret, and this "
                    "rank has none: set the same RIPPLES_JOB_SECRET on every rank", who, name);
  }
  if (len >= cap)
    return rpl_fail(err, RPL_ERR_INVALID, "%s published an over-long %s (%zu bytes)", who,
                    name, len);
  memcpy(out, buf, len);
  out[len] = '\0';
  *n = len;
  return RPL_OK;
}

/* Equal on ranks that can share memory: the caller's key, or hostname + boot id (two
 * containers with the same hostname on different machines must not match). */
static uint64_t host_hash(const char *key) {
  uint64_t h = RPL_FNV1A_INIT;
  if (key && *key) return rpl_fnv1a(h, key, strlen(key));
  char host[256] = "";
  gethostname(host, sizeof host - 1);
  h = rpl_fnv1a(h, host, strlen(host));
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    char boot[64] = "";
    if (fgets(boot, sizeof boot, f)) h = rpl_fnv1a(h, boot, strlen(boot));
    fclose(f);
  }
  return h;
}

/* Creates our rings, maps every local peer's, and unlinks ours once all have mapped it. */
static rpl_status setup_shm(rpl_tr *tr, const rpl_comm_config *cfg, const sealer *seal,
                            const int *local_of, rpl_error *err) {
  const rpl_store *store = seal->store;
  char name[96], key[64];
  /* The nonce makes the segment's name unguessable (the kernel's CSPRNG, no fallback): a
   * local user cannot create it first; peers check the header against the name. */
  uint64_t nonce;
  rpl_status st = rpl_random_bytes(&nonce, sizeof nonce, err);
  if (st != RPL_OK) return st;
  rpl_shm *shm;
  st = rpl_shm_create(cfg->rank, cfg->size, local_of, nonce,
                                 cfg->ring_bytes ? cfg->ring_bytes : DEFAULT_RING_BYTES, &shm,
                                 name, sizeof name, err);
  if (st != RPL_OK) return st;
  rpl_tr_set_shm(tr, shm); /* the transport owns it from here, also on failure */
  snprintf(key, sizeof key, "ripples/shm/%d", cfg->rank);
  if ((st = seal_set(seal, key, name, strlen(name), err)) != RPL_OK) return st;
  for (int p = 0; p < cfg->size; p++) {
    if (p == cfg->rank || local_of[p] < 0) continue;
    char peer[96], who[32];
    size_t len = 0;
    snprintf(key, sizeof key, "ripples/shm/%d", p);
    snprintf(who, sizeof who, "rank %d", p);
    if ((st = seal_get(seal, key, who, peer, sizeof peer, &len, err)) != RPL_OK) return st;
    if ((st = rpl_shm_attach(shm, p, peer, err)) != RPL_OK) return st;
  }
  snprintf(key, sizeof key, "ripples/shm-mapped/%d", cfg->rank);
  if ((st = store->set(store->ctx, key, "1", 1, err)) != RPL_OK) return st;
  for (int p = 0; p < cfg->size; p++) {
    if (p == cfg->rank || local_of[p] < 0) continue;
    char v[8];
    size_t len;
    snprintf(key, sizeof key, "ripples/shm-mapped/%d", p);
    if ((st = store->get(store->ctx, key, v, sizeof v, &len, err)) != RPL_OK) return st;
  }
  rpl_shm_unlink(shm);
  return RPL_OK;
}

/* The key every link of this communicator authenticates with (wire.h): rank 0 draws a salt
 * and publishes it; every rank keys it with the job secret, if the user gave one. Then keys
 * `seal` for the records that follow (bound to this salt). */
static rpl_status setup_link_key(rpl_tr *tr, const rpl_comm_config *cfg, sealer *seal,
                                 rpl_error *err) {
  enum { SALT = 32 };
  unsigned char salt[SALT];
  char hex[2 * SALT + 1];
  const char *key = "ripples/link-salt";
  const char *secret = cfg->job_secret ? cfg->job_secret : "";
  rpl_status st;
  seal_key(seal, secret, NULL, 0);
  if (cfg->rank == 0) {
    if ((st = rpl_random_bytes(salt, SALT, err)) != RPL_OK) return st;
    for (int i = 0; i < SALT; i++) snprintf(hex + 2 * i, 3, "%02x", salt[i]);
    if ((st = seal_set(seal, key, hex, 2 * SALT, err)) != RPL_OK) return st;
  } else {
    size_t len = 0;
    if ((st = seal_get(seal, key, "rank 0", hex, sizeof hex, &len, err)) != RPL_OK) return st;
    if (len != 2 * SALT)
      return rpl_fail(err, RPL_ERR_INVALID, "rank 0 published a malformed link salt (%zu "
                      "characters; a different ripples version?)", len);
    for (int i = 0; i < SALT; i++) {
      unsigned v;
      if (sscanf(hex + 2 * i, "%2x", &v) != 1)
        return rpl_fail(err, RPL_ERR_INVALID, "rank 0 published a malformed link salt");
      salt[i] = (unsigned char)v;
    }
  }
  unsigned char k[RPL_LINK_KEY_LEN];
  rpl_link_key(secret, strlen(secret), salt, SALT, k);
  seal_key(seal, secret, salt, SALT);
  rpl_tr_set_key(tr, k);
  rpl_tr_set_frame_macs(tr, cfg->frame_macs);
  explicit_bzero(k, sizeof k);
  return RPL_OK;
}

rpl_status rpl_bootstrap(rpl_tr *tr, const rpl_comm_config *cfg, const rpl_store *store,
                         unsigned char *same_host, rpl_error *err) {
  int rank = cfg->rank, size = cfg->size;
  sealer seal = {.store = store};
  rpl_status st = setup_link_key(tr, cfg, &seal, err);
  if (st != RPL_OK) return st;

  /* Exchange addresses: publish ours (with a hash of our host key, so peers can tell who
   * shares this machine), then read every peer's (waits for all to arrive). */
  char key[64], addr[160];
  uint64_t my_host = host_hash(cfg->host_key);
  rpl_tr_address(tr, addr, 128);
  snprintf(addr + strlen(addr), sizeof addr - strlen(addr), ":%016llx",
           (unsigned long long)my_host);
  snprintf(key, sizeof key, "ripples/addr/%d", rank);
  if ((st = seal_set(&seal, key, addr, strlen(addr), err)) != RPL_OK) goto wipe;
  int *local_of = malloc(sizeof(int) * (size_t)size);
  if (!local_of) {
    st = rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating a communicator");
    goto wipe;
  }
  int nlocal = 0;
  for (int p = 0; p < size; p++) {
    uint64_t h = my_host;
    if (p != rank) {
      char peer[160], who[32];
      size_t len = 0;
      snprintf(key, sizeof key, "ripples/addr/%d", p);
      snprintf(who, sizeof who, "rank %d", p);
      if ((st = seal_get(&seal, key, who, peer, sizeof peer, &len, err)) != RPL_OK) goto out;
      const char *hk = strrchr(peer, ':');
      unsigned long long hv = 0;
      if (!hk || sscanf(hk + 1, "%llx", &hv) != 1) {
        st = rpl_fail(err, RPL_ERR_INVALID, "rank %d published a malformed address '%.60s' "
                      "(a different ripples version?)", p, peer);
        goto out;
      }
      h = hv;
      if ((st = rpl_tr_set_peer(tr, p, peer, err)) != RPL_OK) goto out;
    }
    local_of[p] = h == my_host ? nlocal++ : -1;
    same_host[p] = h == my_host;
  }
  if (!cfg->tcp_only && nlocal > 1) st = setup_shm(tr, cfg, &seal, local_of, err);
out:
  free(local_of);
wipe:
  explicit_bzero(seal.key, sizeof seal.key);
  return st;
}
