/* Worker layout (ranks -> hosts) and the static schedule of paper Fig. 9-10. */
#include <stdlib.h>
#include <string.h>

#include "sched_internal.h"

struct rpl_layout {
  int nworkers;
  int nhosts;
  int *host;        /* [nworkers] dense host index */
  int *local;       /* [nworkers] local index */
  int *host_start;  /* [nhosts+1] offsets into by_host */
  int *by_host;     /* [nworkers] ranks grouped by host, rank order inside a host */
};

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

void rpl_sort_ints(int *a, int n) {
  /* Groups are small and usually nearly sorted: insertion sort, qsort when large. */
  if (n > 32) {
    qsort(a, (size_t)n, sizeof *a, cmp_int);
    return;
  }
  for (int i = 1; i < n; i++) {
    int v = a[i], j = i - 1;
    while (j >= 0 && a[j] > v) {
      a[j + 1] = a[j];
      j--;
    }
    a[j + 1] = v;
  }
}

void rpl_layout_destroy(rpl_layout *l) {
  if (!l) return;
  free(l->host);
  free(l->local);
  free(l->host_start);
  free(l->by_host);
  free(l);
}

typedef struct {
  int label;
  int rank;
} label_rank;

static int cmp_label_rank(const void *a, const void *b) {
  const label_rank *x = a, *y = b;
  if (x->label != y->label) return (x->label > y->label) - (x->label < y->label);
  return (x->rank > y->rank) - (x->rank < y->rank);
}

rpl_status rpl_layout_create(int nworkers, const int *host_of, rpl_layout **out,
                             rpl_error *err) {
  *out = NULL;
  if (nworkers < 1 || nworkers > RPL_SCHED_MAX_WORKERS)
    return rpl_fail(err, RPL_ERR_INVALID, "layout: nworkers %d out of range [1, %d]",
                    nworkers, RPL_SCHED_MAX_WORKERS);
  rpl_layout *l = calloc(1, sizeof *l);
  label_rank *lr = malloc(sizeof *lr * (size_t)nworkers);
  int *first = malloc(sizeof *first * (size_t)nworkers); /* dense index per sorted label run */
  if (l) {
    l->nworkers = nworkers;
    l->host = malloc(sizeof(int) * (size_t)nworkers);
    l->local = malloc(sizeof(int) * (size_t)nworkers);
    l->by_host = malloc(sizeof(int) * (size_t)nworkers);
    l->host_start = malloc(sizeof(int) * (size_t)(nworkers + 1));
  }
  if (!l || !lr || !first || !l->host || !l->local || !l->by_host || !l->host_start) {
    free(lr);
    free(first);
    rpl_layout_destroy(l);
    return rpl_fail(err, RPL_ERR_NOMEM, "layout: out of memory");
  }
  for (int r = 0; r < nworkers; r++) {
    lr[r].label = host_of ? host_of[r] : 0;
    lr[r].rank = r;
  }
  /* Sort by (label, rank): each run is one host, its lowest rank first. */
  qsort(lr, (size_t)nworkers, sizeof *lr, cmp_label_rank);
  int nruns = 0;
  for (int i = 0; i < nworkers; i++) {
    if (i == 0 || lr[i].label != lr[i - 1].label) first[nruns++] = i;
  }
  /* Number hosts by their lowest rank: order runs by lr[first[k]].rank. */
  int *order = malloc(sizeof *order * (size_t)nruns);
  if (!order) {
    free(lr);
    free(first);
    rpl_layout_destroy(l);
    return rpl_fail(err, RPL_ERR_NOMEM, "layout: out of memory");
  }
  /* Key: lowest rank of run k; ranks are unique, so an array indexed by rank sorts it. */
  int *run_of_min = l->by_host; /* borrowed as scratch: filled properly below */
  for (int r = 0; r < nworkers; r++) run_of_min[r] = -1;
  for (int k = 0; k < nruns; k++) run_of_min[lr[first[k]].rank] = k;
  int h = 0;
  for (int r = 0; r < nworkers; r++)
    if (run_of_min[r] >= 0) order[h++] = run_of_min[r];
  l->nhosts = nruns;
  int pos = 0;
  for (h = 0; h < nruns; h++) {
    int k = order[h];
    int end = (k + 1 < nruns) ? first[k + 1] : nworkers;
    l->host_start[h] = pos;
    for (int i = first[k]; i < end; i++) {
      int r = lr[i].rank;
      l->host[r] = h;
      l->local[r] = i - first[k];
      l->by_host[pos++] = r;
    }
  }
  l->host_start[nruns] = pos;
  free(order);
  free(lr);
  free(first);
  *out = l;
  return RPL_OK;
}

rpl_status rpl_layout_create_uniform(int nworkers, int per_host, rpl_layout **out,
                                     rpl_error *err) {
  *out = NULL;
  if (per_host < 1)
    return rpl_fail(err, RPL_ERR_INVALID, "layout: per_host %d must be >= 1", per_host);
  if (nworkers < 1 || nworkers > RPL_SCHED_MAX_WORKERS)
    return rpl_fail(err, RPL_ERR_INVALID, "layout: nworkers %d out of range [1, %d]",
                    nworkers, RPL_SCHED_MAX_WORKERS);
  int *labels = malloc(sizeof *labels * (size_t)nworkers);
  if (!labels) return rpl_fail(err, RPL_ERR_NOMEM, "layout: out of memory");
  for (int r = 0; r < nworkers; r++) labels[r] = r / per_host;
  rpl_status st = rpl_layout_create(nworkers, labels, out, err);
  free(labels);
  return st;
}

int rpl_layout_workers(const rpl_layout *l) { return l->nworkers; }
int rpl_layout_hosts(const rpl_layout *l) { return l->nhosts; }
int rpl_layout_host(const rpl_layout *l, int rank) {
  return (rank >= 0 && rank < l->nworkers) ? l->host[rank] : -1;
}
int rpl_layout_local(const rpl_layout *l, int rank) {
  return (rank >= 0 && rank < l->nworkers) ? l->local[rank] : -1;
}
int rpl_layout_host_size(const rpl_layout *l, int host) {
  if (host < 0 || host >= l->nhosts) return 0;
  return l->host_start[host + 1] - l->host_start[host];
}
int rpl_layout_rank(const rpl_layout *l, int host, int local) {
  if (host < 0 || host >= l->nhosts || local < 0 || local >= rpl_layout_host_size(l, host))
    return -1;
  return l->by_host[l->host_start[host] + local];
}

/* ---- Static schedule ------------------------------------------------------------------- */

/* The host whose cross worker pairs with host h's in phase 2, or -1. Even H: the opposite
 * host on the ring. Odd H: the same shift by H/2 for the first 2*(H/2) hosts, so pairing stays
 * symmetric (a matching); the last host sits out. */
static int ring_opposite(int h, int nhosts) {
  if (nhosts < 2) return -1;
  int half = nhosts / 2;
  if (nhosts % 2 == 0) return (h + half) % nhosts;
  if (h < half) return h + half;
  if (h < 2 * half) return h - half;
  return -1;
}

/* The local worker that goes across hosts in phase 2: LW1 as in Fig. 10, or LW0 if alone. */
static int cross_local(int host_size) { return host_size >= 2 ? 1 : 0; }

rpl_status rpl_static_group(const rpl_layout *l, int rank, uint64_t round, int *members,
                            int cap, int *n, uint64_t *group_id, rpl_error *err) {
  if (rank < 0 || rank >= l->nworkers)
    return rpl_fail(err, RPL_ERR_INVALID, "static: rank %d out of range [0, %d)", rank,
                    l->nworkers);
  int h = l->host[rank], j = l->local[rank], L = rpl_layout_host_size(l, h), H = l->nhosts;
  int phase = (int)(round % RPL_STATIC_PERIOD);
  int need;
  /* First count, so a short buffer fails before anything is written. */
  if (phase == 1 || phase == 3) need = L;
  else if (phase == 0 && j == 0) need = H;
  else need = 2; /* at most a pair; corrected below */
  int tmp[2] = {0, 0};
  int k = 0;
  if (phase == 1 || phase == 3) {
    if (cap < need) goto short_buf;
    for (int i = 0; i < L; i++) members[k++] = rpl_layout_rank(l, h, i);
  } else if (phase == 0) {
    if (j == 0) {
      if (cap < need) goto short_buf;
      for (int g = 0; g < H; g++) members[k++] = rpl_layout_rank(l, g, 0);
    } else {
      int partner = (j >= 2) ? (j ^ 1) : -1; /* (2,3), (4,5), ...; LW1 skips */
      tmp[k++] = rank;
      if (partner >= 0 && partner < L) tmp[k++] = rpl_layout_rank(l, h, partner);
    }
  } else { /* phase 2 */
    int cross = cross_local(L);
    tmp[k++] = rank;
    if (j == cross) {
      int oh = ring_opposite(h, H);
      if (oh >= 0) tmp[k++] = rpl_layout_rank(l, oh, cross_local(rpl_layout_host_size(l, oh)));
    } else {
      int m = L - 1 - j; /* mirror; the cross worker's mirror is left alone */
      if (m != cross && m != j) tmp[k++] = rpl_layout_rank(l, h, m);
    }
  }
  if (!(phase == 1 || phase == 3 || (phase == 0 && j == 0))) {
    if (cap < k) {
      need = k;
      goto short_buf;
    }
    for (int i = 0; i < k; i++) members[i] = tmp[i];
  }
  rpl_sort_ints(members, k);
  *n = k;
  if (group_id) *group_id = round * (uint64_t)l->nworkers + (uint64_t)members[0] + 1;
  return RPL_OK;
short_buf:
  *n = need;
  return rpl_fail(err, RPL_ERR_INVALID, "static: group of %d members, buffer holds %d",
                  need, cap);
}
