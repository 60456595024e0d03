/* fence.c - fence domains: fencing the dynamic schedules around exact collectives (fence.h). */
#include "fence.h"

#include <pthread.h>
#include <stdlib.h>

#include "common.h"

/* A fence domain: the dynamic schedules of one process. */
struct rpl_domain {
  pthread_mutex_t mu; /* guards the list and the count */
  rpl_fence **members;
  int n, cap;
  int in_exact;       /* exact collectives of the process running now */
};

rpl_status rpl_domain_create(rpl_domain **out, rpl_error *err) {
  rpl_domain *d = calloc(1, sizeof *d);
  if (!d) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating a fence domain");
  pthread_mutex_init(&d->mu, NULL);
  *out = d;
  return RPL_OK;
}

void rpl_domain_destroy(rpl_domain *d) {
  if (!d) return;
  pthread_mutex_destroy(&d->mu);
  free(d->members);
  free(d);
}

rpl_status rpl_fence_join(rpl_fence *f, rpl_domain *d, rpl_error *err) {
  if (!d) return RPL_OK;
  pthread_mutex_lock(&d->mu);
  if (d->n == d->cap) {
    int cap = d->cap ? 2 * d->cap : 8;
    rpl_fence **m = realloc(d->members, sizeof *m * (size_t)cap);
    if (!m) {
      pthread_mutex_unlock(&d->mu);
      return rpl_fail(err, RPL_ERR_NOMEM, "out of memory joining a fence domain");
    }
    d->members = m;
    d->cap = cap;
  }
  d->members[d->n++] = f;
  pthread_mutex_unlock(&d->mu);
  f->domain = d;
  return RPL_OK;
}

void rpl_fence_leave(rpl_fence *f) {
  rpl_domain *d = f->domain;
  if (!d) return;
  pthread_mutex_lock(&d->mu);
  for (int i = 0; i < d->n; i++)
    if (d->members[i] == f) d->members[i] = d->members[--d->n];
  pthread_mutex_unlock(&d->mu);
}

static void unfence_one(rpl_fence *f);

void rpl_fence_go_alone(rpl_fence *f) {
  rpl_fence_leave(f);
  f->domain = NULL;
  unfence_one(f); /* a fence the domain's collective set is this schedule's no more */
}

static void fence_one(rpl_fence *f) {
  if (!f->client || f->left || !__atomic_load_n(&f->armed, __ATOMIC_ACQUIRE)) return;
  if (__atomic_exchange_n(&f->fenced, 1, __ATOMIC_ACQ_REL)) return; /* already fenced */
  rpl_error err;
  /* If this schedule's progress thread is inside a request right now, the client skips the
   * fence rather than wait for the group (see rpl_gg_client_fence): that thread is available
   * for a round, and an exact collective must never wait for the coordinator. */
  if (rpl_gg_client_fence(f->client, &err) == RPL_OK)
    __atomic_fetch_add(&f->fences, 1, __ATOMIC_RELAXED);
  else
    __atomic_store_n(&f->fenced, 0, __ATOMIC_RELEASE);
}

/* The worker is back from its exact collectives: tell the GG at once, so that partners
 * asking now find it available (a fire-and-forget message, off the critical path). */
static void unfence_one(rpl_fence *f) {
  if (!f->client || f->left) return;
  if (!__atomic_exchange_n(&f->fenced, 0, __ATOMIC_ACQ_REL)) return; /* not fenced */
  rpl_error err;
  if (rpl_gg_client_unfence(f->client, &err) == RPL_OK)
    __atomic_fetch_add(&f->unfences, 1, __ATOMIC_RELAXED);
}

void rpl_fence_before_exact(rpl_fence *f) {
  rpl_domain *d = f->domain;
  if (!d) {
    fence_one(f);
    return;
  }
  pthread_mutex_lock(&d->mu);
  d->in_exact++;
  for (int i = 0; i < d->n; i++) fence_one(d->members[i]);
  pthread_mutex_unlock(&d->mu);
}

void rpl_fence_after_exact(rpl_fence *f, int more) {
  rpl_domain *d = f->domain;
  if (!d) {
    if (!more) unfence_one(f);
    return;
  }
  pthread_mutex_lock(&d->mu);
  if (d->in_exact > 0) d->in_exact--;
  if (d->in_exact == 0 && !more)
    for (int i = 0; i < d->n; i++) unfence_one(d->members[i]);
  pthread_mutex_unlock(&d->mu);
}

void rpl_fence_before_request(rpl_fence *f) {
  __atomic_store_n(&f->fenced, 0, __ATOMIC_RELEASE); /* a request unfences */
  __atomic_store_n(&f->armed, 1, __ATOMIC_RELEASE);
}

/* The coordinator counts a request as an unfence. With overlapped rounds an exact collective
 * of this process may have fenced while the request was being sent or waited (its fence was
 * then sent before the request, or skipped): once the group is here, this worker would look
 * idle to the coordinator for the rest of that collective, and a partner could be grouped with
 * it and wait -- possibly inside the partner's step, which that very collective waits for.
 * Fence again while an exact collective runs (under the domain lock, so that its end cannot
 * slip between the check and the fence). */
void rpl_fence_after_request(rpl_fence *f) {
  rpl_domain *d = f->domain;
  if (!d) return;
  pthread_mutex_lock(&d->mu);
  __atomic_store_n(&f->fenced, 0, __ATOMIC_RELEASE); /* as the coordinator has it now */
  if (d->in_exact > 0) fence_one(f);
  pthread_mutex_unlock(&d->mu);
}
