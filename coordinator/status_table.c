/* The status document as the table `ripples-coordinator --status` prints (rpl_coord.h), for
 * both CLIs: the C binary calls it, the Python one through ripples_pg.backend._gg.status_table. Both
 * are clients that hold only the document a coordinator sent over the wire (STATUS), never its
 * structs: hence a reader of that document, not a printer of coord_core.
 *
 * The document comes from a coordinator that holds the job token, but is read as untrusted
 * text all the same: a small JSON reader with bounds on every length and on nesting, that
 * only keeps the fields the table shows and skips the rest. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "coord_text.h"
#include "rpl_coord.h"

#define MAX_DEPTH 16
#define MAX_ROWS RPL_SCHED_MAX_WORKERS
#define TEXT_MAX 64 /* strings kept (longer ones are cut) */

/* ---- a bounded JSON reader ----------------------------------------------------------------- */

typedef struct {
  const char *p, *end;
  int bad;
} jr;

enum { J_NONE, J_NUM, J_STR, J_TRUE, J_FALSE, J_NULL, J_OTHER };

typedef struct {
  int kind;
  double num;
  char str[TEXT_MAX];
} jval;

static void ws(jr *r) {
  while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r'))
    r->p++;
}

static int peek(jr *r) {
  ws(r);
  return r->p < r->end ? (unsigned char)*r->p : -1;
}

static int eat(jr *r, char c) {
  if (peek(r) != c) return 0;
  r->p++;
  return 1;
}

/* A string into out (cut to cap - 1 bytes; escapes decoded, anything else than printable
 * ASCII shown as '?'). */
static int read_string(jr *r, char *out, size_t cap) {
  size_t k = 0;
  if (!eat(r, '"')) return 0;
  while (r->p < r->end && *r->p != '"') {
    unsigned char c = (unsigned char)*r->p++;
    if (c < 0x20) return 0;
    if (c == '\\') {
      if (r->p >= r->end) return 0;
      char e = *r->p++;
      switch (e) {
        case '"': case '\\': case '/': c = (unsigned char)e; break;
        case 'b': case 'f': case 'n': case 'r': case 't': c = ' '; break;
        case 'u': {
          unsigned v = 0;
          for (int i = 0; i < 4; i++) {
            if (r->p >= r->end) return 0;
            char h = *r->p++;
            int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                  : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (d < 0) return 0;
            v = v * 16 + (unsigned)d;
          }
          c = (unsigned char)(v >= 0x20 && v < 0x7f ? v : '?');
          break;
        }
        default: return 0;
      }
    } else if (c > 0x7e) {
      c = '?';
    }
    if (out && k + 1 < cap) out[k++] = (char)c;
  }
  if (out && cap) out[k] = '\0';
  return eat(r, '"');
}

static int read_value(jr *r, jval *v, int depth);

/* Skips the members of an object or array whose opening bracket was read. */
static int skip_rest(jr *r, char close, int depth) {
  if (eat(r, close)) return 1;
  for (;;) {
    if (close == '}') {
      if (!read_string(r, NULL, 0) || !eat(r, ':')) return 0;
    }
    jval v;
    if (!read_value(r, &v, depth + 1)) return 0;
    if (eat(r, close)) return 1;
    if (!eat(r, ',')) return 0;
  }
}

/* One value: scalars into *v, objects and arrays skipped (kind J_OTHER). */
static int read_value(jr *r, jval *v, int depth) {
  v->kind = J_NONE;
  v->str[0] = '\0';
  if (depth > MAX_DEPTH) return 0;
  int c = peek(r);
  if (c == '{' || c == '[') {
    r->p++;
    v->kind = J_OTHER;
    return skip_rest(r, c == '{' ? '}' : ']', depth);
  }
  if (c == '"') {
    v->kind = J_STR;
    return read_string(r, v->str, sizeof v->str);
  }
  static const struct { const char *word; int kind; } words[] = {
      {"true", J_TRUE}, {"false", J_FALSE}, {"null", J_NULL}};
  for (size_t i = 0; i < sizeof words / sizeof words[0]; i++) {
    size_t n = strlen(words[i].word);
    if ((size_t)(r->end - r->p) >= n && memcmp(r->p, words[i].word, n) == 0) {
      r->p += n;
      v->kind = words[i].kind;
      return 1;
    }
  }
  /* A number: copy its characters (bounded) and let strtod read them. */
  char buf[48];
  size_t k = 0;
  while (r->p < r->end && k + 1 < sizeof buf && *r->p && strchr("+-.0123456789eE", *r->p))
    buf[k++] = *r->p++;
  buf[k] = '\0';
  if (!k) return 0;
  char *endp;
  v->num = strtod(buf, &endp);
  if (*endp || !isfinite(v->num)) return 0;
  v->kind = J_NUM;
  return 1;
}

/* Iterates the members of an object: *key and *v for each; 0 at its end or on an error
 * (r->bad). The caller reads nested objects or arrays itself when it wants them: with
 * `nested` set, a member whose value is an object or array is returned with v->kind J_OTHER
 * and the reader positioned at its opening bracket. */
static int next_member(jr *r, int *first, char *key, size_t cap, jval *v, int nested,
                       int depth) {
  if (*first) {
    *first = 0;
    if (eat(r, '}')) return 0;
  } else {
    if (eat(r, '}')) return 0;
    if (!eat(r, ',')) {
      r->bad = 1;
      return 0;
    }
  }
  if (!read_string(r, key, cap) || !eat(r, ':')) {
    r->bad = 1;
    return 0;
  }
  int c = peek(r);
  if (nested && (c == '{' || c == '[')) {
    v->kind = J_OTHER;
    return 1;
  }
  if (!read_value(r, v, depth + 1)) {
    r->bad = 1;
    return 0;
  }
  return 1;
}

/* ---- the document's fields ------------------------------------------------------------------ */

typedef struct {
  int rank;
  char state[16], host[TEXT_MAX];
  double steps_per_s, step_s, busy_s, slowdown, silent_s, handed, singletons, slow_since;
  double cost_s;                 /* what-if: all-reduce's waiting it caused, -1 unknown */
  int slow, seen;
} row;

typedef struct {
  char policy[16];
  double nworkers, uptime_s, median, omitted;
  double gain, waste, saved, cost_s, job_steps; /* "whatif", 0 = unknown */
  int standby, have_median;
  row *rows;
  int nrows, cap;
} doc;

static double num_or(const jval *v, double dflt) { return v->kind == J_NUM ? v->num : dflt; }

static int read_worker(jr *r, row *w, int depth) {
  memset(w, 0, sizeof *w);
  w->rank = -1;
  w->steps_per_s = w->step_s = w->busy_s = w->slowdown = w->slow_since = -1;
  w->silent_s = w->cost_s = -1;
  double host = -1, label = -1;
  if (!eat(r, '{')) return 0;
  char key[32];
  jval v;
  int first = 1;
  while (next_member(r, &first, key, sizeof key, &v, 0, depth)) {
    if (!strcmp(key, "rank")) w->rank = (int)num_or(&v, -1);
    else if (!strcmp(key, "state") && v.kind == J_STR) snprintf(w->state, sizeof w->state, "%.15s", v.str);
    else if (!strcmp(key, "host_name") && v.kind == J_STR) snprintf(w->host, sizeof w->host, "%s", v.str);
    else if (!strcmp(key, "host_label")) label = num_or(&v, -1);
    else if (!strcmp(key, "host")) host = num_or(&v, -1);
    else if (!strcmp(key, "steps_per_s")) w->steps_per_s = num_or(&v, -1);
    else if (!strcmp(key, "step_s")) w->step_s = num_or(&v, -1);
    else if (!strcmp(key, "busy_s")) w->busy_s = num_or(&v, -1);
    else if (!strcmp(key, "slowdown")) w->slowdown = num_or(&v, -1);
    else if (!strcmp(key, "silent_s")) w->silent_s = num_or(&v, -1);
    else if (!strcmp(key, "handed")) w->handed = num_or(&v, 0);
    else if (!strcmp(key, "singletons")) w->singletons = num_or(&v, 0);
    else if (!strcmp(key, "slow_since_step")) w->slow_since = num_or(&v, -1);
    else if (!strcmp(key, "slow")) w->slow = v.kind == J_TRUE;
    else if (!strcmp(key, "seen")) w->seen = v.kind == J_TRUE;
    else if (!strcmp(key, "cost_s")) w->cost_s = num_or(&v, -1);
  }
  if (!w->host[0]) /* a coordinator before issue 24: its label, else its host index */
    snprintf(w->host, sizeof w->host, "%.0f", label >= 0 ? label : host >= 0 ? host : 0);
  return !r->bad && w->rank >= 0;
}

static int read_doc(jr *r, doc *d) {
  if (!eat(r, '{')) return 0;
  char key[32];
  jval v;
  int first = 1, have_workers = 0;
  while (next_member(r, &first, key, sizeof key, &v, 1, 0)) {
    if (v.kind == J_OTHER && !strcmp(key, "workers")) {
      have_workers = 1;
      if (!eat(r, '[')) return 0;
      if (eat(r, ']')) continue;
      do {
        if (d->nrows == d->cap) {
          if (d->cap >= MAX_ROWS) return 0;
          int cap = d->cap ? 2 * d->cap : 64;
          row *nr = realloc(d->rows, sizeof(row) * (size_t)cap);
          if (!nr) return 0;
          d->rows = nr;
          d->cap = cap;
        }
        if (!read_worker(r, &d->rows[d->nrows++], 2)) return 0;
      } while (eat(r, ','));
      if (!eat(r, ']')) return 0;
    } else if (v.kind == J_OTHER && !strcmp(key, "attribution")) {
      if (!eat(r, '{')) return 0;
      char k2[32];
      jval v2;
      int first2 = 1;
      while (next_member(r, &first2, k2, sizeof k2, &v2, 0, 1))
        if (!strcmp(k2, "median_step_s") && v2.kind == J_NUM) {
          d->median = v2.num;
          d->have_median = 1;
        }
      if (r->bad) return 0;
    } else if (v.kind == J_OTHER && !strcmp(key, "whatif")) {
      if (!eat(r, '{')) return 0;
      char k2[32];
      jval v2;
      int first2 = 1;
      while (next_member(r, &first2, k2, sizeof k2, &v2, 0, 1)) {
        double x = num_or(&v2, 0);
        if (!isfinite(x)) x = 0;
        if (!strcmp(k2, "gain")) d->gain = x;
        else if (!strcmp(k2, "waste")) d->waste = x;
        else if (!strcmp(k2, "saved")) d->saved = x;
        else if (!strcmp(k2, "cost_s")) d->cost_s = x;
        else if (!strcmp(k2, "job_steps")) d->job_steps = x;
      }
      if (r->bad) return 0;
    } else if (v.kind == J_OTHER) {
      jval skip;
      if (!read_value(r, &skip, 1)) return 0;
    } else if (!strcmp(key, "policy") && v.kind == J_STR) {
      snprintf(d->policy, sizeof d->policy, "%.15s", v.str);
    } else if (!strcmp(key, "nworkers")) {
      d->nworkers = num_or(&v, 0);
    } else if (!strcmp(key, "uptime_s")) {
      d->uptime_s = num_or(&v, 0);
    } else if (!strcmp(key, "workers_omitted")) {
      d->omitted = num_or(&v, 0);
    } else if (!strcmp(key, "standby")) {
      d->standby = v.kind == J_TRUE;
    }
  }
  return !r->bad && have_workers && peek(r) == -1;
}

/* ---- the table ------------------------------------------------------------------------------ */

enum { C_RANK, C_HOST, C_STATE, C_RATE, C_STEP, C_SLOW, C_COST, C_ONE, C_SEEN, C_NOTE, NCOLS };
static const char *const HEAD[NCOLS] = {"rank", "host", "state", "steps/s", "step", "slowdown",
                                        "of waste", "groups of one", "last seen", ""};
static const int LEFT[NCOLS] = {0, 1, 1, 0, 0, 0, 0, 0, 0, 1};
#define CELL 48

static void duration(char *out, double s) {
  if (s < 0) snprintf(out, CELL, "-");
  else if (s < 1) snprintf(out, CELL, "%.1f ms", s * 1e3);
  else if (s < 100) snprintf(out, CELL, "%.2f s", s);
  else snprintf(out, CELL, "%.0f s", s);
}

static void cells(const row *w, double cost_total, char c[NCOLS][CELL]) {
  snprintf(c[C_RANK], CELL, "%d", w->rank);
  snprintf(c[C_HOST], CELL, "%.*s", CELL - 1, w->host);
  snprintf(c[C_STATE], CELL, "%s", w->state[0] ? w->state : "?");
  if (w->steps_per_s < 0) snprintf(c[C_RATE], CELL, "-");
  else snprintf(c[C_RATE], CELL, w->steps_per_s < 10 ? "%.2f" : "%.1f", w->steps_per_s);
  /* The step shown is the one the slowdown is taken of: a longer step in progress counts. */
  duration(c[C_STEP], w->step_s > 0 ? (w->busy_s > w->step_s ? w->busy_s : w->step_s) : -1);
  if (w->slowdown < 0) snprintf(c[C_SLOW], CELL, "-");
  else snprintf(c[C_SLOW], CELL, "%.1fx", w->slowdown);
  /* Its share of the waiting all-reduce would have had (the document's whatif.cost_s). */
  if (w->cost_s >= 0 && cost_total > 0)
    snprintf(c[C_COST], CELL, "%.0f%%", 100.0 * w->cost_s / cost_total);
  else
    snprintf(c[C_COST], CELL, "-");
  if (w->handed > 0)
    snprintf(c[C_ONE], CELL, "%.0f (%.0f%%)", w->singletons, 100.0 * w->singletons / w->handed);
  else
    snprintf(c[C_ONE], CELL, "-");
  if (!w->seen || w->silent_s < 0) snprintf(c[C_SEEN], CELL, "never");
  else snprintf(c[C_SEEN], CELL, "%.1f s ago", w->silent_s);
  if (w->slow && w->slow_since >= 0)
    snprintf(c[C_NOTE], CELL, "slow since step %.0f", w->slow_since);
  else if (w->slow)
    snprintf(c[C_NOTE], CELL, "slow");
  else
    c[C_NOTE][0] = '\0';
}

static void put_row(coord_text *t, char c[NCOLS][CELL], const int *width) {
  int last = NCOLS - 1;
  while (last > 0 && !c[last][0]) last--;
  for (int k = 0; k <= last; k++)
    coord_printf(t, k < last ? (LEFT[k] ? "%-*s  " : "%*s  ") : (LEFT[k] ? "%-*s\n" : "%*s\n"),
                 k < last || !LEFT[k] ? width[k] : 0, c[k]);
}

rpl_status rpl_coord_status_table(const char *json, size_t len, char **out, rpl_error *err) {
  *out = NULL;
  jr r = {json, json + len, 0};
  doc d;
  memset(&d, 0, sizeof d);
  if (!json || !read_doc(&r, &d)) {
    free(d.rows);
    return rpl_fail(err, RPL_ERR_INVALID, "not a coordinator status document");
  }
  int width[NCOLS];
  char c[NCOLS][CELL];
  for (int k = 0; k < NCOLS; k++) width[k] = (int)strlen(HEAD[k]);
  for (int i = 0; i < d.nrows; i++) {
    cells(&d.rows[i], d.cost_s, c);
    for (int k = 0; k < NCOLS; k++)
      if ((int)strlen(c[k]) > width[k]) width[k] = (int)strlen(c[k]);
  }
  int line = 0;
  for (int k = 0; k < NCOLS; k++) line += width[k] + 2;
  coord_text t; /* sized for the whole table: it does not grow */
  if (coord_text_init(&t, (size_t)(d.nrows + 3) * (size_t)(line + 2) + 768) != 0) {
    free(d.rows);
    return rpl_fail(err, RPL_ERR_NOMEM, "out of memory");
  }
  char med[CELL];
  duration(med, d.have_median && d.median > 0 ? d.median : -1);
  coord_printf(&t, "%s coordinator%s, %.0f workers, median step %s, up %.0f s\n",
               d.policy[0] ? d.policy : "?", d.standby ? " (standby)" : "", d.nworkers, med,
               d.uptime_s);
  /* What-if (issue 50): known once every worker has a measured step. */
  if (d.gain > 0)
    coord_printf(&t,
                 "what-if over %.0f steps: all-reduce would spend %.0f%% of its time waiting "
                 "for stragglers (%.2fx the time with nobody waiting); this job took %.0f%% "
                 "less than all-reduce would\n",
                 d.job_steps, 100.0 * d.waste, d.gain, 100.0 * d.saved);
  for (int k = 0; k < NCOLS; k++) snprintf(c[k], CELL, "%s", HEAD[k]);
  put_row(&t, c, width);
  for (int i = 0; i < d.nrows; i++) {
    cells(&d.rows[i], d.cost_s, c);
    put_row(&t, c, width);
  }
  if (d.omitted > 0)
    coord_printf(&t,
                 "(%.0f more workers not listed: the status document is bounded; see --json)\n",
                 d.omitted);
  free(d.rows);
  if (t.oom) {
    free(t.p);
    return rpl_fail(err, RPL_ERR_NOMEM, "status table: output larger than sized");
  }
  *out = t.p;
  return RPL_OK;
}
