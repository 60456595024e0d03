/* Straggler attribution (issue 24): which worker is slow, by how much, and since when, as the
 * coordinator measures it. Part of the coordinator's I/O-free core: coord_core feeds it what
 * workers do and calls coord_straggler_refresh from its tick; the status documents print what
 * it found, and it reports a worker that becomes persistently slow, or recovers, as one line
 * through the log callback (rate-limited). Runs on the coordinator's thread only.
 *
 * Measures, per worker:
 *   step      the policy's compute step (rpl_gg_worker_info.step: from leaving the coordinator,
 *             done or pass, to its next request; EWMA), raised to the step in progress when
 *             that is longer already, so that a worker stuck in a step is seen before it ends;
 *   slowdown  step / the lower median of the steps of the live workers with a known step;
 *   rate      steps (requests of new rounds) per second: 1 / EWMA of the interval between
 *             them, or less once it has not asked for longer than that.
 * Slow: a slowdown of COORD_SLOW_AT or more that lasts COORD_SLOW_PERSIST_S and
 * COORD_SLOW_PERSIST_STEPS median steps; recovered: below COORD_SLOW_RECOVERED as long. */
#ifndef RPL_COORD_STRAGGLER_H
#define RPL_COORD_STRAGGLER_H

#include <stddef.h>
#include <stdint.h>

#define COORD_SLOW_AT 2.0
#define COORD_SLOW_RECOVERED 1.5
#define COORD_SLOW_PERSIST_S 2.0
#define COORD_SLOW_PERSIST_STEPS 10
/* A rank changes (and is logged) at most once per this many seconds; the log as a whole
 * takes COORD_LOG_BURST lines, then one every COORD_LOG_EVERY_S (the changes go on, and the
 * next line says how many went unlogged). */
#define COORD_SLOW_HOLD_S 10.0
#define COORD_LOG_BURST 10
#define COORD_LOG_EVERY_S 6.0
/* How often the median and the slowest ranks are recomputed (O(workers)). */
#define COORD_ATTR_EVERY_S 0.5
/* How many of the slowest ranks the status documents name. */
#define COORD_ATTR_TOP 8
/* Host names kept per rank (longer ones are cut). */
#define COORD_HOST_NAME_MAX 64

typedef struct coord_straggler_worker {
  uint64_t last_round;  /* of its last request */
  int has_round;
  double last_req;      /* when it asked for a new round, < 0 never */
  double req_iv;        /* EWMA of the interval between them, 0 = unknown */
  double free_at;       /* left the coordinator (done, pass) and not asking yet; < 0 = not */
  /* What the last refresh found. */
  double step;          /* effective step, 0 = unknown */
  double slowdown;      /* 0 = unknown */
  double rate;          /* steps per second, 0 = unknown */
  /* The detector. */
  int slow;             /* reported slow (logged) */
  int cand;             /* the opposite of `slow` holds since cand_t (its step cand_step) */
  double cand_t;
  uint64_t cand_step;
  double changed_t;     /* last reported change, < 0 none */
  uint64_t slow_since;  /* its step when the slow spell began */
} coord_straggler_worker;

typedef struct coord_straggler {
  int n;
  coord_straggler_worker *w;
  char (*names)[COORD_HOST_NAME_MAX]; /* configured host names, or NULL */
  double *scratch;                    /* [n] for the median */
  double median;                      /* lower median of the known steps, 0 = unknown */
  int known;                          /* workers with a known step */
  int nslow;                          /* workers reported slow now */
  int top[COORD_ATTR_TOP];            /* slowest first, by slowdown */
  int ntop;
  double next_refresh;
  double tokens, tokens_t;            /* the log's rate limit */
  unsigned long long unlogged;
  void (*log)(void *ctx, const char *line);
  void *log_ctx;
} coord_straggler;

struct coord_core;

/* 0, or -1 when out of memory. host_names: see rpl_coord_config (copied, sanitised). */
int coord_straggler_init(coord_straggler *a, int n, const char *const *host_names,
                         void (*log)(void *ctx, const char *line), void *log_ctx);
void coord_straggler_free(coord_straggler *a);

/* Worker w asked for round `round` / left the coordinator for a compute step (done, pass) /
 * is not computing (fenced, left, dead). */
void coord_straggler_request(coord_straggler *a, int w, uint64_t round, double now);
void coord_straggler_computing(coord_straggler *a, int w, double now);
void coord_straggler_idle(coord_straggler *a, int w);

/* Recomputes everything if COORD_ATTR_EVERY_S passed since the last time (or `force`), and
 * reports changes through the log callback. */
void coord_straggler_refresh(struct coord_core *core, double now, int force);

/* Rank w's host as a person reads it: its configured name, else the label it sent in HELLO,
 * else the policy's host index. Printable ASCII, no quotes or backslashes. */
const char *coord_straggler_host(const struct coord_core *core, int w, char *buf,
                                 size_t cap);

#endif
