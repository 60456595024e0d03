/* p2p.c - send, recv, and the barrier.
 *
 * send/recv are one message each, matched by (peer, tag) in order; a message that arrives
 * before its recv is posted waits in the transport's stash.
 * The barrier is a dissemination barrier: ceil(log2 n) rounds of empty messages, in round k to
 * rank+2^k and from rank-2^k; nobody leaves before everyone has arrived. */
#include "../common.h"
#include "../engine.h"
#include "../kernels.h"

rpl_status rpl_algo_send(rpl_run *run, const rpl_op_desc *d) {
  const rpl_buf *b = &d->in[0];
  rpl_xfer x = rpl_send(run, d->root, b->ptr, b->count * rpl_dtype_size(b->dtype), b->dtype,
                        b->count, 0);
  x.meta.op = RPL_OP_SEND;
  x.meta.tag = (uint32_t)d->tag;
  return rpl_exchange(run, &x, 1);
}

rpl_status rpl_algo_recv(rpl_run *run, const rpl_op_desc *d) {
  const rpl_buf *b = &d->out[0];
  rpl_xfer x = rpl_recv(run, d->root, b->ptr, b->count * rpl_dtype_size(b->dtype), b->dtype,
                        b->count, 0);
  x.meta.op = RPL_OP_SEND; /* the wire kind of a point-to-point message */
  x.meta.tag = (uint32_t)d->tag;
  return rpl_exchange(run, &x, 1);
}

rpl_status rpl_algo_barrier(rpl_run *run, const rpl_op_desc *d) {
  int n = run->size, r = run->rank;
  unsigned k = 0;
  for (int dist = 1; dist < n; dist *= 2, k++) {
    rpl_xfer xs[2] = {
        rpl_send(run, (r + dist) % n, NULL, 0, RPL_UINT8, 0, k),
        rpl_recv(run, (r - dist + n) % n, NULL, 0, RPL_UINT8, 0, k),
    };
    rpl_status st = rpl_exchange(run, xs, 2);
    if (st != RPL_OK) return st;
  }
  return RPL_OK;
}
