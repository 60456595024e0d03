/* Straggler attribution: see coord_straggler.h. Reads the policy only through rpl_gg_worker. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "coord_core.h"

static void log_stderr(void *ctx, const char *line) {
  (void)ctx;
  fputs(line, stderr); /* stderr is unbuffered: one write per line */
}

int coord_straggler_init(coord_straggler *a, int n, const char *const *host_names,
                         void (*log)(void *ctx, const char *line), void *log_ctx) {
  memset(a, 0, sizeof *a);
  a->n = n;
  a->w = calloc((size_t)n, sizeof *a->w);
  a->scratch = malloc(sizeof(double) * (size_t)n);
  if (host_names) a->names = calloc((size_t)n, sizeof *a->names);
  if (!a->w || !a->scratch || (host_names && !a->names)) {
    coord_straggler_free(a);
    return -1;
  }
  for (int i = 0; i < n; i++) {
    a->w[i].last_req = a->w[i].free_at = a->w[i].changed_t = -1.0;
    const char *s = host_names ? host_names[i] : NULL;
    if (!s) continue;
    /* Printable ASCII without quotes or backslashes: safe in JSON and in a log line as is. */
    size_t k = 0;
    for (; s[k] && k + 1 < COORD_HOST_NAME_MAX; k++) {
      unsigned char c = (unsigned char)s[k];
      a->names[i][k] = (c < 0x20 || c > 0x7e || c == '"' || c == '\\') ? '?' : (char)c;
    }
    a->names[i][k] = '\0';
  }
  a->log = log ? log : log_stderr;
  a->log_ctx = log ? log_ctx : NULL;
  a->tokens = COORD_LOG_BURST;
  a->tokens_t = -1.0;
  a->next_refresh = -1.0;
  return 0;
}

void coord_straggler_free(coord_straggler *a) {
  free(a->w);
  free(a->scratch);
  free(a->names);
  a->w = NULL;
  a->scratch = NULL;
  a->names = NULL;
}

void coord_straggler_request(coord_straggler *a, int w, uint64_t round, double now) {
  coord_straggler_worker *x = &a->w[w];
  x->free_at = -1.0; /* asking: no longer computing */
  if (x->has_round && x->last_round == round) return; /* asked again (after a cancel) */
  x->has_round = 1;
  x->last_round = round;
  if (x->last_req >= 0 && now > x->last_req) {
    double dt = now - x->last_req;
    x->req_iv = x->req_iv > 0 ? x->req_iv + (dt - x->req_iv) / 8 : dt;
  }
  x->last_req = now;
}

void coord_straggler_computing(coord_straggler *a, int w, double now) { a->w[w].free_at = now; }

void coord_straggler_idle(coord_straggler *a, int w) { a->w[w].free_at = -1.0; }

const char *coord_straggler_host(const coord_core *core, int w, char *buf, size_t cap) {
  const coord_straggler *a = &core->attr;
  if (a->names && a->names[w][0]) return a->names[w];
  int label = core->w[w].host_label;
  if (label < 0) {
    rpl_gg_worker_info info;
    rpl_error err;
    label = rpl_gg_worker(core->gg, w, &info, &err) == RPL_OK ? info.host : 0;
  }
  snprintf(buf, cap, "%d", label);
  return buf;
}

/* The log's rate limit, a token bucket: takes one token if there is one. */
static int take_token(coord_straggler *a, double now) {
  if (a->tokens_t >= 0 && now > a->tokens_t) a->tokens += (now - a->tokens_t) / COORD_LOG_EVERY_S;
  if (a->tokens > COORD_LOG_BURST) a->tokens = COORD_LOG_BURST;
  a->tokens_t = now;
  if (a->tokens < 1.0) return 0;
  a->tokens -= 1.0;
  return 1;
}

static void say_unlogged(coord_straggler *a) {
  char note[200];
  snprintf(note, sizeof note,
           "ripples: %llu slow/recovered change(s) not logged (rate limit); "
           "ripples-coordinator --status shows every rank\n", a->unlogged);
  a->unlogged = 0;
  a->log(a->log_ctx, note);
}

/* One line through the log callback within the rate limit; the count of the lines left out
 * goes first. */
static void say(coord_straggler *a, double now, const char *line) {
  if (!take_token(a, now)) {
    a->unlogged++;
    return;
  }
  if (a->unlogged) say_unlogged(a);
  a->log(a->log_ctx, line);
}

static int live(rpl_worker_state s) { return s == RPL_WORKER_LIVE || s == RPL_WORKER_FENCED; }

/* Every worker's effective step and rate, and the lower median of the known steps. */
static void measure(coord_core *core, double now) {
  coord_straggler *a = &core->attr;
  int known = 0;
  for (int i = 0; i < a->n; i++) {
    coord_straggler_worker *x = &a->w[i];
    rpl_gg_worker_info info;
    rpl_error err;
    x->step = x->slowdown = x->rate = 0;
    if (rpl_gg_worker(core->gg, i, &info, &err) != RPL_OK) continue;
    if (x->req_iv > 0) {
      double since = now - x->last_req;
      x->rate = 1.0 / (since > x->req_iv ? since : x->req_iv);
    }
    if (!live(info.state) || !(info.step > 0) || !isfinite(info.step)) continue;
    double busy = x->free_at >= 0 && info.state == RPL_WORKER_LIVE && !info.waiting
                      ? now - x->free_at
                      : 0;
    x->step = busy > info.step ? busy : info.step;
    a->scratch[known++] = x->step;
  }
  a->known = known;
  a->median = rpl_lower_median(a->scratch, known);
}

/* Inserts rank i, of slowdown s, into the slowest COORD_ATTR_TOP (ties: lower rank first). */
static void rank_slowest(coord_straggler *a, int i, double s) {
  int k = a->ntop;
  if (k < COORD_ATTR_TOP) a->ntop++;
  else if (a->w[a->top[k - 1]].slowdown < s) k--; /* the last one drops out */
  else k = -1;
  for (; k > 0 && a->w[a->top[k - 1]].slowdown < s; k--) a->top[k] = a->top[k - 1];
  if (k >= 0) a->top[k] = i;
}

/* Rank i turns slow (at step `step`), or recovers: records it and logs one line. */
static void report_change(coord_core *core, int i, double s, uint64_t step, double now) {
  coord_straggler *a = &core->attr;
  coord_straggler_worker *x = &a->w[i];
  char line[256], hb[32];
  const char *host = coord_straggler_host(core, i, hb, sizeof hb);
  x->slow = !x->slow;
  x->cand = 0;
  x->changed_t = now;
  if (x->slow) {
    x->slow_since = x->cand_step;
    snprintf(line, sizeof line,
             "ripples: rank %d on host %s is %.1fx slower than the median since step "
             "%llu (step %.3g s, median %.3g s)\n",
             i, host, s, (unsigned long long)x->slow_since, x->step, a->median);
  } else {
    snprintf(line, sizeof line,
             "ripples: rank %d on host %s recovered (%.1fx the median) at step %llu\n", i,
             host, s, (unsigned long long)step);
  }
  say(a, now, line);
}

/* The detector for live rank i of slowdown s, at its step `step`: a change (slow, or
 * recovered) must hold for `hold` seconds, and a rank changes at most once per
 * COORD_SLOW_HOLD_S. */
static void detect(coord_core *core, int i, double s, uint64_t step, double hold, double now) {
  coord_straggler *a = &core->attr;
  coord_straggler_worker *x = &a->w[i];
  /* Only with a median of at least two workers is anyone slower than the others. */
  int flip = a->known >= 2 && (x->slow ? s < COORD_SLOW_RECOVERED : s >= COORD_SLOW_AT);
  if (!flip) {
    x->cand = 0;
  } else if (!x->cand) {
    x->cand = 1;
    x->cand_t = now;
    x->cand_step = step;
  } else if (now - x->cand_t >= hold &&
             (x->changed_t < 0 || now - x->changed_t >= COORD_SLOW_HOLD_S)) {
    report_change(core, i, s, step, now);
  }
}

void coord_straggler_refresh(coord_core *core, double now, int force) {
  coord_straggler *a = &core->attr;
  if (!force && a->next_refresh >= 0 && now < a->next_refresh) return;
  a->next_refresh = now + COORD_ATTR_EVERY_S;
  measure(core, now);
  /* Slowdowns, the slowest ranks, and the detector. */
  double hold = COORD_SLOW_PERSIST_STEPS * a->median;
  if (hold < COORD_SLOW_PERSIST_S) hold = COORD_SLOW_PERSIST_S;
  a->ntop = 0;
  a->nslow = 0;
  for (int i = 0; i < a->n; i++) {
    coord_straggler_worker *x = &a->w[i];
    rpl_gg_worker_info info;
    rpl_error err;
    if (rpl_gg_worker(core->gg, i, &info, &err) != RPL_OK) continue;
    if (!live(info.state)) { /* dead or left: the status says so; it is no straggler */
      x->slow = x->cand = 0;
      continue;
    }
    if (!(x->step > 0) || !(a->median > 0)) {
      x->cand = 0;
      a->nslow += x->slow;
      continue;
    }
    double s = x->step / a->median;
    x->slowdown = s;
    rank_slowest(a, i, s);
    detect(core, i, s, info.requests, hold, now);
    a->nslow += x->slow;
  }
  if (a->unlogged && take_token(a, now)) say_unlogged(a); /* when no line follows soon */
}
