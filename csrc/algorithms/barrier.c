/* barrier.c - the barrier.
 *
 * A dissemination barrier: ceil(log2 n) rounds of empty messages, in round k to rank+2^k and
 * from rank-2^k; nobody leaves before everyone has arrived. */
#include "algorithms.h"

#include "../common.h"
#include "../ctx.h"

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
