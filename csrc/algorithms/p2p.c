/* p2p.c - send, recv, and the barrier.
 *
 * send/recv are one message each, matched by (peer, tag) in order; a message that arrives
 * before its recv is posted waits in the transport's stash. The engine runs consecutive
 * sends and recvs together as one batch (rpl_tr_run_p2p), so they progress independently.
 * The barrier is a dissemination barrier: ceil(log2 n) rounds of empty messages, in round k to
 * rank+2^k and from rank-2^k; nobody leaves before everyone has arrived. */
#include "algorithms.h"

#include "../common.h"
#include "../ctx.h"
#include "../kernels.h"

rpl_xfer rpl_p2p_xfer(const rpl_run *run, const rpl_op_desc *d) {
  int send = d->kind == RPL_OP_SEND;
  const rpl_buf *b = send ? &d->in[0] : &d->out[0];
  size_t len = b->count * rpl_dtype_size(b->dtype);
  rpl_xfer x = send ? rpl_send(run, d->root, b->ptr, len, b->dtype, b->count, 0)
                    : rpl_recv(run, d->root, b->ptr, len, b->dtype, b->count, 0);
  x.meta.op = RPL_OP_SEND; /* the wire kind of a point-to-point message */
  x.meta.tag = (uint32_t)d->tag;
  return x;
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
