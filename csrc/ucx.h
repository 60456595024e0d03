/*
 * ucx.h - UCX byte streams for the transport (internal to csrc/): one UCP context and worker
 * per communicator, a client-server listener, and endpoints that read and write like
 * non-blocking sockets, so transport.c keeps one framing and one run loop for every link.
 *
 * Endpoints are made the way TCP connections are: the lower rank connects to the higher
 * rank's listener (UCX's sockaddr connection manager), which accepts; UCX then picks the
 * lanes it can use between the two processes (TCP, shared memory, ...; UCX_TLS narrows the
 * choice). Data moves with UCP's stream API:
 *   - reads copy out of the data UCX already received (ucp_stream_recv_data_nb), in any
 *     amount, so message boundaries stay the transport's business;
 *   - a write posts one message (a short head copied here, a body used in place) and reports
 *     it written once UCX completed it; until then the caller must keep the body alive, and
 *     closing the endpoint cancels it.
 * A peer that exits or closes is reported through the endpoint's error handler (UCX's peer
 * failure mode); data it sent before is still read first.
 *
 * Built only where UCX's development files are found (RPL_HAVE_UCX, rpl_has_ucx); elsewhere
 * rpl_ucx_create fails with a message that says so. Not thread-safe: one thread at a time (the communicator's
 * progress thread, or the one destroying it).
 */
#ifndef RPL_UCX_H
#define RPL_UCX_H

#include <netinet/in.h>
#include <stddef.h>
#include <sys/types.h>

#include "ripples.h"

typedef struct rpl_ucx rpl_ucx;
typedef struct rpl_ucx_ep rpl_ucx_ep;

#define RPL_UCX_HEAD_MAX 64 /* bytes of a write's head copied by rpl_ucx_write */

/* A context, a worker and a listener on bind_addr (an IPv4 address, ephemeral port). */
rpl_status rpl_ucx_create(const struct in_addr *bind_addr, rpl_ucx **out, rpl_error *err);
/* Closes every endpoint still open (cancelling their writes), then the rest. */
void rpl_ucx_destroy(rpl_ucx *u);
unsigned rpl_ucx_port(const rpl_ucx *u);

/* The worker's event descriptor: readable when progress may be made (see rpl_ucx_arm). */
int rpl_ucx_fd(const rpl_ucx *u);
/* Makes all the progress UCX can make now, without waiting. */
void rpl_ucx_progress(rpl_ucx *u);
/* 1 if the caller may sleep on rpl_ucx_fd now; 0 if events are pending (progress first). */
int rpl_ucx_arm(rpl_ucx *u);

/* Starts a connection to a listener and sends `hello` (at most RPL_UCX_HEAD_MAX bytes, copied)
 * ahead of everything else on it; the endpoint is usable at once (writes wait in UCX until
 * the connection is up). */
rpl_status rpl_ucx_connect(rpl_ucx *u, const struct sockaddr_in *to, const void *hello,
                           size_t hello_len, rpl_ucx_ep **out, rpl_error *err);
/* The next endpoint a peer connected to the listener, or NULL (call after progress). */
rpl_ucx_ep *rpl_ucx_accept(rpl_ucx *u);

/* Copies up to n received bytes into dst: > 0 bytes copied, 0 when nothing is there, -1 when
 * the endpoint failed (the peer closed or died) and everything it sent was read. */
ssize_t rpl_ucx_read(rpl_ucx_ep *e, void *dst, size_t n);
/* Writes head (at most RPL_UCX_HEAD_MAX bytes, copied) then body (in place) as one message.
 * Returns head_len + body_len once UCX completed it, 0 while it is under way (call again with
 * the same arguments), -1 when the endpoint failed. */
ssize_t rpl_ucx_write(rpl_ucx_ep *e, const void *head, size_t head_len, const void *body,
                      size_t body_len);
/* 1 while a write (or the hello) is under way. */
int rpl_ucx_writing(const rpl_ucx_ep *e);
/* 1 once the peer closed or died (rpl_ucx_read may still return data it sent before). */
int rpl_ucx_failed(const rpl_ucx_ep *e);
/* A short description of why the endpoint failed ("" if it did not). */
const char *rpl_ucx_failure(const rpl_ucx_ep *e);

/* Closes and frees the endpoint. With linger_s > 0, first lets UCX deliver what was written
 * for up to that long (a goodbye); otherwise, or after that, cancels whatever is under way. */
void rpl_ucx_close(rpl_ucx_ep *e, double linger_s);

#endif /* RPL_UCX_H */
