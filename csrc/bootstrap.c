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
static rpl_status setup_shm(rpl_tr *tr, const rpl_comm_config *cfg, const rpl_store *store,
                            const int *local_of, rpl_error *err) {
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
  if ((st = store->set(store->ctx, key, name, strlen(name), err)) != RPL_OK) return st;
  for (int p = 0; p < cfg->size; p++) {
    if (p == cfg->rank || local_of[p] < 0) continue;
    char peer[96];
    size_t len = 0;
    snprintf(key, sizeof key, "ripples/shm/%d", p);
    if ((st = store->get(store->ctx, key, peer, sizeof peer - 1, &len, err)) != RPL_OK) return st;
    peer[len < sizeof peer ? len : sizeof peer - 1] = '\0';
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
 * and publishes it; every rank keys it with the job secret, if the user gave one. */
static rpl_status setup_link_key(rpl_tr *tr, const rpl_comm_config *cfg, const rpl_store *store,
                                 rpl_error *err) {
  enum { SALT = 32 };
  unsigned char salt[SALT];
  char hex[2 * SALT + 1];
  const char *key = "ripples/link-salt";
  rpl_status st;
  if (cfg->rank == 0) {
    if ((st = rpl_random_bytes(salt, SALT, err)) != RPL_OK) return st;
    for (int i = 0; i < SALT; i++) snprintf(hex + 2 * i, 3, "%02x", salt[i]);
    if ((st = store->set(store->ctx, key, hex, 2 * SALT, err)) != RPL_OK) return st;
  } else {
    size_t len = 0;
    if ((st = store->get(store->ctx, key, hex, sizeof hex - 1, &len, err)) != RPL_OK) return st;
    hex[sizeof hex - 1] = '\0';
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
  const char *secret = cfg->job_secret ? cfg->job_secret : "";
  unsigned char k[RPL_LINK_KEY_LEN];
  rpl_link_key(secret, strlen(secret), salt, SALT, k);
  rpl_tr_set_key(tr, k);
  explicit_bzero(k, sizeof k);
  return RPL_OK;
}

rpl_status rpl_bootstrap(rpl_tr *tr, const rpl_comm_config *cfg, const rpl_store *store,
                         unsigned char *same_host, rpl_error *err) {
  int rank = cfg->rank, size = cfg->size;
  rpl_status st = setup_link_key(tr, cfg, store, err);
  if (st != RPL_OK) return st;

  /* Exchange addresses: publish ours (with a hash of our host key, so peers can tell who
   * shares this machine), then read every peer's (waits for all to arrive). */
  char key[64], addr[160];
  uint64_t my_host = host_hash(cfg->host_key);
  rpl_tr_address(tr, addr, 128);
  snprintf(addr + strlen(addr), sizeof addr - strlen(addr), ":%016llx",
           (unsigned long long)my_host);
  snprintf(key, sizeof key, "ripples/addr/%d", rank);
  if ((st = store->set(store->ctx, key, addr, strlen(addr), err)) != RPL_OK) return st;
  int *local_of = malloc(sizeof(int) * (size_t)size);
  if (!local_of) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating a communicator");
  int nlocal = 0;
  for (int p = 0; p < size; p++) {
    uint64_t h = my_host;
    if (p != rank) {
      char peer[160];
      size_t len = 0;
      snprintf(key, sizeof key, "ripples/addr/%d", p);
      if ((st = store->get(store->ctx, key, peer, sizeof peer - 1, &len, err)) != RPL_OK)
        goto out;
      if (len >= sizeof peer) {
        st = rpl_fail(err, RPL_ERR_INVALID, "rank %d published an over-long address", p);
        goto out;
      }
      peer[len] = '\0';
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
  if (!cfg->tcp_only && nlocal > 1) st = setup_shm(tr, cfg, store, local_of, err);
out:
  free(local_of);
  return st;
}
