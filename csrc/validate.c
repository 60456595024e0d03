/* validate.c - argument checks of an operation before it is queued (validate.h). */
#include "validate.h"

#include "common.h"

static rpl_status check_bufs(const rpl_buf *b, int n, const char *what, rpl_error *err) {
  for (int i = 0; i < n; i++) {
    if ((unsigned)b[i].dtype >= RPL_DTYPE_COUNT)
      return rpl_fail(err, RPL_ERR_UNSUPPORTED, "%s[%d] has an unsupported dtype (%d)", what, i,
                      (int)b[i].dtype);
    if (b[i].count && !b[i].ptr)
      return rpl_fail(err, RPL_ERR_INVALID, "%s[%d] has %zu elements but no data", what, i,
                      b[i].count);
  }
  return RPL_OK;
}

static rpl_status check_same(const rpl_buf *b, int n, rpl_dtype dtype, size_t count,
                             int check_count, const char *what, const char *op,
                             rpl_error *err) {
  for (int i = 0; i < n; i++) {
    if (b[i].dtype != dtype)
      return rpl_fail(err, RPL_ERR_INVALID, "%s: %s[%d] is %s but the input is %s", op, what, i,
                      rpl_dtype_name(b[i].dtype), rpl_dtype_name(dtype));
    if (check_count && b[i].count != count)
      return rpl_fail(err, RPL_ERR_INVALID,
                      "%s: %s[%d] has %zu elements but the input has %zu", op, what, i,
                      b[i].count, count);
  }
  return RPL_OK;
}

/* Gather and scatter: every rank has one block (`one`, `none` of them given), the root also
 * the `nmany` blocks `many`, one per rank; the names say which are inputs and outputs. */
static rpl_status check_root_blocks(const char *op, int n, int is_root, const rpl_buf *one,
                                    int none, const char *one_what, const rpl_buf *many,
                                    int nmany, const char *many_what, rpl_error *err) {
  if (none != 1 || nmany != (is_root ? n : 0))
    return rpl_fail(err, RPL_ERR_INVALID,
                    "%s needs 1 %s, and %d %ss on the root (none elsewhere); got %d and %d", op,
                    one_what, n, many_what, none, nmany);
  return check_same(many, nmany, one->dtype, one->count, 1, many_what, op, err);
}

/* What every operation must satisfy: a timeout, well-formed buffer lists, a root in range. */
static rpl_status check_common(const rpl_op_desc *d, int n, const char *op, rpl_error *err) {
  if (!(d->timeout_s >= 0))
    return rpl_fail(err, RPL_ERR_INVALID,
                    "%s: timeout must be >= 0 seconds (0 = the process group's), got %g", op,
                    d->timeout_s);
  if (d->nin < 0 || d->nout < 0 || (d->nin && !d->in) || (d->nout && !d->out))
    return rpl_fail(err, RPL_ERR_INVALID, "%s: bad buffer lists", op);
  rpl_status st = check_bufs(d->in, d->nin, "input", err);
  if (st == RPL_OK) st = check_bufs(d->out, d->nout, "output", err);
  if (st != RPL_OK) return st;
  int rooted = d->kind == RPL_OP_BROADCAST || d->kind == RPL_OP_GATHER ||
               d->kind == RPL_OP_SCATTER || d->kind == RPL_OP_REDUCE ||
               d->kind == RPL_OP_SEND || d->kind == RPL_OP_RECV;
  int any_source = d->kind == RPL_OP_RECV && d->root == RPL_ANY_SOURCE;
  if (rooted && !any_source && (d->root < 0 || d->root >= n))
    return rpl_fail(err, RPL_ERR_INVALID, "%s: rank %d is out of range for a group of size %d",
                    op, d->root, n);
  return RPL_OK;
}

/* ALLREDUCE and PARTIAL_ALLREDUCE: at least one tensor, each reducible with the op. */
static rpl_status check_allreduce(const rpl_op_desc *d, rpl_error *err) {
  if (d->nin < 1) return rpl_fail(err, RPL_ERR_INVALID, "allreduce needs a tensor");
  rpl_status st;
  for (int i = 0; i < d->nin; i++)
    if ((st = rpl_reduce_check(d->in[i].dtype, d->redop, err)) != RPL_OK) return st;
  return RPL_OK;
}

static rpl_status check_alltoall(const rpl_op_desc *d, int rank, int n, const char *op,
                                 rpl_error *err) {
  if (d->nin != n || d->nout != n)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "alltoall needs %d inputs and %d outputs, got %d and %d", n, n, d->nin,
                    d->nout);
  rpl_status st;
  if ((st = check_same(d->in, n, d->in[0].dtype, 0, 0, "input", op, err)) != RPL_OK)
    return st;
  if ((st = check_same(d->out, n, d->in[0].dtype, 0, 0, "output", op, err)) != RPL_OK)
    return st;
  if (d->in[rank].count != d->out[rank].count)
    return rpl_fail(err, RPL_ERR_INVALID,
                    "alltoall: this rank sends %zu elements to itself but expects %zu",
                    d->in[rank].count, d->out[rank].count);
  return RPL_OK;
}

static rpl_status check_p2p(const rpl_op_desc *d, int rank, const char *op, rpl_error *err) {
  if ((d->kind == RPL_OP_SEND ? d->nin : d->nout) != 1)
    return rpl_fail(err, RPL_ERR_INVALID, "%s needs exactly 1 tensor", op);
  if (d->root == rank)
    return rpl_fail(err, RPL_ERR_INVALID, "%s: rank %d cannot %s itself", op, rank,
                    d->kind == RPL_OP_SEND ? "send to" : "receive from");
  if (d->tag < 0)
    return rpl_fail(err, RPL_ERR_INVALID, "%s: tag must be >= 0, got %d", op, d->tag);
  return RPL_OK;
}

rpl_status rpl_validate(const rpl_op_desc *d, int rank, int size, int has_partial,
                        rpl_error *err) {
  const char *op = rpl_op_name(d->kind);
  int n = size;
  rpl_status st = check_common(d, n, op, err);
  if (st != RPL_OK) return st;
  switch (d->kind) {
    case RPL_OP_PARTIAL_ALLREDUCE:
      if (!has_partial)
        return rpl_fail(err, RPL_ERR_INVALID,
                        "partial allreduce on a communicator without a partial schedule");
      return check_allreduce(d, err);
    case RPL_OP_ALLREDUCE: return check_allreduce(d, err);
    case RPL_OP_BROADCAST:
      if (d->nin < 1) return rpl_fail(err, RPL_ERR_INVALID, "broadcast needs a tensor");
      return RPL_OK;
    case RPL_OP_ALLGATHER:
      if (d->nin != 1 || d->nout != n)
        return rpl_fail(err, RPL_ERR_INVALID,
                        "allgather needs 1 input and %d outputs (one per rank), got %d and %d",
                        n, d->nin, d->nout);
      return check_same(d->out, n, d->in[0].dtype, d->in[0].count, 1, "output", op, err);
    case RPL_OP_REDUCE_SCATTER:
      if (d->nin != n || d->nout != 1)
        return rpl_fail(err, RPL_ERR_INVALID,
                        "reduce_scatter needs %d inputs (one per rank) and 1 output, got %d "
                        "and %d", n, d->nin, d->nout);
      if ((st = rpl_reduce_check(d->out[0].dtype, d->redop, err)) != RPL_OK) return st;
      return check_same(d->in, n, d->out[0].dtype, d->out[0].count, 1, "input", op, err);
    case RPL_OP_ALLTOALL: return check_alltoall(d, rank, n, op, err);
    case RPL_OP_GATHER:
      return check_root_blocks(op, n, rank == d->root, d->in, d->nin, "input", d->out, d->nout,
                               "output", err);
    case RPL_OP_SCATTER:
      return check_root_blocks(op, n, rank == d->root, d->out, d->nout, "output", d->in, d->nin,
                               "input", err);
    case RPL_OP_REDUCE:
      if (d->nin != 1)
        return rpl_fail(err, RPL_ERR_INVALID, "reduce needs exactly 1 tensor, got %d", d->nin);
      return rpl_reduce_check(d->in[0].dtype, d->redop, err);
    case RPL_OP_BARRIER: return RPL_OK;
    case RPL_OP_SEND:
    case RPL_OP_RECV: return check_p2p(d, rank, op, err);
  }
  return rpl_fail(err, RPL_ERR_INVALID, "unknown operation kind %d", (int)d->kind);
}
