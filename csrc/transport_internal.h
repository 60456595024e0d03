/*
 * transport_internal.h - what the transport's files share (private: only transport*.c
 * include it). transport.h is the interface; this is its state and the seams between:
 *
 *   transport.c        the run loop: the send/receive state machines, waits, liveness of
 *                      ring peers, rpl_tr_run / rpl_tr_run_p2p
 *   transport_frame.c  the frame header: encoding, and the receiver's checks
 *   transport_conn.c   creating the transport, addresses, connecting, the handshake both
 *                      ways (wire.h), connections still authenticating, listener probes
 *   transport_stash.c  point-to-point messages that arrive before their receive, and
 *                      any-source receives, which are served from there
 *   transport_close.c  leaving a link: goodbye frames both ways, UCX's FIN/ACK, the errors a
 *                      closed link raises, reset and abort
 *
 * Everything here runs on the thread that runs the transport (see transport.h), except the
 * counters (relaxed atomics) and `interrupted`.
 */
#ifndef RPL_TRANSPORT_INTERNAL_H
#define RPL_TRANSPORT_INTERNAL_H

#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <sys/types.h>

#include "crypto.h"
#include "shm.h"
#include "transport.h"
#include "ucx.h"
#include "wire.h"

#define HDR_SIZE 40
#define DATA_MAGIC 0x31444c52u  /* "RLD1" little-endian */
#define BYE_MAGIC 0x31424c52u   /* "RLB1": a goodbye, see transport_close.c */
#define FIN_MAGIC 0x31464c52u   /* "RLF1": UCX only: the sender leaves after success */
#define ACK_MAGIC 0x31414c52u   /* "RLA1": the answer: everything before the FIN was read */
/* Connections still authenticating, TCP and UCX together. When full, the oldest is dropped
 * for a newcomer: a flood of strangers costs them their slots, never a wait. */
#define PEND_MAX 64
#define CAUSE_LEN 320           /* bytes of a failure's cause passed on to peers */
/* How often a waiting rank makes sure its peers are still there, where nothing else would tell
 * it: ring peers (a lock probe, one system call each) and peers that never connected to us (a
 * connection attempt to their listener, which the peer's kernel refuses once it is gone). */
#define LIVENESS_S 0.1
#define LISTEN_PROBE_S 0.5
/* CONN_HANDSHAKE: connected, HS1 sent, waiting for the acceptor's HS2 (see wire.h);
 * CONN_HS_SENDING (UCX only): HS3 under way. Data moves only on CONN_READY (and CONN_SHM). */
enum { CONN_NONE = 0, CONN_CONNECTING, CONN_HANDSHAKE, CONN_HS_SENDING, CONN_READY, CONN_SHM };
enum { RX_HEADER = 0, RX_XFER, RX_STASH, RX_TAG };

typedef struct stash_msg {
  struct stash_msg *next;
  uint32_t tag;
  size_t len;
  unsigned char *data;
  uint64_t arrival; /* order of arrival across peers, for any-source receives */
} stash_msg;

typedef struct conn {
  int fd;
  int state;
  /* Receive side: a header, then a payload that goes to a transfer or to the stash. */
  int rx_mode;
  int rx_idx; /* RX_XFER: index of the transfer the payload goes to (stable across p2p calls) */
  unsigned char rx_hdr[HDR_SIZE];
  size_t rx_hdr_got;
  stash_msg *rx_stash; /* being filled */
  size_t rx_stash_got;
  stash_msg *stash_head, *stash_tail; /* complete unexpected p2p messages, in arrival order */
  size_t stash_bytes; /* held by the stash and rx_stash, bounded (transport_stash.c) */
  int stash_msgs;     /* bounded likewise */
  int held;           /* a header in rx_hdr waits for room in the stash: the link is not read */
  /* Connector side of the handshake: what we sent, what the acceptor answered. */
  unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE], hs3[RPL_HS3_SIZE];
  size_t hs_got;
  int tx_mid;   /* a message of ours is half-written on the socket: no goodbye may follow */
  int probe_fd; /* a connection attempt to the peer's listener (transport_conn.c), or -1 */
  rpl_ucx_ep *ux; /* the link is a UCX endpoint (state CONN_READY, fd -1), or NULL */
  int ux_linger;  /* a goodbye was written on ux: closing lets UCX deliver it */
  int resuming;   /* this pass: the ring pair with the peer is being rebuilt (shm.h) */
  int rebuilt;    /* the link was closed on a broken ring pair: count it when rebuilt */
  /* Authenticated frames (rpl_tr_set_frame_macs; TCP links): this connection's frame key,
   * the frames sent and received on it, the MAC of the frame under way each way, and the
   * received trailer (RX_TAG: read after the payload; rx_after says where the payload went). */
  unsigned char fkey[RPL_SHA256_LEN];
  uint64_t tx_frames, rx_frames;
  rpl_hmac tx_mac, rx_mac;
  unsigned char tx_tag[RPL_TR_FRAME_TAG], rx_tag[RPL_TR_FRAME_TAG];
  size_t rx_tag_got;
  int rx_after;   /* RX_XFER or RX_STASH */
  int rx_tag_ok;  /* the frame being received passed its MAC */
} conn;

/* An accepted connection (a socket, or a UCX endpoint) until it has authenticated. */
typedef struct pend {
  int fd;          /* or -1 */
  rpl_ucx_ep *ep;  /* or NULL */
  double since;    /* accepted, or challenged */
  int stage;       /* 0: reading HS1; 1: HS2 sent (or under way), reading HS3 */
  int writing;     /* UCX: HS2 still under way */
  int peer;        /* from HS1 */
  size_t got;
  unsigned char in[RPL_HS2_SIZE];
  unsigned char hs1[RPL_HS1_SIZE], hs2[RPL_HS2_SIZE];
} pend;

struct rpl_tr {
  int rank, size;
  int listen_fd;
  int wake_fd; /* eventfd: rpl_tr_interrupt */
  uint64_t nonce; /* this transport's identity (acceptor_id of wire.h), published with its address */
  unsigned char key[RPL_LINK_KEY_LEN]; /* the link key (rpl_tr_set_key); zero by default */
  int frame_macs; /* rpl_tr_set_frame_macs */
  struct sockaddr_in self;
  struct sockaddr_in *peer_addr;
  uint64_t *peer_nonce;
  conn *conns;
  int *act_send, *act_recv; /* per peer: index of the active transfer in the current run */
  unsigned char *any_read;  /* per peer: read in this p2p run only for any-source receives */
  struct pollfd *pfds;
  int *pfd_peer;
  int aborted;
  int interrupted; /* sticky, set by rpl_tr_interrupt (atomic) */
  int p2p;         /* the current run is a point-to-point batch (rpl_tr_run_p2p) */
  int (*give_up)(void *arg); /* the current run's (rpl_tr_run_until), else NULL */
  void *give_up_arg;
  uint64_t completions; /* transfers completed, for rpl_tr_run_p2p's early return */
  uint64_t arrivals;    /* p2p messages stashed so far (stash_msg.arrival) */
  int replaced; /* a peer this run was using reconnected, or -1 */
  double run_start;
  double next_probe;        /* when waiting runs next check their ring peers' locks */
  double next_listen_probe; /* when they next probe peers that never connected */
  int probes;               /* probe_fd descriptors open */
  /* The cause of the last failed run (until a run succeeds): passed on to the peers when this
   * rank gives up on its links. peer_cause: the cause a peer passed on, during a run. */
  char cause[CAUSE_LEN];
  char peer_cause[CAUSE_LEN];
  rpl_shm *shm; /* rings to local peers, or NULL */
  /* UCX links to the peers not on shared memory (transport "ucx"), or NULL: TCP. */
  rpl_ucx *ucx;
  unsigned *peer_uport; /* each peer's UCX listener port, 0 when it does not use UCX */
  pend pend[PEND_MAX];
  int n_pend;
  rpl_tr_counters counters;
};

static inline void count_add(uint64_t *c, uint64_t v) {
  __atomic_fetch_add(c, v, __ATOMIC_RELAXED);
}

/* ---- transport_frame.c: frame headers ------------------------------------------------- */

/* 1 when frames on c carry a MAC: authenticated frames asked for, and c a TCP link. */
static inline int rpl_tr_fmac(const rpl_tr *tr, const conn *c) {
  return tr->frame_macs && c->fd >= 0 && !c->ux && c->state == CONN_READY;
}
/* A new connection's frame key, from the link key and its handshake (HS1, HS2); counters
 * start at zero. */
void rpl_tr_frame_key(const rpl_tr *tr, conn *c, const unsigned char *hs1,
                      const unsigned char *hs2);
/* Starts the MAC of a frame `sender` sends as its `n`-th on the connection (header h). */
void rpl_tr_frame_mac_begin(rpl_hmac *m, const conn *c, int sender, uint64_t n,
                            const unsigned char h[HDR_SIZE]);

/* A frame header: magic DATA_MAGIC, then what `m` says and the payload's length. */
void rpl_tr_encode_header(unsigned char h[HDR_SIZE], const rpl_meta *m, uint64_t len);
void rpl_tr_decode_header(const unsigned char *h, uint32_t *magic, rpl_meta *m, uint64_t *len);
/* Fails on a header (magic, m, len) from `peer` that is not what receive x expects, naming
 * both ranks the same way on both sides; RPL_OK also for a p2p message that a later receive
 * will take (the caller stashes it). */
rpl_status rpl_tr_check_header(const rpl_tr *tr, int peer, const rpl_xfer *x, uint32_t magic,
                               const rpl_meta *m, uint64_t len, rpl_error *err);

/* ---- transport.c: the run loop --------------------------------------------------------- */

/* Makes the first unfinished receive from `peer` at index >= from active, serving p2p
 * receives from the stash. */
rpl_status rpl_tr_activate_recv(rpl_tr *tr, rpl_xfer *xs, int n, int peer, int from,
                                rpl_error *err);

/* ---- transport_conn.c: connections ---------------------------------------------------- */

/* "rank P (ADDR:PORT)", how errors name a peer. */
void rpl_tr_peer_desc(const rpl_tr *tr, int peer, char *buf, size_t cap);
/* A run needs a link to `peer` and there is none: the lower rank connects; the higher sets
 * *accepting and waits to be connected to (probing the peer's listener when listen_probe). */
rpl_status rpl_tr_conn_open(rpl_tr *tr, int peer, int listen_probe, int *accepting,
                            rpl_error *err);
/* Moves a link that is connecting or authenticating as far as it can now. */
rpl_status rpl_tr_conn_advance(rpl_tr *tr, int peer, rpl_error *err);
/* The acceptor's side: takes the listener's connections (_tcp), UCX's new endpoints and every
 * pending UCX one (_ucx), or moves the pending sockets that have data (_pending). Each fails
 * the run if an authenticated newcomer replaced a link it was using. */
rpl_status rpl_tr_accept_tcp(rpl_tr *tr, rpl_error *err);
rpl_status rpl_tr_accept_ucx(rpl_tr *tr, rpl_error *err);
rpl_status rpl_tr_accept_pending(rpl_tr *tr, rpl_error *err);
/* Drops every pending connection (abort). */
void rpl_tr_pend_clear(rpl_tr *tr);
/* A listener probe's descriptor reported: fails if the peer refused it (it is gone). */
rpl_status rpl_tr_probe_event(rpl_tr *tr, int peer, rpl_error *err);
/* Closes the probes a run left open. */
void rpl_tr_probes_close(rpl_tr *tr);

/* ---- transport_stash.c: early point-to-point messages --------------------------------- */

/* 1 for a receive from whichever peer sends first (peer RPL_TR_ANY). */
static inline int rpl_tr_is_any(const rpl_xfer *x) { return !x->is_send && x->peer == RPL_TR_ANY; }
/* The first unfinished point-to-point receive from `peer` with `tag`, or -1. */
int rpl_tr_find_p2p_recv(const rpl_xfer *xs, int n, int peer, uint32_t tag);
rpl_status rpl_tr_p2p_size_mismatch(int peer, const rpl_xfer *x, uint64_t len, rpl_error *err);
/* Serves p2p receive x (from one peer) from the stash; *matched says whether it was. */
rpl_status rpl_tr_stash_take(rpl_tr *tr, rpl_xfer *x, int *matched, rpl_error *err);
/* Receives posted since the last p2p call take the messages already stashed for them. */
rpl_status rpl_tr_stash_serve(rpl_tr *tr, rpl_xfer *xs, int n, rpl_error *err);
/* A pending any-source receive makes this run read every peer no receive of its own reads. */
void rpl_tr_any_read_begin(rpl_tr *tr, rpl_xfer *xs, int n);
/* The header of a message no receive takes arrived from `peer`: its payload goes to the stash
 * (rx_mode RX_STASH), or, the stash being full, the link is held (c->held). */
rpl_status rpl_tr_stash_begin(rpl_tr *tr, int peer, uint32_t tag, uint64_t len, int was_held,
                              rpl_error *err);
/* Message s finished arriving into the stash from `peer`: a receive takes it, or it waits. */
rpl_status rpl_tr_stash_complete(rpl_tr *tr, rpl_xfer *xs, int n, int peer, stash_msg *s,
                                 rpl_error *err);
/* Frees everything a link's stash holds. */
void rpl_tr_stash_clear(conn *c);

/* ---- transport_close.c: leaving ------------------------------------------------------- */

void rpl_tr_close_conn(conn *c);
/* The connection to `peer` closed (EOF, reset, or the peer shut its end while we only send to
 * it): fails the run, with the peer's cause if it said goodbye first. */
rpl_status rpl_tr_peer_closed(rpl_tr *tr, int peer, int errnum, const char *doing,
                              rpl_error *err);
/* A header with `magic` arrived from `peer`: a goodbye (not on a ring) or a FIN (UCX) fails
 * the run; RPL_OK for anything else. */
rpl_status rpl_tr_leave_error(rpl_tr *tr, int peer, uint32_t magic, uint64_t len,
                              rpl_error *err);

#endif /* RPL_TRANSPORT_INTERNAL_H */
