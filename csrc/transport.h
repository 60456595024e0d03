/*
 * transport.h - the transport of one communicator: shared-memory rings to peers on the same
 * host, TCP (or UCX, see ucx.h) to the others (internal to csrc/).
 *
 * Algorithms never touch sockets: they describe one step as a set of transfers (sends and
 * receives, each to or from one peer) and rpl_tr_run moves all of them concurrently until every
 * one has completed, an error occurs, the deadline passes, or another thread interrupts.
 *
 * Every transfer is one framed message: a fixed header that names the sender's operation
 * (kind, sequence number, dtype, element count, step) followed by the payload. The receiver
 * checks the header against what it expects, which is how ranks that called different
 * collectives, or the same one with different sizes, get a clear error instead of garbage.
 *
 * Point-to-point messages (send/recv) share the connections: one that arrives while the
 * receiver waits for something else from that peer is stashed and handed to the matching
 * recv later (matched by tag, in arrival order).
 *
 * Connections are made lazily: the lower rank connects, the higher rank accepts, and a link
 * carries data only after both sides proved they hold the communicator's link key over fresh
 * random values of the other's (wire.h). Nothing waits on a connection that has not
 * authenticated: the acceptor reads pending handshakes without blocking, keeps at most a
 * fixed number, and drops them at a deadline. An authenticated newcomer does not replace a
 * healthy TCP link to the same peer.
 *
 * Every number a peer sends is bounded before use: message headers are checked against what
 * the receiver expects, and unexpected point-to-point messages are stashed only up to a
 * per-peer cap in messages and bytes; past that the peer's link is read no further (flow
 * control holds the sender back) until receives take messages out.
 *
 * Dead peers: a run notices within about a second that a peer it waits for is gone, whatever
 * else it waits for. A closed connection (EOF, reset, or the peer shutting its end while this
 * rank only sends to it) fails the run at once; ring peers are checked at a bounded interval
 * (shm.h); a lower rank that never connected is probed through its listener. A rank that gives
 * up on its links after a failed run passes that run's cause on first (a goodbye frame on TCP,
 * its segment on shared memory), so that a rank blocked on it fails naming what went wrong
 * first (say, which rank died), not only the rank that closed.
 */
#ifndef RPL_TRANSPORT_H
#define RPL_TRANSPORT_H

#include <stdint.h>

#include "ripples.h"

#define RPL_ANY_COUNT UINT64_MAX /* meta.count of a transfer whose count may differ per rank */
#define RPL_TR_ANY (-1)          /* peer of a p2p receive from whichever peer sends first */

/* What a message says about the operation that sent it. */
typedef struct rpl_meta {
  uint8_t op;     /* rpl_op_kind; RPL_OP_SEND for point-to-point */
  uint8_t dtype;  /* rpl_dtype */
  uint16_t step;  /* algorithm step or buffer index, checked like the rest */
  uint32_t tag;   /* p2p tag; for collectives the number of buffers of the op */
  uint64_t seq;   /* collective sequence number on this communicator; 0 for p2p */
  uint64_t count; /* elements of the sender's buffer, or RPL_ANY_COUNT */
} rpl_meta;

typedef struct rpl_xfer {
  int peer;
  int is_send;
  rpl_meta meta;     /* send: goes into the header; recv: what must arrive */
  void *buf;         /* send: payload; recv: where the payload lands */
  size_t len;        /* payload bytes */
  void *reduce_dst;  /* recv only, optional: arriving payload is reduced into this */
  rpl_dtype rdtype;
  rpl_redop rop;
  size_t window;     /* with reduce_dst: buf holds only this many bytes, reused in turn as the
                      * payload is reduced (a multiple of the element size), so the bytes in
                      * flight stay in cache; 0 = buf holds the whole payload */
  /* Progress, owned by the transport. */
  size_t off;
  size_t reduced;
  int done;
} rpl_xfer;

typedef struct rpl_tr rpl_tr;

/* Counters the transport updates (relaxed atomics; read from any thread): the table
 * RPL_TR_COUNTERS in ripples.h. */
typedef struct rpl_tr_counters {
  RPL_TR_COUNTERS(RPL_COUNTER_FIELD_)
} rpl_tr_counters;

/* Binds a listening socket on bind_addr (an IPv4 address) with an ephemeral port. With
 * use_ucx, peers not on shared memory are reached through UCX (ucx.h) instead of TCP sockets,
 * with the same framing and error semantics; the TCP listener stays, for liveness probes. */
rpl_status rpl_tr_create(int rank, int size, const char *bind_addr, int use_ucx, rpl_tr **out,
                         rpl_error *err);
void rpl_tr_destroy(rpl_tr *tr);

/* "ADDR:PORT:ID:UCXPORT" (UCXPORT 0 without UCX), what peers need to connect (ID: the
 * transport's random identity, see wire.h); written into buf (cap >= 64). */
void rpl_tr_address(const rpl_tr *tr, char *buf, size_t cap);
rpl_status rpl_tr_set_peer(rpl_tr *tr, int peer, const char *address, rpl_error *err);

/* Hands the transport shared-memory rings to this host's peers (it takes ownership): those
 * peers are then reached through the rings instead of TCP, until a pair breaks. */
struct rpl_shm;
void rpl_tr_set_shm(rpl_tr *tr, struct rpl_shm *shm);

/* The key links are authenticated with (every rank of the communicator sets the same one
 * before its first run; all-zero until then). */
#define RPL_TR_KEY_LEN 32
void rpl_tr_set_key(rpl_tr *tr, const unsigned char key[RPL_TR_KEY_LEN]);
/* Authenticated frames on TCP links (rpl_comm_config.frame_macs): every data frame ends in
 * RPL_TR_FRAME_TAG bytes of HMAC-SHA256 over the sender's rank, the frame's number on its
 * connection, its header and payload, keyed per connection (link key and both handshake
 * nonces). A frame that fails it fails the operation naming the peer. Set before the first
 * run, the same on every rank. */
#define RPL_TR_FRAME_TAG 16
void rpl_tr_set_frame_macs(rpl_tr *tr, int on);

/* Moves all transfers until done. Within one call, transfers to the same peer in the same
 * direction happen in array order. Zero-length transfers still exchange a header. Every
 * transfer starts afresh (its progress fields are reset). Waits are bounded by `deadline`. */
rpl_status rpl_tr_run(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, rpl_error *err);

/* rpl_tr_run that also gives up, with RPL_ERR_PEER, once give_up(arg) returns nonzero:
 * it is asked at least every RPL_TR_GIVE_UP_MS while the run waits. For a caller that learns
 * from elsewhere that its peers will not come (a partial round whose coordinator was lost
 * while handing the group out). */
#define RPL_TR_GIVE_UP_MS 100
rpl_status rpl_tr_run_until(rpl_tr *tr, rpl_xfer *xs, int n, double deadline,
                            int (*give_up)(void *arg), void *arg, rpl_error *err);

/* A batch of point-to-point transfers (meta.op == RPL_OP_SEND; built with zeroed progress),
 * driven over several calls: progress is kept between calls, so the caller may append
 * transfers between calls but must not remove or reorder entries while any is unfinished
 * (except through rpl_tr_p2p_remap). Sends to one peer go out in array order; a message from
 * a peer goes to the first unfinished receive from that peer with its tag, else to the first
 * unfinished receive from RPL_TR_ANY with its tag (whose `peer` becomes the sender's rank),
 * else to the stash.
 * Returns RPL_OK once at least one transfer completed during the call (including receives
 * served from the stash at entry), once none is left, or when poked (rpl_tr_poke);
 * RPL_ERR_TIMEOUT at `deadline`; RPL_ERR_CLOSED when interrupted; other errors as rpl_tr_run. */
rpl_status rpl_tr_run_p2p(rpl_tr *tr, rpl_xfer *xs, int n, double deadline, rpl_error *err);

/* Tells the transport that finished entries of a p2p batch of `n` were dropped: entry i (an
 * unfinished one) is now entry new_index[i]. Call between rpl_tr_run_p2p calls only. */
void rpl_tr_p2p_remap(rpl_tr *tr, const int *new_index, int n);

/* Makes a running rpl_tr_run_p2p return RPL_OK (ignored by a collective run). Any thread. */
void rpl_tr_poke(rpl_tr *tr);

/* Makes a running and every later run return RPL_ERR_CLOSED. Any thread. */
void rpl_tr_interrupt(rpl_tr *tr);

/* Closes the connection to one peer (its stream state is unknown after a failed exchange);
 * the next transfer with that peer connects afresh, or rebuilds the ring pair (shm.h) once the
 * peer has closed its side too. The peer learns the last failure's cause. */
void rpl_tr_reset_peer(rpl_tr *tr, int peer);

/* Fault injection (tests only): shuts down every TCP connection of this transport in both
 * directions, as a network cut would, without telling anyone; peers and this rank then see
 * the link fail on their next read or write. Rings and UCX endpoints are left alone. */
void rpl_tr_cut_links(rpl_tr *tr);

/* Closes every connection and the listener, so peers blocked on us fail fast, passing the last
 * failure's cause on (none if a run succeeded since). */
void rpl_tr_abort(rpl_tr *tr);

void rpl_tr_get_counters(const rpl_tr *tr, rpl_tr_counters *out);
/* What carries this rank's traffic with `peer` now, for stats: "self", "shm",
 * "shm+single-copy", "shm-resuming", "closed" (a local peer that left), "dead" (a local peer
 * whose process is gone), "tcp" or "ucx" (made or to be made on first use). Any thread. */
const char *rpl_tr_peer_path(const rpl_tr *tr, int peer);

/* If the link from `peer` (RPL_TR_ANY: any peer) is held back because its unexpected
 * point-to-point messages fill the stash, says so in buf (for a time-out's message);
 * otherwise buf is "". */
void rpl_tr_held_desc(const rpl_tr *tr, int peer, char *buf, size_t cap);

/* Single copy: 1 if this rank may read `peer`'s memory directly (a peer on shared memory whose
 * process allowed the probe, see shm.h). rpl_tr_read copies `len` bytes at `addr`, an address
 * in the peer's process that the peer published, into `dst`: the caller's protocol must make
 * sure the peer keeps that memory unchanged meanwhile. Errors name the peer (RPL_ERR_PEER). */
int rpl_tr_can_read(const rpl_tr *tr, int peer);
rpl_status rpl_tr_read(rpl_tr *tr, int peer, uint64_t addr, void *dst, size_t len,
                       rpl_error *err);

/* Between runs, UCX (unlike a kernel's sockets) moves nothing unless its worker is driven: a
 * peer's connection would go unanswered and its data would wait in its sender. The progress
 * thread, while idle, calls rpl_tr_idle every RPL_TR_IDLE_S when rpl_tr_wants_idle says so;
 * it takes new connections and lets arriving data be buffered. Same thread as the runs. */
#define RPL_TR_IDLE_S 0.01
int rpl_tr_wants_idle(const rpl_tr *tr);
void rpl_tr_idle(rpl_tr *tr);

#endif /* RPL_TRANSPORT_H */
