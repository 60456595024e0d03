/* ucx.c - UCX byte streams for the transport: see ucx.h. */
#include "ucx.h"

#include "common.h"

#ifndef RPL_HAVE_UCX

int rpl_has_ucx(void) { return 0; }

rpl_status rpl_ucx_create(const struct in_addr *bind_addr, rpl_ucx **out, rpl_error *err) {
  *out = NULL;
  return rpl_fail(err, RPL_ERR_INVALID,
                  "transport 'ucx' asked for, but this build of ripples has no UCX (install "
                  "UCX's development files, Debian: libucx-dev, and rebuild)");
}
void rpl_ucx_destroy(rpl_ucx *u) { (void)u; }
unsigned rpl_ucx_port(const rpl_ucx *u) { return 0; }
int rpl_ucx_fd(const rpl_ucx *u) { return -1; }
void rpl_ucx_progress(rpl_ucx *u) {}
int rpl_ucx_arm(rpl_ucx *u) { return 1; }
rpl_status rpl_ucx_connect(rpl_ucx *u, const struct sockaddr_in *to, const void *hello,
                           size_t hello_len, rpl_ucx_ep **out, rpl_error *err) {
  *out = NULL;
  return rpl_fail(err, RPL_ERR_INVALID, "this build of ripples has no UCX");
}
rpl_ucx_ep *rpl_ucx_accept(rpl_ucx *u) { return NULL; }
ssize_t rpl_ucx_read(rpl_ucx_ep *e, void *dst, size_t n) { return -1; }
ssize_t rpl_ucx_write(rpl_ucx_ep *e, const void *head, size_t head_len, const void *body,
                      size_t body_len) {
  return -1;
}
int rpl_ucx_writing(const rpl_ucx_ep *e) { return 0; }
int rpl_ucx_failed(const rpl_ucx_ep *e) { return 1; }
const char *rpl_ucx_failure(const rpl_ucx_ep *e) { return "no UCX in this build"; }
void rpl_ucx_close(rpl_ucx_ep *e, double linger_s) {}

#else

#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

#define MAX_REQUESTS 64 /* connection requests waiting for rpl_ucx_accept */

struct rpl_ucx_ep {
  rpl_ucx *u;
  ucp_ep_h ep;
  rpl_ucx_ep *prev, *next; /* u->eps: closed at destroy */
  /* Receive side: the chunk UCX handed us and how much of it was copied out. */
  void *rx_data;
  size_t rx_len, rx_used;
  /* Send side: one message under way. */
  void *tx_req;       /* UCX's request, NULL when the write completed inline or none */
  int tx_busy;        /* a write was posted and has not been reported written */
  int tx_done;        /* set by the completion callback */
  ucs_status_t tx_status;
  size_t tx_total;
  unsigned char tx_head[RPL_UCX_HEAD_MAX];
  ucp_dt_iov_t tx_iov[2];
  /* The hello sent at connect. No write is posted before it completed, so nothing can pass
   * it while the connection is being wired up (closing cancels it if still under way). */
  unsigned char hello[RPL_UCX_HEAD_MAX];
  void *hello_req;
  /* Failure, from the error handler or a failed operation. */
  int failed;
  char why[96];
};

struct rpl_ucx {
  ucp_context_h ctx;
  ucp_worker_h worker;
  ucp_listener_h listener;
  int efd;
  unsigned port;
  rpl_ucx_ep *eps;
  rpl_ucx_ep *orphans; /* closed, but UCX may still call back with them: freed at destroy */
  ucp_conn_request_h requests[MAX_REQUESTS]; /* from the listener, oldest first */
  int nrequests;
};

int rpl_has_ucx(void) { return 1; }

static rpl_status ucx_fail(rpl_error *err, ucs_status_t s, const char *doing) {
  return rpl_fail(err, RPL_ERR_SYSTEM, "UCX: %s: %s", doing, ucs_status_string(s));
}

static void on_conn_request(ucp_conn_request_h req, void *arg) {
  rpl_ucx *u = arg;
  if (u->nrequests == MAX_REQUESTS) { /* a flood of strangers: refuse the newest */
    ucp_listener_reject(u->listener, req);
    return;
  }
  u->requests[u->nrequests++] = req;
}

rpl_status rpl_ucx_create(const struct in_addr *bind_addr, rpl_ucx **out, rpl_error *err) {
  *out = NULL;
  rpl_ucx *u = calloc(1, sizeof *u);
  if (!u) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory creating the UCX transport");
  u->efd = -1;
  ucp_config_t *config;
  ucs_status_t s = ucp_config_read(NULL, NULL, &config); /* UCX_* variables apply */
  if (s != UCS_OK) {
    free(u);
    return ucx_fail(err, s, "cannot read the configuration (UCX_* variables)");
  }
  ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                         .features = UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP};
  s = ucp_init(&params, config, &u->ctx);
  ucp_config_release(config);
  if (s != UCS_OK) {
    free(u);
    return ucx_fail(err, s, "cannot initialise");
  }
  /* Serialized: the progress thread drives it, the thread that destroys the communicator
   * closes it after that thread ended. */
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SERIALIZED};
  if ((s = ucp_worker_create(u->ctx, &wp, &u->worker)) != UCS_OK) {
    rpl_ucx_destroy(u);
    return ucx_fail(err, s, "cannot create a worker");
  }
  if ((s = ucp_worker_get_efd(u->worker, &u->efd)) != UCS_OK) {
    rpl_ucx_destroy(u);
    return ucx_fail(err, s, "no event descriptor");
  }
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr = *bind_addr, .sin_port = 0};
  ucp_listener_params_t lp = {
      .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
      .sockaddr = {.addr = (const struct sockaddr *)&sa, .addrlen = sizeof sa},
      .conn_handler = {.cb = on_conn_request, .arg = u}};
  if ((s = ucp_listener_create(u->worker, &lp, &u->listener)) != UCS_OK) {
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, bind_addr, ip, sizeof ip);
    rpl_ucx_destroy(u);
    return rpl_fail(err, RPL_ERR_SYSTEM,
                    "UCX: cannot listen on %s: %s (UCX's connection manager needs a TCP "
                    "interface with that address; check UCX_TLS and UCX_SOCKADDR_TLS_PRIORITY)",
                    ip, ucs_status_string(s));
  }
  ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
  if ((s = ucp_listener_query(u->listener, &la)) != UCS_OK) {
    rpl_ucx_destroy(u);
    return ucx_fail(err, s, "cannot query the listener");
  }
  u->port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
  *out = u;
  return RPL_OK;
}

void rpl_ucx_destroy(rpl_ucx *u) {
  if (!u) return;
  while (u->eps) rpl_ucx_close(u->eps, 0);
  if (u->listener) {
    for (int i = 0; i < u->nrequests; i++) ucp_listener_reject(u->listener, u->requests[i]);
    u->nrequests = 0;
    ucp_listener_destroy(u->listener);
  }
  if (u->worker) ucp_worker_destroy(u->worker); /* no callback after this */
  while (u->orphans) {
    rpl_ucx_ep *next = u->orphans->next;
    free(u->orphans);
    u->orphans = next;
  }
  if (u->ctx) ucp_cleanup(u->ctx);
  free(u);
}

unsigned rpl_ucx_port(const rpl_ucx *u) { return u->port; }
int rpl_ucx_fd(const rpl_ucx *u) { return u->efd; }

void rpl_ucx_progress(rpl_ucx *u) {
  while (ucp_worker_progress(u->worker)) {
  }
}

int rpl_ucx_arm(rpl_ucx *u) { return ucp_worker_arm(u->worker) == UCS_OK; }

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  rpl_ucx_ep *e = arg;
  if (e->failed) return;
  e->failed = 1;
  snprintf(e->why, sizeof e->why, "%s", ucs_status_string(status));
}

static rpl_ucx_ep *new_ep(rpl_ucx *u) {
  rpl_ucx_ep *e = calloc(1, sizeof *e);
  if (!e) return NULL;
  e->u = u;
  return e;
}

static void link_ep(rpl_ucx_ep *e) {
  rpl_ucx *u = e->u;
  e->next = u->eps;
  if (u->eps) u->eps->prev = e;
  u->eps = e;
}

static void on_hello_sent(void *req, ucs_status_t status, void *user_data) {
  (void)req;
  (void)user_data;
  (void)status; /* a failure shows on the endpoint, through the error handler */
}

rpl_status rpl_ucx_connect(rpl_ucx *u, const struct sockaddr_in *to, const void *hello,
                           size_t hello_len, rpl_ucx_ep **out, rpl_error *err) {
  *out = NULL;
  rpl_ucx_ep *e = new_ep(u);
  if (!e) return rpl_fail(err, RPL_ERR_NOMEM, "out of memory for a UCX endpoint");
  ucp_ep_params_t p = {
      .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
      .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
      .sockaddr = {.addr = (const struct sockaddr *)to, .addrlen = sizeof *to},
      .err_mode = UCP_ERR_HANDLING_MODE_PEER,
      .err_handler = {.cb = on_ep_error, .arg = e}};
  ucs_status_t s = ucp_ep_create(u->worker, &p, &e->ep);
  if (s != UCS_OK) {
    free(e);
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &to->sin_addr, ip, sizeof ip);
    return rpl_fail(err, RPL_ERR_PEER, "UCX: cannot connect to %s:%u: %s", ip,
                    (unsigned)ntohs(to->sin_port), ucs_status_string(s));
  }
  link_ep(e);
  if (hello_len > RPL_UCX_HEAD_MAX) hello_len = RPL_UCX_HEAD_MAX;
  memcpy(e->hello, hello, hello_len);
  ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK,
                            .cb = {.send = on_hello_sent}};
  ucs_status_ptr_t r = ucp_stream_send_nbx(e->ep, e->hello, hello_len, &rp);
  if (UCS_PTR_IS_ERR(r)) {
    rpl_ucx_close(e, 0);
    return rpl_fail(err, RPL_ERR_PEER, "UCX: cannot greet a peer: %s",
                    ucs_status_string(UCS_PTR_STATUS(r)));
  }
  e->hello_req = r; /* NULL: sent inline */
  *out = e;
  return RPL_OK;
}

rpl_ucx_ep *rpl_ucx_accept(rpl_ucx *u) {
  while (u->nrequests > 0) {
    ucp_conn_request_h req = u->requests[0];
    memmove(u->requests, u->requests + 1, sizeof u->requests[0] * (size_t)--u->nrequests);
    rpl_ucx_ep *e = new_ep(u);
    if (!e) {
      ucp_listener_reject(u->listener, req);
      continue;
    }
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .conn_request = req,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = on_ep_error, .arg = e}};
    if (ucp_ep_create(u->worker, &p, &e->ep) != UCS_OK) {
      free(e); /* UCX rejected the request itself */
      continue;
    }
    link_ep(e);
    return e;
  }
  return NULL;
}

ssize_t rpl_ucx_read(rpl_ucx_ep *e, void *dst, size_t n) {
  if (!e->rx_data) {
    size_t len = 0;
    ucs_status_ptr_t d = ucp_stream_recv_data_nb(e->ep, &len);
    if (d == NULL) return e->failed ? -1 : 0;
    if (UCS_PTR_IS_ERR(d)) {
      if (!e->failed) {
        e->failed = 1;
        snprintf(e->why, sizeof e->why, "%s", ucs_status_string(UCS_PTR_STATUS(d)));
      }
      return -1;
    }
    e->rx_data = d;
    e->rx_len = len;
    e->rx_used = 0;
  }
  size_t k = RPL_MIN(n, e->rx_len - e->rx_used);
  memcpy(dst, (unsigned char *)e->rx_data + e->rx_used, k);
  e->rx_used += k;
  if (e->rx_used == e->rx_len) {
    ucp_stream_data_release(e->ep, e->rx_data);
    e->rx_data = NULL;
  }
  return (ssize_t)k;
}

static void on_sent(void *req, ucs_status_t status, void *user_data) {
  rpl_ucx_ep *e = user_data;
  e->tx_status = status;
  e->tx_done = 1;
}

ssize_t rpl_ucx_write(rpl_ucx_ep *e, const void *head, size_t head_len, const void *body,
                      size_t body_len) {
  if (!e->tx_busy) {
    if (e->failed) return -1;
    if (e->hello_req) {
      if (ucp_request_check_status(e->hello_req) == UCS_INPROGRESS) return 0; /* see hello */
      ucp_request_free(e->hello_req);
      e->hello_req = NULL;
    }
    if (head_len > RPL_UCX_HEAD_MAX) head_len = RPL_UCX_HEAD_MAX; /* callers stay below */
    memcpy(e->tx_head, head, head_len);
    int n = 0;
    if (head_len) e->tx_iov[n++] = (ucp_dt_iov_t){.buffer = e->tx_head, .length = head_len};
    if (body_len) e->tx_iov[n++] = (ucp_dt_iov_t){.buffer = (void *)body, .length = body_len};
    if (!n) return 0;
    e->tx_total = head_len + body_len;
    e->tx_done = 0;
    e->tx_status = UCS_OK;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                                             UCP_OP_ATTR_FIELD_USER_DATA |
                                             UCP_OP_ATTR_FIELD_DATATYPE,
                             .cb = {.send = on_sent},
                             .user_data = e,
                             .datatype = ucp_dt_make_iov()};
    ucs_status_ptr_t r = ucp_stream_send_nbx(e->ep, e->tx_iov, (size_t)n, &p);
    if (UCS_PTR_IS_ERR(r)) {
      e->failed = 1;
      snprintf(e->why, sizeof e->why, "%s", ucs_status_string(UCS_PTR_STATUS(r)));
      return -1;
    }
    e->tx_busy = 1;
    e->tx_req = r; /* NULL: completed inline, no callback will come */
    if (!r) e->tx_done = 1;
  }
  if (!e->tx_done) return 0;
  if (e->tx_req) ucp_request_free(e->tx_req);
  e->tx_req = NULL;
  e->tx_busy = 0;
  if (e->tx_status != UCS_OK) {
    if (!e->failed) {
      e->failed = 1;
      snprintf(e->why, sizeof e->why, "%s", ucs_status_string(e->tx_status));
    }
    return -1;
  }
  return (ssize_t)e->tx_total;
}

int rpl_ucx_writing(const rpl_ucx_ep *e) {
  return e->tx_busy ||
         (e->hello_req && ucp_request_check_status(e->hello_req) == UCS_INPROGRESS);
}
int rpl_ucx_failed(const rpl_ucx_ep *e) { return e->failed; }
const char *rpl_ucx_failure(const rpl_ucx_ep *e) { return e->failed ? e->why : ""; }

/* Waits for a UCX request (progressing the worker) until it completes or `until` passes;
 * returns 1 if it completed. */
static int wait_request(rpl_ucx *u, void *req, double until) {
  while (ucp_request_check_status(req) == UCS_INPROGRESS) {
    if (rpl_now() > until) return 0;
    ucp_worker_progress(u->worker);
  }
  return 1;
}

void rpl_ucx_close(rpl_ucx_ep *e, double linger_s) {
  if (!e) return;
  rpl_ucx *u = e->u;
  if (e->rx_data) ucp_stream_data_release(e->ep, e->rx_data);
  e->rx_data = NULL;
  double until = rpl_now() + linger_s;
  int forced = !(linger_s > 0) || e->failed;
  if (!forced && e->tx_busy && e->tx_req && !wait_request(u, e->tx_req, until)) forced = 1;
  ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                           .flags = forced ? UCP_EP_CLOSE_FLAG_FORCE : 0};
  ucs_status_ptr_t r = ucp_ep_close_nbx(e->ep, &p);
  int closed = 1;
  if (r && !UCS_PTR_IS_ERR(r)) {
    if (!wait_request(u, r, forced ? rpl_now() + 5.0 : until)) {
      /* A graceful close the peer does not answer: cancel it by force (bounded). */
      ucp_request_cancel(u->worker, r);
      closed = wait_request(u, r, rpl_now() + 5.0);
    }
    ucp_request_free(r); /* released by UCX once complete, if it is not yet */
  }
  /* A write still under way was cancelled by the close: its callback ran above, unless the
   * close itself did not complete. */
  if (e->tx_req) {
    closed &= ucp_request_check_status(e->tx_req) != UCS_INPROGRESS;
    ucp_request_free(e->tx_req);
  }
  if (e->hello_req) ucp_request_free(e->hello_req);
  e->tx_req = e->hello_req = NULL;
  if (e->prev) e->prev->next = e->next;
  else u->eps = e->next;
  if (e->next) e->next->prev = e->prev;
  if (closed) {
    free(e);
    return;
  }
  /* UCX still holds e as the argument of its error handler or of a send's completion: keep
   * it (failed, unreachable from the transport) until the worker is destroyed. */
  e->failed = 1;
  e->prev = NULL;
  e->next = u->orphans;
  u->orphans = e;
}

#endif /* RPL_HAVE_UCX */
