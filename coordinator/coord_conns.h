/* The coordinator's table of TCP connections, for its cap on connections (coord_service.c):
 * each open connection by descriptor, whether a message on it proved the token, and the
 * unproven ones in accept order, so that the oldest is found in O(1) amortised. Plain data,
 * no I/O: the service feeds it its ROUTER's monitor events and closes what it names. */
#ifndef RPL_COORD_CONNS_H
#define RPL_COORD_CONNS_H

#include <stdint.h>

typedef struct {
  uint64_t accepted; /* accept number (0: not open) */
  uint8_t authed;
} coord_conn;

typedef struct {
  int fd;
  uint64_t accepted; /* the accept it was queued for: a reused descriptor is a new one */
} coord_conn_ref;

typedef struct coord_conns {
  coord_conn *by_fd;      /* [nfd] */
  int nfd;
  coord_conn_ref *queue;  /* unproven when queued, oldest first: [head, tail) of [cap] */
  int head, tail, cap;
  int open, max;
  uint64_t accepts;
} coord_conns;

/* An empty table for at most `max` open connections. */
void coord_conns_init(coord_conns *t, int max);
void coord_conns_free(coord_conns *t);
/* Descriptor fd was accepted (a descriptor reused before its close was seen counts anew).
 * Returns 0, or -1 when out of memory (the connection is then not tracked). */
int coord_conns_accepted(coord_conns *t, int fd);
void coord_conns_closed(coord_conns *t, int fd);
/* A message on fd proved the token: never closed by the cap. Tracks fd first if its accept
 * was not seen yet. */
void coord_conns_authed(coord_conns *t, int fd);
/* While more than `max` are open: the oldest open connection that never proved the token,
 * forgotten here (the caller closes it); -1 when none must go or none may. */
int coord_conns_victim(coord_conns *t);

#endif
