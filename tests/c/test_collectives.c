/*
 * test_collectives.c - the core's collectives, end to end over real TCP sockets.
 *
 * Each rank is a thread with its own communicator; an in-memory store stands in for the
 * c10d store. Every result is checked against a reference computed here. Sizes cross the
 * small/large algorithm threshold, which tests set low so the large paths run quickly.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "harness.h"
#include "kernels.h"
#include "ripples.h"

/* Deterministic input: element i of rank r. */
static float val(int r, size_t i) { return (float)((int)((r + 1) * 7 + i * 13) % 23) - 11.0f; }

static const size_t SIZES[] = {0, 1, 5, 63, 64, 65, 1000, 100003};
#define NSIZES (sizeof SIZES / sizeof SIZES[0])

static void body_allreduce(job *j, rpl_comm *c) {
  int n = j->size, r = j->rank;
  for (size_t si = 0; si < NSIZES; si++) {
    size_t cnt = SIZES[si];
    float *x = malloc((cnt + 1) * sizeof *x);
    double *y = malloc((cnt + 1) * sizeof *y);
    int32_t *z = malloc((cnt + 1) * sizeof *z);
    for (size_t i = 0; i < cnt; i++) {
      x[i] = val(r, i);
      y[i] = val(r, i);
      z[i] = (int32_t)val(r, i);
    }
    rpl_buf bufs[3] = {{x, cnt, RPL_FLOAT32}, {y, cnt, RPL_FLOAT64}, {z, cnt, RPL_INT32}};
    rpl_error err;
    rpl_op_desc d = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = bufs, .nin = 3};
    rpl_status s = run_op(c, d, &err);
    CHECK(s == RPL_OK, "allreduce n=%d cnt=%zu: %s", n, cnt, err.msg);
    int bad = 0;
    for (size_t i = 0; i < cnt; i++) {
      double ref = 0;
      for (int p = 0; p < n; p++) ref += val(p, i);
      bad += fabs(x[i] - ref) > 1e-3 || y[i] != ref || z[i] != (int32_t)ref;
    }
    CHECK(bad == 0, "allreduce SUM n=%d cnt=%zu: %d wrong elements", n, cnt, bad);

    /* MAX and AVG on one buffer. */
    for (size_t i = 0; i < cnt; i++) x[i] = val(r, i);
    d = (rpl_op_desc){.kind = RPL_OP_ALLREDUCE, .redop = RPL_MAX, .in = bufs, .nin = 1};
    CHECK(run_op(c, d, &err) == RPL_OK, "allreduce MAX: %s", err.msg);
    bad = 0;
    for (size_t i = 0; i < cnt; i++) {
      float ref = val(0, i);
      for (int p = 1; p < n; p++) ref = val(p, i) > ref ? val(p, i) : ref;
      bad += x[i] != ref;
    }
    CHECK(bad == 0, "allreduce MAX n=%d cnt=%zu: %d wrong", n, cnt, bad);
    for (size_t i = 0; i < cnt; i++) y[i] = val(r, i);
    d = (rpl_op_desc){.kind = RPL_OP_ALLREDUCE, .redop = RPL_AVG, .in = &bufs[1], .nin = 1};
    CHECK(run_op(c, d, &err) == RPL_OK, "allreduce AVG: %s", err.msg);
    bad = 0;
    for (size_t i = 0; i < cnt; i++) {
      double ref = 0;
      for (int p = 0; p < n; p++) ref += val(p, i);
      bad += fabs(y[i] - ref / n) > 1e-12;
    }
    CHECK(bad == 0, "allreduce AVG n=%d cnt=%zu: %d wrong", n, cnt, bad);
    free(x);
    free(y);
    free(z);
  }
}

/* Fills `cnt` elements of `dtype` with rank r's deterministic input. */
static void fill(void *buf, rpl_dtype dtype, int r, size_t cnt) {
  for (size_t i = 0; i < cnt; i++) {
    float v = val(r, i);
    switch (dtype) {
      case RPL_BOOL: ((uint8_t *)buf)[i] = (uint8_t)(((int)v + 11 + r) % 3 != 0); break;
      case RPL_UINT8: ((uint8_t *)buf)[i] = (uint8_t)(v + 11); break;
      case RPL_INT8: ((int8_t *)buf)[i] = (int8_t)v; break;
      case RPL_INT16: ((int16_t *)buf)[i] = (int16_t)v; break;
      case RPL_INT32: ((int32_t *)buf)[i] = (int32_t)v; break;
      case RPL_INT64: ((int64_t *)buf)[i] = (int64_t)v; break;
      case RPL_FLOAT16: ((uint16_t *)buf)[i] = rpl_float_to_half(v / 3); break;
      case RPL_BFLOAT16: ((uint16_t *)buf)[i] = rpl_float_to_bf16(v / 3); break;
      case RPL_FLOAT32: ((float *)buf)[i] = v / 3; break;
      case RPL_FLOAT64: ((double *)buf)[i] = v / 3; break;
      default: break;
    }
  }
}

/* Single copy (a one-host layout with single_copy set): every dtype and op, odd sizes, and
 * bit-for-bit the reduction of all inputs in rank order, as the algorithm promises. The
 * counters prove that the bytes were read from the peers' buffers, not sent through rings. */
static void body_single_copy(job *j, rpl_comm *c) {
  int n = j->size, r = j->rank;
  static const size_t counts[] = {4099, 70001};
  for (int dt = 0; dt < RPL_DTYPE_COUNT; dt++) {
    for (int op = 0; op < RPL_REDOP_COUNT; op++) {
      rpl_error err;
      if (rpl_reduce_check((rpl_dtype)dt, (rpl_redop)op, &err) != RPL_OK) continue;
      for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
        size_t cnt = counts[ci], esz = rpl_dtype_size((rpl_dtype)dt);
        unsigned char *x = malloc(cnt * esz), *ref = malloc(cnt * esz);
        unsigned char **all = malloc(sizeof *all * (size_t)n);
        const void **srcs = malloc(sizeof *srcs * (size_t)n);
        for (int p = 0; p < n; p++) {
          all[p] = malloc(cnt * esz);
          fill(all[p], (rpl_dtype)dt, p, cnt);
          srcs[p] = all[p];
        }
        rpl_reduce_many(ref, srcs, n, cnt, (rpl_dtype)dt, (rpl_redop)op);
        if (op == RPL_AVG) rpl_divide(ref, cnt, (rpl_dtype)dt, n);
        memcpy(x, all[r], cnt * esz);
        rpl_comm_counters before, after;
        rpl_comm_get_counters(c, &before);
        rpl_buf b = {x, cnt, (rpl_dtype)dt};
        rpl_op_desc d = {.kind = RPL_OP_ALLREDUCE, .redop = (rpl_redop)op, .in = &b, .nin = 1};
        rpl_status s = run_op(c, d, &err);
        rpl_comm_get_counters(c, &after);
        CHECK(s == RPL_OK, "single copy %s %s n=%d cnt=%zu: %s", rpl_dtype_name(dt),
              rpl_redop_name(op), n, cnt, err.msg);
        CHECK(memcmp(x, ref, cnt * esz) == 0, "single copy %s %s n=%d cnt=%zu: wrong result",
              rpl_dtype_name(dt), rpl_redop_name(op), n, cnt);
        size_t want = cnt * esz - (cnt / n + (cnt % n > (size_t)r)) * esz; /* all but ours */
        CHECK(after.single_copy_bytes - before.single_copy_bytes >= want,
              "single copy %s n=%d cnt=%zu: %llu bytes read from peers, expected %zu",
              rpl_dtype_name(dt), n, cnt,
              (unsigned long long)(after.single_copy_bytes - before.single_copy_bytes), want);
        for (int p = 0; p < n; p++) free(all[p]);
        free(all);
        free(srcs);
        free(x);
        free(ref);
      }
    }
  }
}

static void body_broadcast(job *j, rpl_comm *c) {
  int n = j->size, r = j->rank;
  for (size_t si = 0; si < NSIZES; si++) {
    size_t cnt = SIZES[si];
    for (int root = 0; root < n; root++) {
      float *x = malloc((cnt + 1) * sizeof *x);
      for (size_t i = 0; i < cnt; i++) x[i] = val(r, i);
      rpl_buf b = {x, cnt, RPL_FLOAT32};
      rpl_error err;
      rpl_op_desc d = {.kind = RPL_OP_BROADCAST, .root = root, .in = &b, .nin = 1};
      CHECK(run_op(c, d, &err) == RPL_OK, "broadcast: %s", err.msg);
      int bad = 0;
      for (size_t i = 0; i < cnt; i++) bad += x[i] != val(root, i);
      CHECK(bad == 0, "broadcast n=%d cnt=%zu root=%d: %d wrong", n, cnt, root, bad);
      free(x);
    }
  }
}

static void body_gathers(job *j, rpl_comm *c) {
  int n = j->size, r = j->rank;
  for (size_t si = 0; si < NSIZES; si++) {
    size_t cnt = SIZES[si];
    float *in = malloc((cnt + 1) * sizeof(float));
    float *out = malloc((cnt * (size_t)n + 1) * sizeof(float));
    rpl_buf ob[16], ib[16];
    for (size_t i = 0; i < cnt; i++) in[i] = val(r, i);
    for (int p = 0; p < n; p++) ob[p] = (rpl_buf){out + (size_t)p * cnt, cnt, RPL_FLOAT32};
    rpl_buf inb = {in, cnt, RPL_FLOAT32};
    rpl_error err;
    /* allgather */
    rpl_op_desc d = {.kind = RPL_OP_ALLGATHER, .in = &inb, .nin = 1, .out = ob, .nout = n};
    CHECK(run_op(c, d, &err) == RPL_OK, "allgather: %s", err.msg);
    int bad = 0;
    for (int p = 0; p < n; p++)
      for (size_t i = 0; i < cnt; i++) bad += out[(size_t)p * cnt + i] != val(p, i);
    CHECK(bad == 0, "allgather n=%d cnt=%zu: %d wrong", n, cnt, bad);

    /* reduce_scatter: rank r's block p is val(r, p*cnt + i); out = sum over ranks */
    float *rs_in = malloc((cnt * (size_t)n + 1) * sizeof(float));
    for (int p = 0; p < n; p++) {
      for (size_t i = 0; i < cnt; i++) rs_in[(size_t)p * cnt + i] = val(r, (size_t)p * cnt + i);
      ib[p] = (rpl_buf){rs_in + (size_t)p * cnt, cnt, RPL_FLOAT32};
    }
    rpl_buf rso = {in, cnt, RPL_FLOAT32};
    d = (rpl_op_desc){.kind = RPL_OP_REDUCE_SCATTER, .redop = RPL_SUM, .in = ib, .nin = n,
                      .out = &rso, .nout = 1};
    CHECK(run_op(c, d, &err) == RPL_OK, "reduce_scatter: %s", err.msg);
    bad = 0;
    for (size_t i = 0; i < cnt; i++) {
      float ref = 0;
      for (int p = 0; p < n; p++) ref += val(p, (size_t)r * cnt + i);
      bad += fabsf(in[i] - ref) > 1e-3f;
    }
    CHECK(bad == 0, "reduce_scatter n=%d cnt=%zu: %d wrong", n, cnt, bad);
    int changed = 0;
    for (int p = 0; p < n; p++)
      for (size_t i = 0; i < cnt; i++)
        changed += rs_in[(size_t)p * cnt + i] != val(r, (size_t)p * cnt + i);
    CHECK(changed == 0, "reduce_scatter modified its input");

    /* gather and scatter at every root */
    for (int root = 0; root < n; root++) {
      for (size_t i = 0; i < cnt; i++) in[i] = val(r, i);
      memset(out, 0, cnt * (size_t)n * sizeof(float));
      d = (rpl_op_desc){.kind = RPL_OP_GATHER, .root = root, .in = &inb, .nin = 1, .out = ob,
                        .nout = r == root ? n : 0};
      CHECK(run_op(c, d, &err) == RPL_OK, "gather: %s", err.msg);
      if (r == root) {
        bad = 0;
        for (int p = 0; p < n; p++)
          for (size_t i = 0; i < cnt; i++) bad += out[(size_t)p * cnt + i] != val(p, i);
        CHECK(bad == 0, "gather n=%d cnt=%zu root=%d: %d wrong", n, cnt, root, bad);
      }
      /* scatter root's blocks val(root, p*cnt+i) */
      for (int p = 0; p < n; p++)
        for (size_t i = 0; i < cnt; i++) out[(size_t)p * cnt + i] = val(root, (size_t)p * cnt + i);
      d = (rpl_op_desc){.kind = RPL_OP_SCATTER, .root = root, .in = ob,
                        .nin = r == root ? n : 0, .out = &inb, .nout = 1};
      CHECK(run_op(c, d, &err) == RPL_OK, "scatter: %s", err.msg);
      bad = 0;
      for (size_t i = 0; i < cnt; i++) bad += in[i] != val(root, (size_t)r * cnt + i);
      CHECK(bad == 0, "scatter n=%d cnt=%zu root=%d: %d wrong", n, cnt, root, bad);

      /* reduce: only the root changes */
      for (size_t i = 0; i < cnt; i++) in[i] = val(r, i);
      d = (rpl_op_desc){.kind = RPL_OP_REDUCE, .redop = RPL_SUM, .root = root, .in = &inb,
                        .nin = 1};
      CHECK(run_op(c, d, &err) == RPL_OK, "reduce: %s", err.msg);
      bad = 0;
      for (size_t i = 0; i < cnt; i++) {
        float ref = val(r, i);
        if (r == root) {
          ref = 0;
          for (int p = 0; p < n; p++) ref += val(p, i);
        }
        bad += fabsf(in[i] - ref) > 1e-3f;
      }
      CHECK(bad == 0, "reduce n=%d cnt=%zu root=%d rank=%d: %d wrong", n, cnt, root, r, bad);
    }

    /* alltoall with unequal blocks: rank r sends (r + p) % 3 * cnt/2 elements to p */
    size_t sc[16], rc[16];
    float *a_in = malloc((cnt * 2 * (size_t)n + 1) * sizeof(float));
    float *a_out = malloc((cnt * 2 * (size_t)n + 1) * sizeof(float));
    size_t so = 0, ro = 0;
    for (int p = 0; p < n; p++) {
      sc[p] = (size_t)((r + p) % 3) * cnt / 2;
      rc[p] = (size_t)((p + r) % 3) * cnt / 2;
      for (size_t i = 0; i < sc[p]; i++) a_in[so + i] = val(r * 16 + p, i);
      ib[p] = (rpl_buf){a_in + so, sc[p], RPL_FLOAT32};
      ob[p] = (rpl_buf){a_out + ro, rc[p], RPL_FLOAT32};
      so += sc[p];
      ro += rc[p];
    }
    d = (rpl_op_desc){.kind = RPL_OP_ALLTOALL, .in = ib, .nin = n, .out = ob, .nout = n};
    CHECK(run_op(c, d, &err) == RPL_OK, "alltoall: %s", err.msg);
    bad = 0;
    for (int p = 0; p < n; p++)
      for (size_t i = 0; i < rc[p]; i++) bad += ((float *)ob[p].ptr)[i] != val(p * 16 + r, i);
    CHECK(bad == 0, "alltoall n=%d cnt=%zu: %d wrong", n, cnt, bad);
    free(a_in);
    free(a_out);
    free(rs_in);
    free(in);
    free(out);
  }
  rpl_error err;
  rpl_op_desc d = {.kind = RPL_OP_BARRIER};
  CHECK(run_op(c, d, &err) == RPL_OK, "barrier: %s", err.msg);
}

/* send/recv: rank 0 sends tags 1..3 to every rank; receivers post them in reverse order. */
static void body_p2p(job *j, rpl_comm *c) {
  int n = j->size, r = j->rank;
  rpl_error err;
  float v[3][100];
  if (r == 0) {
    for (int p = 1; p < n; p++)
      for (int t = 1; t <= 3; t++) {
        for (int i = 0; i < 100; i++) v[t - 1][i] = val(p * 10 + t, (size_t)i);
        rpl_buf b = {v[t - 1], 100, RPL_FLOAT32};
        rpl_op_desc d = {.kind = RPL_OP_SEND, .root = p, .tag = t, .in = &b, .nin = 1};
        CHECK(run_op(c, d, &err) == RPL_OK, "send: %s", err.msg);
      }
  } else {
    for (int t = 3; t >= 1; t--) {
      rpl_buf b = {v[t - 1], 100, RPL_FLOAT32};
      rpl_op_desc d = {.kind = RPL_OP_RECV, .root = 0, .tag = t, .out = &b, .nout = 1};
      CHECK(run_op(c, d, &err) == RPL_OK, "recv: %s", err.msg);
      int bad = 0;
      for (int i = 0; i < 100; i++) bad += v[t - 1][i] != val(r * 10 + t, (size_t)i);
      CHECK(bad == 0, "recv tag %d: %d wrong", t, bad);
    }
  }
  /* A collective after the p2p traffic still lines up. */
  float x = (float)r;
  rpl_buf b = {&x, 1, RPL_FLOAT32};
  rpl_op_desc d = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = &b, .nin = 1};
  CHECK(run_op(c, d, &err) == RPL_OK, "allreduce after p2p: %s", err.msg);
  CHECK(x == (float)(n * (n - 1) / 2), "allreduce after p2p: %g", x);
}

/* Rank 1 passes a different size: every rank fails with a message, nobody hangs, and the
 * communicator then refuses further work. */
static void body_mismatch(job *j, rpl_comm *c) {
  float x[2000] = {0};
  size_t cnt = j->rank == 1 ? 1000 : 2000;
  rpl_buf b = {x, cnt, RPL_FLOAT32};
  rpl_error err = {RPL_OK, ""};
  rpl_op_desc d = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = &b, .nin = 1};
  rpl_status s = run_op(c, d, &err);
  CHECK(s == RPL_ERR_MISMATCH || s == RPL_ERR_PEER, "rank %d: mismatch gave %s (%s)", j->rank,
        rpl_status_name(s), err.msg);
  CHECK(strlen(err.msg) > 10, "rank %d: empty message", j->rank);
  s = run_op(c, d, &err);
  CHECK(s == RPL_ERR_ABORTED, "after an error: %s (%s)", rpl_status_name(s), err.msg);
}

/* Rank 1 never shows up for the second allreduce: rank 0 times out. */
static void body_timeout(job *j, rpl_comm *c) {
  float x = 1;
  rpl_buf b = {&x, 1, RPL_FLOAT32};
  rpl_error err = {RPL_OK, ""};
  rpl_op_desc d = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = &b, .nin = 1};
  CHECK(run_op(c, d, &err) == RPL_OK, "first allreduce: %s", err.msg);
  if (j->rank == 1) {
    sleep_s(2); /* stay connected but absent, past rank 0's timeout */
  } else {
    rpl_status s = run_op(c, d, &err);
    CHECK(s == RPL_ERR_TIMEOUT, "expected a timeout, got %s (%s)", rpl_status_name(s), err.msg);
    CHECK(strstr(err.msg, "rank(s) 1") != NULL, "timeout message names the peer: %s", err.msg);
  }
}

/* Bad arguments are refused at submit time and do not break the communicator. */
static void body_invalid(job *j, rpl_comm *c) {
  float x[4] = {1, 2, 3, 4};
  rpl_buf b = {x, 4, RPL_FLOAT32};
  rpl_error err;
  rpl_op_desc d = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_BAND, .in = &b, .nin = 1};
  CHECK(rpl_submit(c, &d, &err) == RPL_ERR_UNSUPPORTED, "BAND on float32 accepted");
  d = (rpl_op_desc){.kind = RPL_OP_BROADCAST, .root = j->size, .in = &b, .nin = 1};
  CHECK(rpl_submit(c, &d, &err) == RPL_ERR_INVALID, "root out of range accepted");
  d = (rpl_op_desc){.kind = RPL_OP_ALLGATHER, .in = &b, .nin = 1, .out = &b, .nout = 1};
  if (j->size > 1) CHECK(rpl_submit(c, &d, &err) == RPL_ERR_INVALID, "allgather 1 output");
  d = (rpl_op_desc){.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = &b, .nin = 1};
  CHECK(run_op(c, d, &err) == RPL_OK, "allreduce after refused calls: %s", err.msg);
  CHECK(x[0] == (float)j->size, "allreduce value %g", x[0]);
}

/* Shutting down while an operation waits for a peer that never comes ends it promptly.
 * Rank 1 waits for rank 0 to connect (the lower rank connects), which it never does. */
static void body_shutdown(job *j, rpl_comm *c) {
  if (j->rank != 1) return;
  float x = 1;
  rpl_buf b = {&x, 1, RPL_FLOAT32};
  closed_count w = {0};
  rpl_op_desc d = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = &b, .nin = 1};
  rpl_op_desc ds[2] = {d, d}; /* the same allreduce twice */
  submit_counting_closed(c, ds, 2, &w, "shutdown");
  rpl_comm_shutdown(c); /* joins the progress thread: both callbacks have run */
  check_all_closed(&w, 2, "shutdown");
  rpl_error err;
  CHECK(rpl_submit(c, &ds[0], &err) == RPL_ERR_CLOSED, "submit after shutdown accepted");
}

/* The latency path beside queued work: a large all-reduce is submitted, then a small one
 * tries to run inline. Where the large one still runs, the small one must not (it queues);
 * either way both results are right and they ran in order on every rank. */
static void body_inline_mixed(job *j, rpl_comm *c) {
  int n = j->size;
  size_t big = 100003;
  float *x = malloc(big * sizeof *x);
  for (int iter = 0; iter < 20; iter++) {
    for (size_t i = 0; i < big; i++) x[i] = val(j->rank, i);
    float y = (float)j->rank;
    rpl_buf bx = {x, big, RPL_FLOAT32}, by = {&y, 1, RPL_FLOAT32};
    rpl_op_desc dx = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = &bx, .nin = 1};
    rpl_error err;
    CHECK(rpl_submit(c, &dx, &err) == RPL_OK, "submit large: %s", err.msg);
    rpl_op_desc dy = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = &by, .nin = 1};
    CHECK(run_op(c, dy, &err) == RPL_OK, "small after large: %s", err.msg);
    CHECK(y == (float)(n * (n - 1) / 2), "small after large: %g", y);
    /* The small one completed, so the large one before it has too. */
    int bad = 0;
    for (size_t i = 0; i < big; i++) {
      double ref = 0;
      for (int p = 0; p < n; p++) ref += val(p, i);
      bad += fabs(x[i] - ref) > 1e-3;
    }
    CHECK(bad == 0, "large before small: %d wrong", bad);
  }
  free(x);
}

static void *shutdown_later(void *arg) {
  sleep_s(0.2);
  rpl_comm_shutdown(arg);
  return NULL;
}

typedef struct inline_result {
  int calls;
  rpl_status st;
} inline_result;

static void record(void *arg, rpl_status st, const rpl_error *err) {
  (void)err;
  inline_result *r = arg;
  r->calls++;
  r->st = st;
}

/* An op running inline on the caller's thread waits for a peer that never comes; shutting
 * down from another thread interrupts it (RPL_ERR_CLOSED, on_done called once, on this
 * thread) and returns only once it let go of the transport. */
static void body_inline_shutdown(job *j, rpl_comm *c) {
  int *finished = j->arg;
  if (j->rank == 0) { /* never joins; stays until rank 1 is done, so it cannot look dead */
    while (!__atomic_load_n(finished, __ATOMIC_ACQUIRE)) sleep_s(0.001);
    return;
  }
  float x = 1;
  rpl_buf b = {&x, 1, RPL_FLOAT32};
  inline_result r = {0, RPL_OK};
  rpl_op_desc d = {.kind = RPL_OP_ALLREDUCE, .redop = RPL_SUM, .in = &b, .nin = 1,
                   .on_done = record, .done_arg = &r};
  pthread_t t;
  pthread_create(&t, NULL, shutdown_later, c);
  rpl_error err;
  int ran = 0;
  rpl_status s = rpl_submit_inline(c, &d, &ran, &err);
  CHECK(s == RPL_OK && ran == 1, "inline run: status %d ran %d", (int)s, ran);
  CHECK(r.calls == 1 && r.st == RPL_ERR_CLOSED, "inline op ended %d times, status %s", r.calls,
        rpl_status_name(r.st));
  pthread_join(t, NULL);
  CHECK(rpl_submit_inline(c, &d, &ran, &err) == RPL_ERR_CLOSED && !ran,
        "inline run after shutdown accepted");
  __atomic_store_n(finished, 1, __ATOMIC_RELEASE);
}

static void run_all(void) {
  for (int n = 1; n <= 5; n++) {
    run_world(n, 30, body_allreduce, NULL);
    run_world(n, 30, body_broadcast, NULL);
    run_world(n, 30, body_gathers, NULL);
    if (n > 1) run_world(n, 30, body_p2p, NULL);
    run_world(n, 30, body_invalid, NULL);
  }
  run_world(3, 30, body_mismatch, NULL);
  run_world(2, 1.0, body_timeout, NULL);
  run_world(2, 30, body_shutdown, NULL);
}

int main(void) {
  run_on_each_transport(run_all); /* every collective */
  /* Single copy on one host: the whole suite (large all-reduces read peers' buffers), and
   * every dtype and op. Across two hosts it must not be tried (groups span the hosts). */
  g_layout = (world_layout){.hosts = 1, .single_copy = 1};
  run_all();
  for (int n = 2; n <= 4; n++) run_world(n, 30, body_single_copy, NULL);
  g_layout = (world_layout){.hosts = 2, .single_copy = 1};
  run_world(3, 30, body_allreduce, NULL);
  /* The latency path (small ops inline on the caller's thread), over rings and sockets. */
  for (int hosts = 1; hosts <= 2; hosts++) {
    g_layout = (world_layout){.hosts = hosts, .inline_ops = 1};
    int before = g_inline_runs;
    run_all();
    for (int n = 2; n <= 4; n++) run_world(n, 30, body_inline_mixed, NULL);
    CHECK(g_inline_runs > before, "no op ran inline with %d host(s)", hosts);
    int finished = 0;
    run_world(2, 30, body_inline_shutdown, &finished);
  }
  /* Authenticated frames: every collective over sockets only, and over rings and sockets in
   * one operation (test_link_auth.c changes frames on the way). */
  g_layout = (world_layout){.hosts = 1, .tcp_only = 1, .frame_macs = 1};
  run_all();
  g_layout = (world_layout){.hosts = 2, .frame_macs = 1};
  run_all();
  if (rpl_has_ucx()) { /* UCX across the two hosts, and UCX only */
    g_layout = (world_layout){.hosts = 2, .ucx = 1};
    run_all();
    g_layout = (world_layout){.hosts = 1, .tcp_only = 1, .ucx = 1};
    run_all();
  }
  return report("collectives");
}
