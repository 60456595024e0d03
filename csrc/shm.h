/*
 * shm.h - shared-memory byte streams between ranks on the same host (internal to csrc/).
 *
 * Every rank creates one segment holding an inbound ring per local peer; peers map each
 * other's segments at communicator creation, after which the segment names are unlinked (a
 * crash leaves nothing behind in /dev/shm). A ring is a single-producer single-consumer byte
 * stream, so the transport frames messages on it exactly as on a TCP socket.
 *
 * Waiting: each segment has a doorbell word. A writer rings the reader's doorbell after adding
 * bytes, a reader rings the writer's after freeing space; a rank with nothing to do sleeps on
 * its own doorbell (futex) for a bounded time, then checks that the peers it waits for are
 * alive. A rank that aborts sets a flag in its segment and rings every peer.
 *
 * Liveness: every rank holds a record lock (its own byte of the first local rank's segment)
 * that the kernel drops when the process ends (see shm.c), so a killed peer is seen as dead
 * even before its parent reaps it. A rank that gives up on its links first leaves the reason in its segment (its "cause"),
 * so the peers that fail because of it can say what went wrong first (which rank died).
 *
 * A pair can be "broken" by either side after a failed exchange (its stream state is
 * unknown). It is not given up: once both sides have closed their links to each other, each
 * throws away what its ring from the other still holds, and the pair is usable again
 * (rpl_shm_rearm; the protocol is in shm.c). Only a ring found corrupt is left for TCP.
 */
#ifndef RPL_SHM_H
#define RPL_SHM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "ripples.h"

typedef struct rpl_shm rpl_shm;

/* The largest ring (bytes per peer pair) rpl_shm_create accepts. */
#define RPL_SHM_MAX_RING ((size_t)1 << 30)

/* `local_of[r]` is r's index among the ranks of this host, or -1 for ranks elsewhere.
 * Writes the segment's name (to publish) into name[cap]: "/ripples-<pid>-<nonce>-<rank>", the
 * nonce being the caller's (random: see setup_shm in bootstrap.c). The segment is created 0600. */
rpl_status rpl_shm_create(int rank, int size, const int *local_of, uint64_t nonce,
                          size_t ring_bytes, rpl_shm **out, char *name, size_t cap,
                          rpl_error *err);
/* Maps `peer`'s segment, found under `name` (as published in the store). Refuses it, with
 * RPL_ERR_PEER naming the peer and the reason, unless the name has rpl_shm_create's form for
 * `peer`, the object is a regular file owned by our effective uid with mode 0600 and the size
 * our layout gives, and its header carries our layout, the name's nonce and pid, `peer`'s rank
 * and our group size. */
rpl_status rpl_shm_attach(rpl_shm *s, int peer, const char *name, rpl_error *err);
/* Removes the segment's name; mappings stay valid. */
void rpl_shm_unlink(rpl_shm *s);
void rpl_shm_destroy(rpl_shm *s);

/* 1 if `peer` is reachable through shared memory and the pair is not broken. */
int rpl_shm_usable(const rpl_shm *s, int peer);

typedef enum rpl_shm_pair {
  RPL_SHM_NONE = 0, /* no ring with this peer (another host, or the ring is corrupt): TCP */
  RPL_SHM_READY,    /* usable */
  RPL_SHM_REARMING, /* broken, and waiting for the peer's part of rebuilding it */
} rpl_shm_pair;
/* Takes this side's next steps in rebuilding a broken pair and says where it stands. Call it
 * only while this rank's link to `peer` is closed (no message of ours half-written, none of
 * the peer's half-read), from the thread that runs the transport; it never blocks, and rings
 * the peer's doorbell when it moved. A pair that was never broken is READY at once. */
rpl_shm_pair rpl_shm_rearm(rpl_shm *s, int peer);
/* 1 if `peer` has a ring pair with us that was not found corrupt (usable, or to be rebuilt):
 * its traffic never goes anywhere else. Any thread. */
int rpl_shm_has_ring(const rpl_shm *s, int peer);
/* What carries this rank's traffic with local `peer` now, for stats: "shm", "shm+single-copy",
 * "shm-resuming" (broken, rebuilding), "tcp" (the ring was found corrupt), "closed" (the peer
 * left), "dead" (its process is gone), or NULL when `peer` has no ring with us. Any thread. */
const char *rpl_shm_path(const rpl_shm *s, int peer);

/* Non-blocking stream I/O with a local peer: bytes moved (0 = ring full/empty). A ring
 * position the peer wrote that is impossible (more than the ring holds, or going backwards)
 * moves nothing and is recorded: from then on the pair is not usable, rpl_shm_peer_flagged
 * says so and rpl_shm_check_peer fails with RPL_ERR_PEER ("rank N's shared-memory ring is
 * corrupt: ..."). The same holds for rpl_shm_peek. */
size_t rpl_shm_write(rpl_shm *s, int peer, const struct iovec *iov, int niov);
size_t rpl_shm_read(rpl_shm *s, int peer, void *buf, size_t len);

/* Zero-copy reading: *data points at the readable bytes of the ring from `peer` that are
 * contiguous in memory (at most len); returns how many (0 = empty). They stay valid until
 * rpl_shm_consume(n) frees the first n of them. */
size_t rpl_shm_peek(rpl_shm *s, int peer, const void **data, size_t len);
void rpl_shm_consume(rpl_shm *s, int peer, size_t n);

/* The doorbell value to pass to rpl_shm_wait; read it before trying to make progress. */
uint32_t rpl_shm_doorbell(const rpl_shm *s);
/* Sleeps until the doorbell moves from `seen`, or `max_s` passes. */
void rpl_shm_wait(rpl_shm *s, uint32_t seen, double max_s);
/* Rings our own doorbell (another thread interrupting a wait). */
void rpl_shm_ring_self(rpl_shm *s);

/* 1 if `peer` closed its segment or broke the pair with us: memory reads only, so it may run
 * on every wait. */
int rpl_shm_peer_flagged(const rpl_shm *s, int peer);
/* 0 if the peer has not closed, broken the pair since it was last armed (not checked with
 * `resuming`: for a pair being rebuilt), nor (with `probe`) died; otherwise fills err
 * (RPL_ERR_PEER, naming the peer). When the peer gave up after an error of its own, its cause
 * is copied into cause[cap] (else cause[0] = 0), so that a failure can be passed on naming the
 * first one. The probe costs one system call: call it with `probe` at a bounded interval. */
rpl_status rpl_shm_check_peer(const rpl_shm *s, int peer, int probe, int resuming, char *cause,
                              size_t cap, rpl_error *err);
/* 1 if the probe finds the peer's process gone (0 also when it cannot tell: a peer in this
 * process, or one that could not take its lock). */
int rpl_shm_peer_dead(const rpl_shm *s, int peer);
/* Records why this rank gives up on its links (truncated), for peers' error messages; call it
 * before rpl_shm_break / rpl_shm_close. Any thread. */
void rpl_shm_set_cause(rpl_shm *s, const char *cause);
/* Breaks the pair (both sides see it on their next look) and wakes the peer; the caller closes
 * its link to the peer next, then rebuilds the pair with rpl_shm_rearm when it needs it. */
void rpl_shm_break(rpl_shm *s, int peer);
/* Announces that this rank aborted (peers blocked on it fail) and wakes every local peer. */
void rpl_shm_close(rpl_shm *s);

/* Single copy (cross-memory attach): 1 if this rank may read `peer`'s memory directly, as
 * probed when its segment was attached (see shm.c), and the ring was not found corrupt. */
int rpl_shm_can_read(const rpl_shm *s, int peer);
/* Copies `len` bytes at `remote` (an address in the peer's process) into `local`. Fails with
 * RPL_ERR_PEER naming the peer when it is gone or its memory cannot be read, and the cause
 * the peer left when it gave up first (copied into `cause`, "" if none; a mismatch it found
 * stays RPL_ERR_MISMATCH). */
rpl_status rpl_shm_read_peer(const rpl_shm *s, int peer, uint64_t remote, void *local,
                             size_t len, char *cause, size_t cap, rpl_error *err);

#endif /* RPL_SHM_H */
