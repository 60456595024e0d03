/* The coordinator's table of connections (coord_conns.h). */
#include "coord_conns.h"

#include <stdlib.h>
#include <string.h>

void coord_conns_init(coord_conns *t, int max) {
  memset(t, 0, sizeof *t);
  t->max = max;
}

void coord_conns_free(coord_conns *t) {
  free(t->by_fd);
  free(t->queue);
  memset(t, 0, sizeof *t);
}

static coord_conn *at(coord_conns *t, int fd) {
  return fd >= 0 && fd < t->nfd ? &t->by_fd[fd] : NULL;
}

static int grow_fds(coord_conns *t, int fd) {
  if (fd < t->nfd) return 0;
  int n = t->nfd ? t->nfd : 64;
  while (n <= fd) n *= 2;
  coord_conn *p = realloc(t->by_fd, sizeof *p * (size_t)n);
  if (!p) return -1;
  memset(p + t->nfd, 0, sizeof *p * (size_t)(n - t->nfd));
  t->by_fd = p;
  t->nfd = n;
  return 0;
}

/* Whether a queued reference still names an open, unproven connection. */
static int live(coord_conns *t, coord_conn_ref r) {
  coord_conn *k = at(t, r.fd);
  return k && k->accepted == r.accepted && !k->authed;
}

/* Room for one more queued reference: drops the stale ones (closed, proven, reused), then
 * grows. Amortised O(1): a compaction keeps only live references, at most `open`. */
static int queue_room(coord_conns *t) {
  if (t->tail < t->cap) return 0;
  int n = 0;
  for (int i = t->head; i < t->tail; i++)
    if (live(t, t->queue[i])) t->queue[n++] = t->queue[i];
  t->head = 0;
  t->tail = n;
  if (n < t->cap / 2) return 0;
  int cap = t->cap ? 2 * t->cap : 64;
  coord_conn_ref *q = realloc(t->queue, sizeof *q * (size_t)cap);
  if (!q) return -1;
  t->queue = q;
  t->cap = cap;
  return 0;
}

int coord_conns_accepted(coord_conns *t, int fd) {
  if (fd < 0 || grow_fds(t, fd) != 0 || queue_room(t) != 0) return -1;
  coord_conn *k = &t->by_fd[fd];
  if (!k->accepted) t->open++;
  k->accepted = ++t->accepts;
  k->authed = 0;
  t->queue[t->tail++] = (coord_conn_ref){fd, k->accepted};
  return 0;
}

void coord_conns_closed(coord_conns *t, int fd) {
  coord_conn *k = at(t, fd);
  if (!k || !k->accepted) return;
  k->accepted = 0;
  t->open--;
}

void coord_conns_authed(coord_conns *t, int fd) {
  coord_conn *k = at(t, fd);
  if ((!k || !k->accepted) && coord_conns_accepted(t, fd) == 0) k = at(t, fd);
  if (k && k->accepted) k->authed = 1;
}

int coord_conns_victim(coord_conns *t) {
  while (t->open > t->max && t->head < t->tail) {
    coord_conn_ref r = t->queue[t->head++];
    if (!live(t, r)) continue;
    coord_conns_closed(t, r.fd);
    return r.fd;
  }
  return -1;
}
