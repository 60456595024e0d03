/*
 * ctx.h - what an algorithm sees while it runs (internal to csrc/).
 *
 * The engine (engine.c) calls an algorithm (algorithms/algorithms.h) with an rpl_run: the
 * communicator's transport, the operation's deadline and sequence number, and reusable scratch
 * memory. An algorithm is a sequence of steps; each step is a small array of transfers handed
 * to rpl_exchange. Algorithms never write a caller's output before the data it depends on has
 * fully arrived. They reach peers only through this layer: transfers, rpl_exchange, and the
 * read-peer primitive of single copy; never the transport itself.
 *
 * Ranks here are ranks of the run (0..size), which for a partial round are positions in its
 * group; this layer translates them to communicator ranks through `members`.
 *
 * Single thread: a run is used by the thread that holds the communicator's transport.
 */
#ifndef RPL_CTX_H
#define RPL_CTX_H

#include "ripples.h"
#include "transport.h"

/* Slots 0 and 1 belong to the algorithms; slot 2 holds a partial round's working copy. */
#define RPL_SCRATCH_SLOTS 3

/* Reusable memory, owned by the communicator (zero-initialised, freed by rpl_scratch_free),
 * grown on demand. */
typedef struct rpl_scratch_pool {
  void *buf[RPL_SCRATCH_SLOTS];
  size_t cap[RPL_SCRATCH_SLOTS];
} rpl_scratch_pool;

void rpl_scratch_free(rpl_scratch_pool *pool);

typedef struct rpl_run {
  rpl_tr *tr;               /* used by this layer only */
  rpl_scratch_pool *scratch;
  /* rank and size within the set of ranks the op runs over: the whole communicator, or a
   * partial round's group, whose communicator ranks are members[0..size). Algorithms only
   * ever see these; the transfer builders translate peers through `members`. */
  int rank, size;
  const int *members; /* NULL = every rank of the communicator */
  rpl_op_kind kind;
  uint64_t seq;       /* collective sequence number, the same on every rank */
  uint32_t nbufs;     /* how many buffers the op has (goes into every header) */
  double deadline;
  size_t small_bytes; /* latency-optimised algorithm at or below this many bytes */
  size_t chunk_bytes; /* pipeline chunk */
  size_t single_copy_bytes;     /* single-copy algorithms at or above this; 0 = never */
  const unsigned char *same_host; /* by communicator rank: 1 if on this host (NULL = none) */
  rpl_error *err;
  /* While set, exchanges also end (RPL_ERR_PEER) once give_up(give_up_arg) says so. */
  int (*give_up)(void *arg);
  void *give_up_arg;
  /* Fault injection (tests only, partial.c): called before the run's k-th exchange. */
  void (*before_exchange)(void *arg, int k);
  void *hook_arg;
  int exchanges; /* exchanges so far */
} rpl_run;

/* Scratch slot `slot` with at least `bytes` bytes, valid until the op ends (NULL, with the
 * run's error set, when out of memory). */
void *rpl_scratch(rpl_run *run, int slot, size_t bytes);

/* Transfer builders: `step` distinguishes buffers/steps of one op; `count` is the element
 * count of the buffer the message belongs to (RPL_ANY_COUNT where it may differ by rank). */
rpl_xfer rpl_send(const rpl_run *run, int peer, const void *buf, size_t len, rpl_dtype dtype,
                  uint64_t count, unsigned step);
rpl_xfer rpl_recv(const rpl_run *run, int peer, void *buf, size_t len, rpl_dtype dtype,
                  uint64_t count, unsigned step);
/* A receive whose payload passes through `tmp` (RPL_REDUCE_WINDOW bytes, reused in turn) and
 * is reduced into `dst` as it arrives. */
#define RPL_REDUCE_WINDOW (256u * 1024u)
rpl_xfer rpl_recv_reduce(const rpl_run *run, int peer, void *tmp, void *dst, size_t len,
                         rpl_dtype dtype, rpl_redop op, uint64_t count, unsigned step);

/* Moves all transfers until done, the run's deadline passes, run->give_up says so or an error
 * occurs. */
rpl_status rpl_exchange(rpl_run *run, rpl_xfer *xs, int n);
/* The rest of the exchange just run, as a run of its own (it neither counts as an exchange nor
 * calls the test hook): for a protocol step that orders its transfers in two runs. */
rpl_status rpl_exchange_more(rpl_run *run, rpl_xfer *xs, int n);

/* Splits `count` elements into `parts` nearly equal segments; segment i starts at *off. */
void rpl_segment(size_t count, int parts, int i, size_t *off, size_t *cnt);

/* Ring reduce-scatter over `base` (count elements, split with rpl_segment): afterwards
 * segment (rank + shift) mod size of `base` holds the reduction over all ranks. */
rpl_status rpl_ring_reduce_scatter(rpl_run *run, void *base, size_t count, rpl_dtype dtype,
                                   rpl_redop op, int shift, unsigned step);

/* Read-peer (single copy): 1 if run rank `peer` is on this host; 1 if this rank may read its
 * memory directly; rpl_read_peer copies `len` bytes at `addr`, an address in the peer's
 * process that the peer published, into `dst`. The caller's protocol must keep that memory
 * unchanged meanwhile (see transport.h, rpl_tr_read). */
int rpl_peer_local(const rpl_run *run, int peer);
int rpl_peer_readable(const rpl_run *run, int peer);
rpl_status rpl_read_peer(rpl_run *run, int peer, uint64_t addr, void *dst, size_t len);

/* Closes the links to every other rank of the run: after a failed exchange their streams may
 * be mid-message, so the next transfer with each connects afresh. */
void rpl_reset_peers(rpl_run *run);

/* Bytes this process has sent over the run's transport so far, to any peer (frame headers
 * included): a partial round's accounting takes the difference over its reduction. */
uint64_t rpl_run_bytes_sent(const rpl_run *run);

/* Tests only (partial.c's fault injection): cuts every TCP link of the run's transport. */
void rpl_run_cut_links(rpl_run *run);

#endif /* RPL_CTX_H */
