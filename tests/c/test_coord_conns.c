/* The coordinator's table of connections (coordinator/coord_conns.h), for its cap: past `max`
 * open connections the oldest that never proved the token goes first; proven ones never; a
 * descriptor reused is a new connection; closed ones are forgotten. The socket side is
 * test_coord.c's test_connection_cap. */
#include <string.h>

#include "coord_conns.h"

#include "check.h"

int main(void) {
  coord_conns t;
  coord_conns_init(&t, 3);
  for (int fd = 10; fd < 15; fd++) REQUIRE(coord_conns_accepted(&t, fd) == 0, "accept %d", fd);
  coord_conns_authed(&t, 10); /* the oldest proved the token: it stays */
  REQUIRE(coord_conns_victim(&t) == 11 && coord_conns_victim(&t) == 12, "oldest unproven");
  REQUIRE(coord_conns_victim(&t) == -1 && t.open == 3, "at the cap: nobody else");
  /* Closed, then its descriptor reused by a newer connection: that one is the newest. */
  coord_conns_closed(&t, 13);
  REQUIRE(coord_conns_accepted(&t, 13) == 0 && coord_conns_accepted(&t, 20) == 0, "accept");
  REQUIRE(coord_conns_victim(&t) == 14 && coord_conns_victim(&t) == -1, "14 before 13 anew");
  /* A message proves a connection whose accept was not seen yet: tracked, and kept. */
  coord_conns_authed(&t, 30);
  REQUIRE(t.open == 4 && coord_conns_victim(&t) == 13, "30 kept, 13 goes");
  /* Every open one proved: over the cap, nobody goes. */
  coord_conns_authed(&t, 20);
  coord_conns_accepted(&t, 31);
  coord_conns_authed(&t, 31);
  REQUIRE(coord_conns_victim(&t) == -1 && t.open == 4, "proven ones kept past the cap");
  /* Many connections come and go: the queue stays bounded by what is open. */
  for (int i = 0; i < 100000; i++) {
    int fd = 100 + i % 50;
    coord_conns_accepted(&t, fd);
    if (i % 3) coord_conns_authed(&t, fd);
    coord_conns_closed(&t, fd);
  }
  REQUIRE(t.cap <= 1024 && t.open == 4, "queue of %d for %d open", t.cap, t.open);
  REQUIRE(coord_conns_accepted(&t, -1) == -1, "a negative descriptor");
  coord_conns_closed(&t, 99999); /* never seen: nothing */
  REQUIRE(t.open == 4, "closing the unknown");
  coord_conns_free(&t);
  return report("test_coord_conns");
}
