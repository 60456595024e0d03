/* common.c - error formatting, clocks, thread names, enum names, a median. */
#include "common.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

rpl_status rpl_fail(rpl_error *err, rpl_status code, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    err->code = code;
  }
  return code;
}

rpl_status rpl_fail_errno(rpl_error *err, rpl_status code, int errnum, const char *fmt, ...) {
  if (err) {
    char what[RPL_ERRMSG_LEN];
    char reason[128];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    /* strerror_r: the GNU variant may return a static string instead of filling `reason`. */
    const char *r = strerror_r(errnum, reason, sizeof reason);
    snprintf(err->msg, sizeof err->msg, "%.380s: %.120s", what, r);
    err->code = code;
  }
  return code;
}

double rpl_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void rpl_set_thread_name(const char *name) {
  char buf[16];
  snprintf(buf, sizeof buf, "%s", name);
  pthread_setname_np(pthread_self(), buf);
}

const char *rpl_status_name(rpl_status status) {
  switch (status) {
    case RPL_OK: return "RPL_OK";
    case RPL_ERR_INVALID: return "RPL_ERR_INVALID";
    case RPL_ERR_UNSUPPORTED: return "RPL_ERR_UNSUPPORTED";
    case RPL_ERR_MISMATCH: return "RPL_ERR_MISMATCH";
    case RPL_ERR_TIMEOUT: return "RPL_ERR_TIMEOUT";
    case RPL_ERR_PEER: return "RPL_ERR_PEER";
    case RPL_ERR_SYSTEM: return "RPL_ERR_SYSTEM";
    case RPL_ERR_CLOSED: return "RPL_ERR_CLOSED";
    case RPL_ERR_ABORTED: return "RPL_ERR_ABORTED";
    case RPL_ERR_NOMEM: return "RPL_ERR_NOMEM";
  }
  return "RPL_ERR_?";
}

const char *rpl_op_name(rpl_op_kind kind) {
  switch (kind) {
    case RPL_OP_ALLREDUCE: return "allreduce";
    case RPL_OP_BROADCAST: return "broadcast";
    case RPL_OP_ALLGATHER: return "allgather";
    case RPL_OP_REDUCE_SCATTER: return "reduce_scatter";
    case RPL_OP_ALLTOALL: return "alltoall";
    case RPL_OP_GATHER: return "gather";
    case RPL_OP_SCATTER: return "scatter";
    case RPL_OP_REDUCE: return "reduce";
    case RPL_OP_BARRIER: return "barrier";
    case RPL_OP_SEND: return "send";
    case RPL_OP_RECV: return "recv";
    case RPL_OP_PARTIAL_ALLREDUCE: return "partial allreduce";
  }
  return "unknown-op";
}

double rpl_lower_median(double *v, int n) {
  if (n <= 0) return 0;
  int lo = 0, hi = n - 1, k = (n - 1) / 2;
  while (lo < hi) {
    double pivot = v[lo + (hi - lo) / 2];
    int i = lo, j = hi;
    while (i <= j) {
      while (v[i] < pivot) i++;
      while (v[j] > pivot) j--;
      if (i <= j) {
        double t = v[i];
        v[i++] = v[j];
        v[j--] = t;
      }
    }
    if (k <= j) hi = j;
    else if (k >= i) lo = i;
    else break;
  }
  return v[k];
}

void rpl_cause_make(char *out, size_t cap, rpl_status code, int rank, const char *msg) {
  snprintf(out, cap, "%d|%d|%s", (int)code, rank, msg);
}

rpl_status rpl_cause_split(const char *cause, int *rank, const char **msg) {
  int code = 0, r = -1, n = 0;
  if (sscanf(cause, "%d|%d|%n", &code, &r, &n) == 2 && n > 0 && code > 0 && code < 100) {
    *rank = r;
    *msg = cause + n;
    return (rpl_status)code;
  }
  *rank = -1;
  *msg = cause;
  return RPL_ERR_PEER;
}
