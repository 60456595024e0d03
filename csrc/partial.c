/* partial.c - partial all-reduce rounds. A round (rpl_partial_run) reads: get the group ->
 * check signatures -> reduce, exact or compressed -> confirm and commit (atomic write-back) ->
 * account. The fence around exact collectives is in fence.c. */
#include "partial.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "algorithms/algorithms.h"
#include "bytes.h"
#include "common.h"
#include "compress.h"
#include "ctx.h"
#include "fence.h"
#include "kernels.h"
#include "sched/rpl_sched.h"

#define SIG_BYTES 32 /* nin, elements, hash of (dtype, count), compression mode, flags */
#define STEP_COMMIT 0xfffe /* the step of confirm_whole's messages (signatures: 0xffff) */
#define SIG_SAME 28  /* the part every member must agree on; the flags are OR-ed */
#define SIG_FLAG_OUT_OF_RANGE 1u /* a value this member would compress is not finite or too big */
#define TRACE_SLOTS RPL_TRACE_CAPACITY

struct rpl_partial {
  rpl_fence fence;          /* its fence domain (fence.h); fence.left: the worker left */
  int rank, size;
  double timeout_s;
  rpl_on_failure on_failure;
  int dynamic;
  rpl_layout *layout;       /* static */
  rpl_gg_client *client;    /* dynamic */
  uint64_t round;           /* progress thread only */
  int *members;             /* size entries */
  rpl_compress compression;
  int *host_of;             /* size entries, or NULL (one host) */
  /* Error feedback of compressed rounds: the quantisation error each round leaves, added to
   * the next one's buffers. `next` is the candidate a round computes; the two swap when the
   * round commits, so a failed round leaves `resid` as it was. Reset (zeroed) when the
   * buffers' signature changes. */
  float *resid, *next;
  size_t resid_n;
  uint64_t resid_sig;

  /* RIPPLES_TEST_FAULT (tests only): in round fault_round, before exchange fault_at of the
   * round (0: the signatures), this rank exits (1), stalls past the deadline (2), or cuts its
   * TCP links (3: of fault_run, the round's run). */
  int fault_action, fault_at;
  uint64_t fault_round;
  rpl_run *fault_run;

  pthread_mutex_t mu;       /* guards stats, the trace, the outcomes and the given group */
  pthread_cond_t known_cv;  /* a round's group became known, or a round ended */
  rpl_partial_stats stats;
  rpl_trace_entry *trace;   /* TRACE_SLOTS ring, NULL when tracing is off */
  uint64_t trace_next;      /* index of the next entry */
  rpl_round_outcome last;   /* the last round (valid once stats.rounds > 0) */
  int *last_members;        /* size entries */
  int *given;               /* size entries: the next round's group when given_n > 0 */
  int given_n;
  uint64_t given_gid;
  /* The group of the newest round that has one, published before its data moves
   * (rpl_partial_group): valid for round `known_rounds` - 1 once known_rounds > 0. */
  int expecting;            /* the next round waits for its given group (rpl_partial_expect) */
  int lapsed;               /* an expecting round gave up: the late give is refused */
  int interrupted;          /* shutdown: a round waiting for its given group gives up */
  uint64_t known_rounds;    /* rounds whose group became known */
  rpl_round_outcome known;
  int *known_members;       /* size entries */
};

int rpl_partial_eligible(const rpl_op_desc *d) {
  if (d->redop != RPL_SUM && d->redop != RPL_AVG) return 0;
  for (int i = 0; i < d->nin; i++)
    if (!rpl_dtype_is_floating(d->in[i].dtype)) return 0;
  return 1;
}

/* RIPPLES_TEST_FAULT="exit|stall|cut:ROUND:EXCHANGE", for the fault-injection tests
 * (tests/test_round_faults.py): a process that sets it dies, stalls or has its TCP links cut
 * at that point of that round. Anything else in it is ignored (no fault). */
static void parse_fault(rpl_partial *p) {
  const char *f = getenv("RIPPLES_TEST_FAULT");
  char what[8];
  unsigned long long round;
  int at;
  if (!f || sscanf(f, "%7[a-z]:%llu:%d", what, &round, &at) != 3 || at < 0) return;
  p->fault_action = strcmp(what, "exit") == 0    ? 1
                    : strcmp(what, "stall") == 0 ? 2
                    : strcmp(what, "cut") == 0   ? 3
                                                 : 0;
  p->fault_round = round;
  p->fault_at = at;
}

static void fire_fault(void *arg, int k) {
  rpl_partial *p = arg;
  if (k != p->fault_at) return;
  if (p->fault_action == 1) _exit(17); /* as a kill: no goodbye, no flush */
  if (p->fault_action == 3) {
    rpl_run_cut_links(p->fault_run);
    return;
  }
  struct timespec ts = {(time_t)(p->timeout_s + 1.0), 0};
  nanosleep(&ts, NULL); /* past every member's deadline */
}

rpl_status rpl_partial_create(const rpl_partial_config *cfg, int rank, int size,
                              double timeout_s, rpl_partial **out, rpl_error *err) {
  *out = NULL;
  if (!cfg->schedule)
    return rpl_fail(err, RPL_ERR_INVALID, "a partial schedule needs a policy name");
  rpl_policy policy;
  rpl_status st = rpl_policy_parse(cfg->schedule, &policy, err);
  if (st != RPL_OK) return st;
  if ((unsigned)cfg->compression >= RPL_COMPRESS_COUNT)
    return rpl_fail(err, RPL_ERR_INVALID, "unknown compression mode %d", (int)cfg->compression);
  rpl_partial *p = calloc(1, sizeof *p);
  if (!p) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory enabling partial rounds");
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->known_cv, NULL);
  p->rank = rank;
  p->size = size;
  p->timeout_s = timeout_s;
  p->on_failure = cfg->on_failure;
  p->compression = cfg->compression;
  parse_fault(p);
  p->members = calloc((size_t)size, sizeof(int));
  p->last_members = calloc((size_t)size, sizeof(int));
  p->given = calloc((size_t)size, sizeof(int));
  p->known_members = calloc((size_t)size, sizeof(int));
  if (!p->members || !p->last_members || !p->given || !p->known_members) {
    st = rpl_fail(err, RPL_ERR_NOMEM, "out of memory enabling partial rounds");
    goto fail;
  }
  if (cfg->host_of) {
    p->host_of = malloc(sizeof(int) * (size_t)size);
    if (!p->host_of) {
      st = rpl_fail(err, RPL_ERR_NOMEM, "out of memory enabling partial rounds");
      goto fail;
    }
    memcpy(p->host_of, cfg->host_of, sizeof(int) * (size_t)size);
  }
  if (cfg->trace) {
    p->trace = calloc(TRACE_SLOTS, sizeof *p->trace);
    if (!p->trace) {
      st = rpl_fail(err, RPL_ERR_NOMEM, "out of memory for the round trace");
      goto fail;
    }
  }
  if (policy == RPL_POLICY_STATIC) {
    if ((st = rpl_layout_create(size, cfg->host_of, &p->layout, err)) != RPL_OK) goto fail;
  } else {
    if (!cfg->endpoint || !*cfg->endpoint || !cfg->token_hex) {
      st = rpl_fail(err, RPL_ERR_INVALID,
                    "schedule '%s' needs a coordinator endpoint and token", cfg->schedule);
      goto fail;
    }
    p->dynamic = 1;
    int timeout_ms = (int)RPL_MIN(timeout_s * 1000.0, 2e9);
    rpl_gg_client_config cc = {.endpoint = cfg->endpoint,
                               .token_hex = cfg->token_hex,
                               .rank = rank,
                               .nworkers = size,
                               .host_label = cfg->host_of ? cfg->host_of[rank] : -1,
                               .timeout_ms = RPL_MIN(timeout_ms, 30000),
                               .request_timeout_ms = timeout_ms};
    if ((st = rpl_gg_client_create(&cc, &p->client, err)) != RPL_OK) goto fail;
    p->fence.client = p->client;
  }
  /* Every schedule joins the domain: its exact collectives must fence the dynamic ones. */
  if ((st = rpl_fence_join(&p->fence, cfg->domain, err)) != RPL_OK) goto fail;
  *out = p;
  return RPL_OK;
fail:
  rpl_partial_destroy(p);
  return st;
}

void rpl_partial_leave(rpl_partial *p) {
  if (!p || !p->client || p->fence.left) return;
  p->fence.left = 1;
  rpl_error err;
  rpl_gg_client_leave(p->client, &err); /* best effort: heartbeats stopping says the same */
}

void rpl_partial_destroy(rpl_partial *p) {
  if (!p) return;
  rpl_fence_leave(&p->fence);
  rpl_partial_leave(p);
  if (p->client) rpl_gg_client_destroy(p->client);
  rpl_layout_destroy(p->layout);
  free(p->members);
  free(p->last_members);
  free(p->given);
  free(p->known_members);
  free(p->host_of);
  free(p->resid);
  free(p->next);
  free(p->trace);
  pthread_cond_destroy(&p->known_cv);
  pthread_mutex_destroy(&p->mu);
  free(p);
}

void rpl_partial_count_fallback(rpl_partial *p) {
  pthread_mutex_lock(&p->mu);
  p->stats.exact_fallbacks++;
  pthread_mutex_unlock(&p->mu);
}

void rpl_partial_before_exact(rpl_partial *p) { rpl_fence_before_exact(&p->fence); }

void rpl_partial_after_exact(rpl_partial *p, int more) { rpl_fence_after_exact(&p->fence, more); }

void rpl_partial_fence_alone(rpl_partial *p) { rpl_fence_go_alone(&p->fence); }

/* ---- one round ------------------------------------------------------------------------- */

static uint64_t sig_hash(const rpl_op_desc *d) {
  uint64_t h = RPL_FNV1A_INIT; /* over (dtype, count) pairs */
  for (int i = 0; i < d->nin; i++) {
    uint64_t v[2] = {(uint64_t)d->in[i].dtype, (uint64_t)d->in[i].count};
    h = rpl_fnv1a(h, v, sizeof v);
  }
  return h;
}


/* Every member sends its signature to every other. Either all agree, or every member builds
 * the same error message from the same set of signatures. No tensor data has moved yet.
 * `flags` goes out with it; *flags_or is the OR of every member's (valid when RPL_OK). */
static rpl_status check_signatures(rpl_run *run, const rpl_op_desc *d, uint64_t group_id,
                                   rpl_compress mode, uint32_t flags, uint32_t *flags_or,
                                   rpl_error *err) {
  int n = run->size, me = run->rank;
  uint64_t total = 0;
  for (int i = 0; i < d->nin; i++) total += d->in[i].count;
  unsigned char *all = rpl_scratch(run, 0, (size_t)n * SIG_BYTES);
  if (!all) return RPL_ERR_NOMEM;
  unsigned char *mine = all + (size_t)me * SIG_BYTES;
  rpl_put64(mine, (uint64_t)d->nin);
  rpl_put64(mine + 8, total);
  rpl_put64(mine + 16, sig_hash(d));
  rpl_put32(mine + 24, (uint32_t)mode);
  rpl_put32(mine + 28, flags);
  rpl_xfer *xs = malloc(sizeof(rpl_xfer) * 2 * (size_t)n);
  if (!xs) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory in a partial round");
  int k = 0;
  for (int v = 0; v < n; v++) {
    if (v == me) continue;
    /* dtype/count checks belong to the signature itself, so the headers carry neutral values */
    xs[k++] = rpl_send(run, v, mine, SIG_BYTES, RPL_UINT8, SIG_BYTES, 0xffff);
    xs[k++] = rpl_recv(run, v, all + (size_t)v * SIG_BYTES, SIG_BYTES, RPL_UINT8, SIG_BYTES,
                       0xffff);
  }
  /* The header's tag carries nbufs; let it differ here so the signature reports it. */
  for (int i = 0; i < k; i++) xs[i].meta.tag = 0;
  rpl_status st = rpl_exchange(run, xs, k);
  free(xs);
  if (st != RPL_OK) return st;
  int same = 1, same_mode = 1;
  *flags_or = 0;
  for (int v = 0; v < n; v++) {
    const unsigned char *sv = all + (size_t)v * SIG_BYTES;
    same &= memcmp(sv, all, SIG_SAME) == 0;
    same_mode &= rpl_get32(sv + 24) == rpl_get32(all + 24);
    *flags_or |= rpl_get32(sv + 28);
  }
  if (same) return RPL_OK;
  char list[300] = "";
  size_t used = 0;
  for (int v = 0; v < n && used < sizeof list - 1; v++) {
    const unsigned char *sv = all + (size_t)v * SIG_BYTES;
    int w;
    if (!same_mode) /* a peer's number, so bounded by rpl_compress_name ("?") */
      w = snprintf(list + used, sizeof list - used, "%srank %d: %s", v ? "; " : "",
                   run->members[v], rpl_compress_name((rpl_compress)rpl_get32(sv + 24)));
    else
      w = snprintf(list + used, sizeof list - used, "%srank %d: %llu tensor(s), %llu elements",
                   v ? "; " : "", run->members[v], (unsigned long long)rpl_get64(sv),
                   (unsigned long long)rpl_get64(sv + 8));
    if (w < 0) break;
    used += (size_t)w;
  }
  if (!same_mode)
    return rpl_fail(err, RPL_ERR_MISMATCH,
                    "partial all-reduce group %llu: members use different compression settings "
                    "(%s); every rank must set the same Options.compression",
                    (unsigned long long)group_id, list);
  return rpl_fail(err, RPL_ERR_MISMATCH,
                  "partial all-reduce group %llu: members passed different tensors (%s); every "
                  "member of a round must pass the same number of tensors with the same sizes "
                  "and dtypes", (unsigned long long)group_id, list);
}

/* A round's commit point. The reduction leaves each member's result in a working copy, and
 * members finish its last step at different moments; a member that failed there (its
 * partner died, stalled past the deadline, or a link was cut) would leave the others
 * committed. So every member first tells every other that it holds the whole result (an
 * empty message each way), and writes back only once all have said so. A member that dies
 * after confirming changes nothing for the others (they commit; it is gone).
 *
 * Confirmations to members on other hosts go first, and those to this host's members
 * (shared memory, written at once) only once the remote ones are done both ways: a member
 * whose network link fails there (a cut, which a send may not even notice) never confirms
 * to its own host's members, so they fail with it instead of committing beside a remote
 * member that failed. The window left is a member stalling between its confirmations and the
 * others' for longer than the round's deadline, or dying between the two runs or in the
 * middle of one (docs/fault-tolerance.md). */
static rpl_status confirm_whole(const rpl_partial *p, rpl_run *run, double *took) {
  double t = rpl_now();
  int n = run->size, k = 0, remote = 0;
  rpl_xfer *xs = malloc(sizeof(rpl_xfer) * 2 * (size_t)n);
  if (!xs) return rpl_fail(run->err, RPL_ERR_NOMEM, "out of memory in a partial round");
  const int me = run->members[run->rank];
  for (int pass = 0; pass < 2; pass++) {
    for (int v = 0; v < n; v++) {
      if (v == run->rank) continue;
      int other_host = p->host_of && p->host_of[run->members[v]] != p->host_of[me];
      if (other_host != (pass == 0)) continue;
      xs[k++] = rpl_send(run, v, NULL, 0, RPL_UINT8, 0, STEP_COMMIT);
      xs[k++] = rpl_recv(run, v, NULL, 0, RPL_UINT8, 0, STEP_COMMIT);
    }
    if (pass == 0) remote = k;
  }
  rpl_status st;
  if (remote > 0 && remote < k) {
    st = rpl_exchange(run, xs, remote);
    if (st == RPL_OK) st = rpl_exchange_more(run, xs + remote, k - remote);
  } else {
    st = rpl_exchange(run, xs, k);
  }
  free(xs);
  *took += rpl_now() - t;
  /* The test hook's last point: every member confirmed, nothing written back yet. */
  if (st == RPL_OK && run->before_exchange) run->before_exchange(run->hook_arg, run->exchanges);
  return st;
}

/* Whether this round compresses: a mode is set, every buffer is float32 (the same answer on
 * every member once the signatures agree), and the group spans more than one host (host_of
 * is the same on every member). */
static int compresses(const rpl_partial *p, const rpl_op_desc *d, int n) {
  if (p->compression == RPL_COMPRESS_NONE || !p->host_of) return 0;
  for (int i = 0; i < d->nin; i++)
    if (d->in[i].dtype != RPL_FLOAT32) return 0;
  for (int i = 1; i < n; i++)
    if (p->host_of[p->members[i]] != p->host_of[p->members[0]]) return 1;
  return 0;
}

/* Sizes the residual for `total` elements of the buffers with signature `sig`: zeroed when
 * either changed. */
static rpl_status residual_for(rpl_partial *p, uint64_t sig, size_t total, rpl_error *err) {
  if (p->resid && p->resid_n == total && p->resid_sig == sig) return RPL_OK;
  free(p->resid);
  free(p->next);
  p->resid = calloc(total ? total : 1, sizeof(float));
  p->next = malloc(sizeof(float) * (total ? total : 1));
  p->resid_n = total;
  p->resid_sig = sig;
  if (!p->resid || !p->next) {
    free(p->resid);
    free(p->next);
    p->resid = p->next = NULL;
    return rpl_fail(err, RPL_ERR_NOMEM,
                    "out of memory for the compression residual (%zu bytes, twice)",
                    total * sizeof(float));
  }
  return RPL_OK;
}

static void record(rpl_partial *p, uint64_t round, uint64_t group_id, const int *members,
                   int n, rpl_status st) {
  if (!p->trace) return;
  rpl_trace_entry *e = &p->trace[p->trace_next % TRACE_SLOTS];
  e->round = round;
  e->group_id = group_id;
  e->status = (int)st;
  e->nmembers = n;
  for (int i = 0; i < n && i < RPL_TRACE_MEMBERS; i++) e->members[i] = members[i];
  p->trace_next++;
}

/* What one round did, for its accounting (account). */
typedef struct round_info {
  uint64_t round, gid;
  int n;             /* the group's size (0 when no group came) */
  int me;            /* this rank's position in it */
  size_t bytes;      /* the buffers' payload bytes */
  uint64_t wire;     /* bytes this rank sent reducing them */
  int moved, compressed, fellback;
  int given;         /* the group came from rpl_partial_give */
  double t0, t1, t2, t3; /* start, group known, signatures agreed, reduced */
  double tconf;          /* in confirm_whole */
} round_info;

/* Under mu: waits on known_cv until `deadline` (or a broadcast). */
static void wait_until(rpl_partial *p, double deadline) {
  double left = deadline - rpl_now();
  if (left <= 0) return;
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until); /* the condition variable's clock */
  long ns = until.tv_nsec + (long)((left - (double)(long)left) * 1e9);
  until.tv_sec += (time_t)(long)left + ns / 1000000000L;
  until.tv_nsec = ns % 1000000000L;
  pthread_cond_timedwait(&p->known_cv, &p->mu, &until);
}

/* The group given for this round, if any, into p->members[0..n); clears it. A round that
 * expects one (rpl_partial_expect) waits for it until `deadline`. */
static rpl_status take_given(rpl_partial *p, round_info *r, double deadline, rpl_error *err) {
  rpl_status st = RPL_OK;
  pthread_mutex_lock(&p->mu);
  while (p->expecting && p->given_n == 0 && !p->interrupted && rpl_now() < deadline)
    wait_until(p, deadline);
  r->given = p->given_n > 0;
  if (r->given) {
    memcpy(p->members, p->given, sizeof(int) * (size_t)p->given_n);
    r->n = p->given_n;
    r->gid = p->given_gid;
    p->given_n = 0;
  } else if (p->expecting) {
    p->lapsed = 1;
    st = p->interrupted
             ? rpl_fail(err, RPL_ERR_CLOSED, "partial round %llu: the process group was shut "
                        "down while it waited for its group", (unsigned long long)r->round)
             : rpl_fail(err, RPL_ERR_TIMEOUT, "partial round %llu: the group it expected "
                        "(rpl_comm_partial_expect) was not given before its deadline",
                        (unsigned long long)r->round);
  }
  p->expecting = 0;
  pthread_mutex_unlock(&p->mu);
  return st;
}

/* Makes the round's group known to rpl_partial_group's waiters, before any data moves. */
static void publish_group(rpl_partial *p, const round_info *r) {
  pthread_mutex_lock(&p->mu);
  p->known = (rpl_round_outcome){
      .round = r->round, .group_id = r->gid, .nmembers = r->n, .given = r->given};
  memcpy(p->known_members, p->members, sizeof(int) * (size_t)r->n);
  p->known_rounds = r->round + 1;
  pthread_cond_broadcast(&p->known_cv);
  pthread_mutex_unlock(&p->mu);
}

/* The round's group -- given, from the coordinator or the static schedule -- into
 * p->members[0..n). */
static rpl_status get_group(rpl_partial *p, round_info *r, double deadline, rpl_error *err) {
  rpl_status st = take_given(p, r, deadline, err);
  if (st != RPL_OK || r->given) {
    /* no schedule asked; a given group was checked by rpl_partial_give */
  } else if (p->dynamic) {
    rpl_fence_before_request(&p->fence);
    st = rpl_gg_client_request(p->client, r->round, p->members, p->size, &r->n, &r->gid, err);
    rpl_fence_after_request(&p->fence);
  } else {
    st = rpl_static_group(p->layout, p->rank, r->round, p->members, p->size, &r->n, &r->gid,
                          err);
  }
  r->t1 = r->t2 = r->t3 = rpl_now();
  r->me = -1;
  for (int i = 0; st == RPL_OK && i < r->n; i++)
    if (p->members[i] == p->rank) r->me = i;
  if (st == RPL_OK && r->me < 0)
    st = rpl_fail(err, RPL_ERR_INVALID, "the group generator left rank %d out of its own group",
                  p->rank);
  if (st == RPL_OK) publish_group(p, r);
  return st;
}

/* Narrows the run to the group, with the fault hook in the fault round (tests only). */
static void narrow_run(rpl_partial *p, rpl_run *run, const round_info *r) {
  run->members = p->members;
  run->rank = r->me;
  run->size = r->n;
  run->seq = r->gid;
  if (p->fault_action && r->round == p->fault_round) {
    run->before_exchange = fire_fault;
    run->hook_arg = p;
    p->fault_run = run;
  }
}

static int coordinator_lost(void *client) { return rpl_gg_client_lost(client); }

/* A compressing round works on y = buffers + residual (in p->next), checked before the
 * signatures go out so that every member learns whether all can compress. Then the
 * signatures; *flags_or is every member's flags OR-ed. */
static rpl_status prepare_and_agree(rpl_partial *p, rpl_run *run, const rpl_op_desc *d,
                                    int comp, size_t total, const round_info *r,
                                    uint32_t *flags_or, rpl_error *err) {
  rpl_status st = RPL_OK;
  uint32_t flags = 0;
  if (comp && (st = residual_for(p, sig_hash(d), total, err)) == RPL_OK) {
    size_t off = 0;
    for (int i = 0; i < d->nin; i++) {
      const float *x = d->in[i].ptr;
      for (size_t j = 0; j < d->in[i].count; j++) p->next[off + j] = x[j] + p->resid[off + j];
      off += d->in[i].count;
    }
    if (!rpl_cq_in_range(p->next, total, rpl_cq_limit(p->compression)))
      flags |= SIG_FLAG_OUT_OF_RANGE;
  }
  if (st != RPL_OK) return st;
  /* The coordinator hands a group to all its members at once, so they meet here within
   * moments -- unless it died while handing it out: a member that never received it is not
   * coming, and the others would wait for it until the round's deadline. Once our client
   * has lost that coordinator, they stop waiting (no data has moved yet). */
  int handed = p->dynamic && !r->given; /* a given group came from no coordinator */
  if (handed) {
    run->give_up = coordinator_lost;
    run->give_up_arg = p->client;
  }
  st = check_signatures(run, d, r->gid, p->compression, flags, flags_or, err);
  run->give_up = NULL;
  if (st == RPL_ERR_PEER && handed && rpl_gg_client_lost(p->client))
    st = rpl_fail(err, RPL_ERR_PEER,
                  "partial all-reduce group %llu (round %llu): the group generator was lost "
                  "while handing it out, and not every member came; nothing was averaged",
                  (unsigned long long)r->gid, (unsigned long long)r->round);
  return st;
}

/* Commit of a compressed round: the buffers and the residual change together, only now. */
static void commit_compressed(rpl_partial *p, const rpl_op_desc *d, float *out, size_t total) {
  if (d->redop == RPL_SUM) rpl_scale(out, total, RPL_FLOAT32, (double)p->size);
  size_t off = 0;
  for (int i = 0; i < d->nin; i++) {
    if (d->in[i].count) memcpy(d->in[i].ptr, out + off, d->in[i].count * sizeof(float));
    off += d->in[i].count;
  }
  float *t = p->resid;
  p->resid = p->next;
  p->next = t;
}

static rpl_status reduce_compressed(rpl_partial *p, rpl_run *run, const rpl_op_desc *d,
                                    size_t total, round_info *r) {
  float *out = rpl_scratch(run, 2, total * sizeof(float));
  rpl_status st = out ? rpl_compressed_average(run, p->next, total, p->compression, out)
                      : RPL_ERR_NOMEM;
  if (st == RPL_OK) st = confirm_whole(p, run, &r->tconf);
  if (st == RPL_OK) {
    commit_compressed(p, d, out, total);
    r->moved = r->compressed = 1;
  }
  return st;
}

/* Commit of an exact round: the average (or the sum scaled to the communicator's size) into
 * the caller's buffers; a fallen-back compressing round delivered its residual, so clear it. */
static void commit_exact(rpl_partial *p, const rpl_op_desc *d, unsigned char *work,
                         size_t total, const round_info *r) {
  size_t off = 0;
  for (int i = 0; i < d->nin; i++) {
    size_t b = d->in[i].count * rpl_dtype_size(d->in[i].dtype);
    if (d->redop == RPL_AVG) rpl_divide(work + off, d->in[i].count, d->in[i].dtype, r->n);
    else rpl_scale(work + off, d->in[i].count, d->in[i].dtype, (double)p->size / r->n);
    if (b) memcpy(d->in[i].ptr, work + off, b);
    off += b;
  }
  if (r->fellback) memset(p->resid, 0, total * sizeof(float));
}

/* Exact. A compressing round that a member's values keep from compressing (comp set) sends
 * the buffers plus the residual (y), which delivers the residual and clears it. */
static rpl_status reduce_exact(rpl_partial *p, rpl_run *run, const rpl_op_desc *d, int comp,
                               size_t total, round_info *r) {
  r->fellback = comp;
  /* Reduce a working copy; the caller's buffers change only once everything arrived. */
  unsigned char *work = rpl_scratch(run, 2, r->bytes);
  rpl_status st = work ? RPL_OK : RPL_ERR_NOMEM;
  size_t off = 0;
  for (int i = 0; st == RPL_OK && i < d->nin; i++) {
    size_t b = d->in[i].count * rpl_dtype_size(d->in[i].dtype);
    if (b) memcpy(work + off, r->fellback ? (void *)((unsigned char *)p->next + off)
                                          : d->in[i].ptr, b);
    rpl_buf wb = {work + off, d->in[i].count, d->in[i].dtype};
    st = rpl_allreduce_buf(run, &wb, RPL_SUM, (unsigned)i);
    off += b;
  }
  if (st == RPL_OK) st = confirm_whole(p, run, &r->tconf);
  if (st == RPL_OK) {
    commit_exact(p, d, work, total, r);
    r->moved = 1;
  }
  return st;
}

/* A group of two or more: agree on the buffers, reduce (compressed or exact), commit. */
static rpl_status reduce_group(rpl_partial *p, rpl_run *run, const rpl_op_desc *d,
                               round_info *r, rpl_error *err) {
  narrow_run(p, run, r);
  size_t total = 0;
  for (int i = 0; i < d->nin; i++) {
    total += d->in[i].count;
    r->bytes += d->in[i].count * rpl_dtype_size(d->in[i].dtype);
  }
  int comp = compresses(p, d, r->n);
  uint32_t flags_or = 0;
  rpl_status st = prepare_and_agree(p, run, d, comp, total, r, &flags_or, err);
  r->t2 = rpl_now();
  uint64_t sent0 = rpl_run_bytes_sent(run);
  if (st == RPL_OK && comp && !(flags_or & SIG_FLAG_OUT_OF_RANGE))
    st = reduce_compressed(p, run, d, total, r);
  else if (st == RPL_OK)
    st = reduce_exact(p, run, d, comp, total, r);
  r->wire = rpl_run_bytes_sent(run) - sent0;
  r->t3 = rpl_now();
  if (st != RPL_OK && st != RPL_ERR_MISMATCH) {
    /* Streams with the group may be mid-message: start them afresh next time. A signature
     * mismatch is detected after complete messages, so those connections stay usable. */
    rpl_reset_peers(run);
  }
  p->fault_run = NULL; /* the run lives on the caller's stack: never kept past its round */
  return st;
}

/* Counts the round and records it in the trace. Returns what the round returns: RPL_OK for a
 * failure on_failure = SKIP absorbs. */
static rpl_status account(rpl_partial *p, const round_info *r, rpl_status st) {
  int skip = st != RPL_OK && p->on_failure == RPL_ON_FAILURE_SKIP && st != RPL_ERR_CLOSED;
  /* the adaptive period: no group (a given group of one is one) */
  int passed = p->dynamic && !r->given && st == RPL_OK && r->gid == 0;
  int n = r->n, kept = st == RPL_OK || r->gid ? n : 0; /* members the trace names */
  pthread_mutex_lock(&p->mu);
  rpl_partial_stats *s = &p->stats;
  s->rounds++;
  s->given += (uint64_t)r->given;
  if (passed) {
    s->passed++; /* neither a group of one nor the end of a run of them */
  } else {
    if (r->moved) s->rounds_since_group = 0;
    else if (++s->rounds_since_group > s->singleton_run_max)
      s->singleton_run_max = s->rounds_since_group;
    if (st == RPL_OK) {
      if (r->moved) s->reduced++;
      else s->singletons++;
      s->group_sizes[n < RPL_HIST_BUCKETS - 1 ? n : RPL_HIST_BUCKETS - 1]++;
      s->bytes += r->moved ? r->bytes : 0;
      s->wire_bytes += r->moved ? r->wire : 0;
      s->compressed += (uint64_t)r->compressed;
      s->compress_fallbacks += (uint64_t)(r->moved && r->fellback);
    } else if (skip) {
      s->skipped++;
    } else {
      s->failed++;
    }
  }
  s->group_s += r->t1 - r->t0;
  s->wait_s += r->t2 - r->t1;
  s->reduce_s += r->t3 - r->t2;
  s->confirm_s += r->tconf;
  record(p, r->round, r->gid, p->members, kept, st);
  p->last = (rpl_round_outcome){.round = r->round, .group_id = r->gid, .status = (int)st,
                                .nmembers = kept, .moved = r->moved, .given = r->given};
  if (kept) memcpy(p->last_members, p->members, sizeof(int) * (size_t)kept);
  pthread_cond_broadcast(&p->known_cv); /* a round that ended without a group wakes them too */
  pthread_mutex_unlock(&p->mu);
  return skip ? RPL_OK : st;
}

rpl_status rpl_partial_run(rpl_partial *p, rpl_run *run, const rpl_op_desc *d, rpl_error *err) {
  round_info r = {.round = p->round++, .t0 = rpl_now()};
  run->deadline = r.t0 + (d->timeout_s > 0 ? d->timeout_s : p->timeout_s);
  rpl_status st = get_group(p, &r, run->deadline, err);
  if (st == RPL_OK && r.n > 1) {
    st = reduce_group(p, run, d, &r, err);
  } else if (st == RPL_OK && d->redop == RPL_SUM && p->size > 1) {
    /* A group of one: SUM is its average scaled to the communicator, as commit_exact does. */
    for (int i = 0; i < d->nin; i++)
      rpl_scale(d->in[i].ptr, d->in[i].count, d->in[i].dtype, (double)p->size);
  }
  if (p->dynamic && r.gid && !r.given) { /* a given group is none of the coordinator's */
    rpl_error e2;
    rpl_gg_client_done(p->client, r.gid, st == RPL_OK ? 0u : (uint32_t)st, &e2);
  }
  return account(p, &r, st);
}

void rpl_partial_get_stats(const rpl_partial *p, rpl_partial_stats *out) {
  rpl_partial *m = (rpl_partial *)p; /* the mutex is not part of the logical state */
  pthread_mutex_lock(&m->mu);
  *out = p->stats;
  pthread_mutex_unlock(&m->mu);
  out->fences = __atomic_load_n(&p->fence.fences, __ATOMIC_RELAXED);
  out->unfences = __atomic_load_n(&p->fence.unfences, __ATOMIC_RELAXED);
  if (p->client) {
    rpl_gg_client_stats cs;
    rpl_gg_client_get_stats(p->client, &cs);
    out->coordinator_failovers = cs.failovers;
    out->period = cs.period;
  }
}

size_t rpl_partial_get_trace(const rpl_partial *p, uint64_t from, rpl_trace_entry *out,
                             size_t cap) {
  rpl_partial *m = (rpl_partial *)p;
  size_t k = 0;
  pthread_mutex_lock(&m->mu);
  if (p->trace) {
    uint64_t oldest = p->trace_next > TRACE_SLOTS ? p->trace_next - TRACE_SLOTS : 0;
    for (uint64_t i = from > oldest ? from : oldest; i < p->trace_next && k < cap; i++)
      out[k++] = p->trace[i % TRACE_SLOTS];
  }
  pthread_mutex_unlock(&m->mu);
  return k;
}

int rpl_partial_last(const rpl_partial *p, rpl_round_outcome *out, int *members, int cap) {
  rpl_partial *m = (rpl_partial *)p;
  pthread_mutex_lock(&m->mu);
  int have = p->stats.rounds > 0; /* every round is accounted, and only rounds are */
  if (have) {
    *out = p->last;
    for (int i = 0; i < p->last.nmembers && i < cap; i++) members[i] = p->last_members[i];
  }
  pthread_mutex_unlock(&m->mu);
  return have;
}

int rpl_partial_group(const rpl_partial *p, uint64_t round, double timeout_s,
                      rpl_round_outcome *out, int *members, int cap) {
  rpl_partial *m = (rpl_partial *)p; /* the mutex and condition are not the logical state */
  double deadline = rpl_now() + (timeout_s > 0 ? RPL_MIN(timeout_s, 1e6) : 0);
  pthread_mutex_lock(&m->mu);
  int rc = -1;
  for (;;) {
    if (m->known_rounds > round) { /* known: this round's group, unless a later one's */
      rc = m->known.round == round;
      break;
    }
    if (m->stats.rounds > round) { /* ended without a group */
      rc = 0;
      break;
    }
    if (rpl_now() >= deadline) break;
    wait_until(m, deadline);
  }
  if (rc == 1) {
    *out = m->known;
    for (int i = 0; i < m->known.nmembers && i < cap; i++) members[i] = m->known_members[i];
  }
  pthread_mutex_unlock(&m->mu);
  return rc;
}

/* Checked on the caller's thread, where a refusal can be raised at once: a round never
 * meets a group it cannot run. */
static rpl_status check_given(const rpl_partial *p, const int *members, int n,
                              uint64_t group_id, rpl_error *err) {
  if (n < 1 || n > p->size)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "a given group has %d members; it must have 1 to %d (the group's size)", n,
                    p->size);
  if (!members) return rpl_fail(err, RPL_ERR_INVALID, "a given group's members are NULL");
  int mine = 0;
  for (int i = 0; i < n; i++) {
    if (members[i] < 0 || members[i] >= p->size)
      return rpl_fail(err, RPL_ERR_INVALID,
                      "given member %d (position %d) is out of range: group ranks are 0 to %d",
                      members[i], i, p->size - 1);
    if (i > 0 && members[i] <= members[i - 1])
      return rpl_fail(err, RPL_ERR_INVALID,
                      "given members must be sorted and distinct: %d follows %d (position %d)",
                      members[i], members[i - 1], i);
    mine |= members[i] == p->rank;
  }
  if (!mine)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "this rank (%d) is not among the %d given members: a rank can only give "
                    "its own group", p->rank, n);
  if (n > 1 && group_id == 0)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "a given group of %d members needs a nonzero group id, the same on every "
                    "member", n);
  return RPL_OK;
}

rpl_status rpl_partial_give(rpl_partial *p, const int *members, int n, uint64_t group_id,
                            rpl_error *err) {
  rpl_status st = check_given(p, members, n, group_id, err);
  if (st != RPL_OK) return st;
  pthread_mutex_lock(&p->mu);
  /* Refused rather than replaced: a second give means a round the caller meant to give a
   * group to never ran, and averaging with the wrong members would go unnoticed. */
  int pending = p->given_n, lapsed = p->lapsed;
  uint64_t pending_gid = p->given_gid;
  p->lapsed = 0;
  if (!pending && !lapsed) {
    memcpy(p->given, members, sizeof(int) * (size_t)n);
    p->given_n = n;
    p->given_gid = group_id;
    pthread_cond_broadcast(&p->known_cv); /* a round that expects it may be waiting */
  }
  pthread_mutex_unlock(&p->mu);
  if (lapsed)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "the partial round that expected this group (rpl_comm_partial_expect) has "
                    "already ended without it (its deadline passed); the group was not kept");
  if (pending)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "a group given earlier (id %llu, %d members) has not had its partial round "
                    "yet: give one group per round, after the previous round ran",
                    (unsigned long long)pending_gid, pending);
  return RPL_OK;
}

rpl_status rpl_partial_expect(rpl_partial *p, rpl_error *err) {
  pthread_mutex_lock(&p->mu);
  int busy = p->expecting || p->given_n;
  if (!busy) {
    p->expecting = 1;
    p->lapsed = 0;
  }
  pthread_mutex_unlock(&p->mu);
  if (busy)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "the next partial round already has or expects a given group: expect one "
                    "group per round");
  return RPL_OK;
}

int rpl_partial_expecting(const rpl_partial *p) {
  rpl_partial *m = (rpl_partial *)p;
  pthread_mutex_lock(&m->mu);
  int e = p->expecting;
  pthread_mutex_unlock(&m->mu);
  return e;
}

void rpl_partial_interrupt(rpl_partial *p) {
  pthread_mutex_lock(&p->mu);
  p->interrupted = 1;
  pthread_cond_broadcast(&p->known_cv);
  pthread_mutex_unlock(&p->mu);
}
