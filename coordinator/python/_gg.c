/* ripples_pg._gg: Python binding of the Group Generator (CPython C API, no torch):
 * (Kept valid as C and as C++: torch's BuildExtension may compile it with c++.)
 * the static schedule, the policy state machine, the coordinator service and its client.
 * Blocking calls release the GIL. Errors raise ValueError (bad arguments), TimeoutError,
 * ConnectionError (coordinator unreachable or gone) or RuntimeError. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "rpl_coord.h"
#include "rpl_sched.h"

static PyObject *raise_rpl(rpl_status st, const rpl_error *err) {
  PyObject *type = PyExc_RuntimeError;
  switch (st) {
    case RPL_ERR_INVALID: type = PyExc_ValueError; break;
    case RPL_ERR_TIMEOUT: type = PyExc_TimeoutError; break;
    case RPL_ERR_PEER: type = PyExc_ConnectionError; break;
    case RPL_ERR_NOMEM: type = PyExc_MemoryError; break;
    default: break;
  }
  PyErr_SetString(type, err->msg);
  return NULL;
}

/* host_of: None or a sequence of nworkers ints -> malloc'd array (or NULL for None). */
static int parse_hosts(PyObject *obj, int nworkers, int **out) {
  *out = NULL;
  if (obj == NULL || obj == Py_None) return 0;
  PyObject *seq = PySequence_Fast(obj, "host_of must be a sequence of ints");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n != nworkers) {
    PyErr_Format(PyExc_ValueError, "host_of has %zd entries, expected %d", n, nworkers);
    Py_DECREF(seq);
    return -1;
  }
  int *a = (int *)malloc(sizeof(int) * (size_t)(n ? n : 1));
  if (!a) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      free(a);
      Py_DECREF(seq);
      return -1;
    }
    a[i] = (int)v;
  }
  Py_DECREF(seq);
  *out = a;
  return 0;
}

static PyObject *int_list(const int *a, int n) {
  PyObject *l = PyList_New(n);
  if (!l) return NULL;
  for (int i = 0; i < n; i++) PyList_SET_ITEM(l, i, PyLong_FromLong(a[i]));
  return l;
}

static int parse_policy(const char *name, rpl_policy *p) {
  rpl_error err;
  if (rpl_policy_parse(name, p, &err) != RPL_OK) {
    PyErr_SetString(PyExc_ValueError, err.msg);
    return -1;
  }
  return 0;
}

/* ---- static schedule --------------------------------------------------------------------- */

static PyObject *py_static_round(PyObject *self, PyObject *args, PyObject *kw) {
  static const char *kwl[] = {"nworkers", "host_of", "round", NULL};
  int n;
  PyObject *hosts = Py_None;
  unsigned long long round;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iOK", (char **)kwl, &n, &hosts, &round)) return NULL;
  if (n < 1 || n > RPL_SCHED_MAX_WORKERS)
    return PyErr_Format(PyExc_ValueError, "nworkers %d out of range", n);
  int *labels;
  if (parse_hosts(hosts, n, &labels) != 0) return NULL;
  rpl_layout *l;
  rpl_error err;
  rpl_status st = rpl_layout_create(n, labels, &l, &err);
  free(labels);
  if (st != RPL_OK) return raise_rpl(st, &err);
  int *m = (int *)malloc(sizeof(int) * (size_t)n);
  char *done = (char *)calloc((size_t)n, 1);
  PyObject *res = PyList_New(0);
  for (int r = 0; res && m && done && r < n; r++) {
    if (done[r]) continue;
    int k;
    st = rpl_static_group(l, r, round, m, n, &k, NULL, &err);
    if (st != RPL_OK) {
      Py_CLEAR(res);
      raise_rpl(st, &err);
      break;
    }
    for (int i = 0; i < k; i++) done[m[i]] = 1;
    PyObject *g = int_list(m, k);
    if (!g || PyList_Append(res, g) != 0) Py_CLEAR(res);
    Py_XDECREF(g);
  }
  if (res && (!m || !done)) {
    Py_CLEAR(res);
    PyErr_NoMemory();
  }
  free(m);
  free(done);
  rpl_layout_destroy(l);
  return res;
}

/* ---- GroupGenerator (the policy state machine) ------------------------------------------ */

typedef struct {
  PyObject_HEAD rpl_gg *gg;
  int *members;
  int n;
} GGObject;

static void GG_dealloc(GGObject *o) {
  rpl_gg_destroy(o->gg);
  free(o->members);
  Py_TYPE(o)->tp_free((PyObject *)o);
}

static int GG_init(GGObject *o, PyObject *args, PyObject *kw) {
  static const char *kwl[] = {"policy", "nworkers", "host_of", "group_size", "c_thres", "inter_intra",
                        "seed", "partner_wait_ms", "max_isolated", "period_max", NULL};
  const char *policy;
  int n, group_size = 0, c_thres = 0, inter_intra = 0, wait_ms = 0, max_isolated = 0;
  int period_max = 0;
  unsigned long long seed = 0;
  PyObject *hosts = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "si|OiipKiii", (char **)kwl, &policy, &n, &hosts,
                                   &group_size, &c_thres, &inter_intra, &seed, &wait_ms,
                                   &max_isolated, &period_max))
    return -1;
  rpl_gg_config cfg;
  memset(&cfg, 0, sizeof cfg);
  if (parse_policy(policy, &cfg.policy) != 0) return -1;
  if (n < 1 || n > RPL_SCHED_MAX_WORKERS) {
    PyErr_Format(PyExc_ValueError, "nworkers %d out of range", n);
    return -1;
  }
  int *labels;
  if (parse_hosts(hosts, n, &labels) != 0) return -1;
  cfg.nworkers = n;
  cfg.host_of = labels;
  cfg.group_size = group_size;
  cfg.c_thres = c_thres;
  cfg.inter_intra = inter_intra;
  cfg.seed = seed;
  cfg.partner_wait_ms = wait_ms;
  cfg.max_isolated = max_isolated;
  cfg.period_max = period_max;
  rpl_error err;
  rpl_gg_destroy(o->gg);
  o->gg = NULL;
  rpl_status st = rpl_gg_create(&cfg, &o->gg, &err);
  free(labels);
  if (st != RPL_OK) {
    raise_rpl(st, &err);
    return -1;
  }
  free(o->members);
  o->members = (int *)malloc(sizeof(int) * (size_t)n);
  o->n = n;
  if (!o->members) {
    PyErr_NoMemory();
    return -1;
  }
  return 0;
}

#define GG_READY(o)                                                             \
  if (!(o)->gg) {                                                               \
    PyErr_SetString(PyExc_RuntimeError, "GroupGenerator not initialised");      \
    return NULL;                                                                \
  }

static PyObject *GG_request(GGObject *o, PyObject *args) {
  int w;
  unsigned long long round;
  if (!PyArg_ParseTuple(args, "iK", &w, &round)) return NULL;
  GG_READY(o);
  rpl_error err;
  rpl_status st = rpl_gg_request(o->gg, w, round, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}

static PyObject *GG_done(GGObject *o, PyObject *args) {
  int w;
  unsigned long long gid;
  if (!PyArg_ParseTuple(args, "iK", &w, &gid)) return NULL;
  GG_READY(o);
  rpl_error err;
  rpl_status st = rpl_gg_done(o->gg, w, gid, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}

static PyObject *gg_worker_op(GGObject *o, PyObject *args,
                              rpl_status (*fn)(rpl_gg *, int, rpl_error *)) {
  int w;
  if (!PyArg_ParseTuple(args, "i", &w)) return NULL;
  GG_READY(o);
  rpl_error err;
  rpl_status st = fn(o->gg, w, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}
static PyObject *GG_fence(GGObject *o, PyObject *a) { return gg_worker_op(o, a, rpl_gg_fence); }
static PyObject *GG_unfence(GGObject *o, PyObject *a) { return gg_worker_op(o, a, rpl_gg_unfence); }
static PyObject *GG_leave(GGObject *o, PyObject *a) { return gg_worker_op(o, a, rpl_gg_leave); }
static PyObject *GG_dead(GGObject *o, PyObject *a) { return gg_worker_op(o, a, rpl_gg_dead); }

static PyObject *GG_poll(GGObject *o, PyObject *unused) {
  GG_READY(o);
  PyObject *res = PyList_New(0);
  rpl_gg_event ev;
  while (res && rpl_gg_poll(o->gg, &ev, o->members, o->n)) {
    PyObject *t;
    if (ev.kind == RPL_EV_GROUP) {
      PyObject *m = int_list(o->members, ev.nmembers);
      t = m ? Py_BuildValue("(siKKNi)", "group", ev.worker, (unsigned long long)ev.group_id,
                            (unsigned long long)ev.round, m, ev.period)
            : NULL;
    } else if (ev.kind == RPL_EV_PASS) { /* no group: nothing to reduce, no done to send */
      t = Py_BuildValue("(siKi)", "pass", ev.worker, (unsigned long long)ev.round, ev.period);
    } else if (ev.kind == RPL_EV_CANCEL) {
      t = Py_BuildValue("(siKKis)", "cancel", ev.worker, (unsigned long long)ev.group_id,
                        (unsigned long long)ev.round, ev.culprit, rpl_reason_name(ev.reason));
    } else { /* a kind this binding does not know: fail loudly rather than drop an answer */
      PyErr_Format(PyExc_RuntimeError, "GroupGenerator.poll: unknown event kind %d",
                   (int)ev.kind);
      t = NULL;
    }
    if (!t || PyList_Append(res, t) != 0) Py_CLEAR(res);
    Py_XDECREF(t);
  }
  return res;
}

static PyObject *GG_stats(GGObject *o, PyObject *unused) {
  GG_READY(o);
  rpl_gg_stats s;
  rpl_gg_get_stats(o->gg, &s);
  return Py_BuildValue(
      "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsIsi}", "requests", (unsigned long long)s.requests,
      "groups_created", (unsigned long long)s.groups_created, "groups_handed",
      (unsigned long long)s.groups_handed, "groups_cancelled",
      (unsigned long long)s.groups_cancelled, "singletons_handed",
      (unsigned long long)s.singletons_handed, "divisions", (unsigned long long)s.divisions,
      "filtered", (unsigned long long)s.filtered, "conflicts", (unsigned long long)s.conflicts,
      "implicit_dones", (unsigned long long)s.implicit_dones, "stale_dones",
      (unsigned long long)s.stale_dones, "pending", (unsigned long long)s.pending, "deferred",
      (unsigned long long)s.deferred, "wait_expired", (unsigned long long)s.wait_expired,
      "isolation_holds", (unsigned long long)s.isolation_holds, "joins",
      (unsigned long long)s.joins, "late", (unsigned long long)s.late, "passes",
      (unsigned long long)s.passes, "period_drops", (unsigned long long)s.period_drops, "late_dropped",
      (unsigned long long)s.late_dropped, "period",
      (unsigned int)s.period, "period_max", rpl_gg_period_max(o->gg));
}

static PyObject *GG_worker(GGObject *o, PyObject *args) {
  int w;
  if (!PyArg_ParseTuple(args, "i", &w)) return NULL;
  GG_READY(o);
  rpl_gg_worker_info wi;
  rpl_error err;
  rpl_status st = rpl_gg_worker(o->gg, w, &wi, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  return Py_BuildValue("{sssisKsOsisKsKsKsIsIsOsKsd}", "state", rpl_worker_state_name(wi.state),
                       "host", wi.host, "requests", (unsigned long long)wi.requests, "waiting",
                       wi.waiting ? Py_True : Py_False, "buffered", wi.buffered, "head_group",
                       (unsigned long long)wi.head_group, "locked_group",
                       (unsigned long long)wi.locked_group, "singletons",
                       (unsigned long long)wi.singletons, "lonely", (unsigned int)wi.lonely,
                       "lonely_max", (unsigned int)wi.lonely_max, "deferred",
                       wi.deferred ? Py_True : Py_False, "passes",
                       (unsigned long long)wi.passes, "step", wi.step);
}

static PyObject *GG_advance(GGObject *o, PyObject *args) {
  double now;
  if (!PyArg_ParseTuple(args, "d", &now)) return NULL;
  GG_READY(o);
  rpl_error err;
  rpl_status st = rpl_gg_advance(o->gg, now, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  double next = rpl_gg_next_deadline(o->gg);
  if (next < 0) Py_RETURN_NONE;
  return PyFloat_FromDouble(next);
}

static PyMethodDef GG_methods[] = {
    {"request", (PyCFunction)GG_request, METH_VARARGS, "request(worker, round): ask for a group"},
    {"done", (PyCFunction)GG_done, METH_VARARGS, "done(worker, group_id)"},
    {"fence", (PyCFunction)GG_fence, METH_VARARGS, "fence(worker)"},
    {"unfence", (PyCFunction)GG_unfence, METH_VARARGS, "unfence(worker)"},
    {"leave", (PyCFunction)GG_leave, METH_VARARGS, "leave(worker)"},
    {"dead", (PyCFunction)GG_dead, METH_VARARGS, "dead(worker)"},
    {"poll", (PyCFunction)GG_poll, METH_NOARGS,
     "poll() -> [('group', worker, gid, round, members, period) | ('pass', worker, round, "
     "period) | ('cancel', worker, gid, round, culprit, reason)]: 'pass' = the adaptive period "
     "answered the request with no group (a no-op round: ask again for the next round, no "
     "done); period = the adaptive period when answered (1 = every request averages)"},
    {"stats", (PyCFunction)GG_stats, METH_NOARGS,
     "counters as a dict (passes, period_drops, period: the adaptive period now; period_max: "
     "its effective bound)"},
    {"worker", (PyCFunction)GG_worker, METH_VARARGS,
     "worker(w) -> dict (passes: requests passed; step: its compute step in seconds of the "
     "GG's clock, 0 = unknown)"},
    {"advance", (PyCFunction)GG_advance, METH_VARARGS,
     "advance(now_s) -> next deadline or None: move the clock, end waits for partners"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject GGType = {PyVarObject_HEAD_INIT(NULL, 0)};

/* ---- Coordinator ------------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD rpl_coord *c;
} CoordObject;

static void Coord_dealloc(CoordObject *o) {
  if (o->c) {
    Py_BEGIN_ALLOW_THREADS rpl_coord_destroy(o->c);
    Py_END_ALLOW_THREADS o->c = NULL;
  }
  Py_TYPE(o)->tp_free((PyObject *)o);
}

/* host_names: None or a sequence of nworkers str (or None) -> malloc'd array of pointers into
 * the sequence's strings, valid while *keep (a new reference, or NULL) lives. */
static int parse_names(PyObject *obj, int nworkers, const char ***out, PyObject **keep) {
  *out = NULL;
  *keep = NULL;
  if (obj == NULL || obj == Py_None) return 0;
  PyObject *seq = PySequence_Fast(obj, "host_names must be a sequence of str");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n != nworkers) {
    PyErr_Format(PyExc_ValueError, "host_names has %zd entries, expected %d", n, nworkers);
    Py_DECREF(seq);
    return -1;
  }
  const char **a = (const char **)calloc((size_t)(n ? n : 1), sizeof *a);
  if (!a) {
    Py_DECREF(seq);
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
    if (it == Py_None) continue;
    a[i] = PyUnicode_AsUTF8(it); /* owned by the str, which seq holds */
    if (!a[i]) {
      free((void *)a);
      Py_DECREF(seq);
      return -1;
    }
  }
  *out = a;
  *keep = seq;
  return 0;
}

static int Coord_init(CoordObject *o, PyObject *args, PyObject *kw) {
  static const char *kwl[] = {"nworkers",    "policy", "bind",         "token",   "host_of",
                        "group_size",  "c_thres", "inter_intra", "seed",    "heartbeat_ms",
                        "dead_ms",     "join_ms", "partner_wait_ms", "max_isolated", "period_max",
                        "standby",     "host_names", NULL};
  int n, group_size = 0, c_thres = 0, inter_intra = 0, hb = 0, dead = 0, join = 0;
  int wait_ms = 0, max_isolated = 0, period_max = 0, standby = 0;
  const char *policy = "smart", *bind = NULL, *token = NULL;
  PyObject *hosts = Py_None, *names_obj = Py_None;
  unsigned long long seed = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "i|szzOiipKiiiiiipO", (char **)kwl, &n, &policy,
                                   &bind, &token, &hosts, &group_size, &c_thres, &inter_intra,
                                   &seed, &hb, &dead, &join, &wait_ms, &max_isolated,
                                   &period_max, &standby, &names_obj))
    return -1;
  rpl_coord_config cfg;
  memset(&cfg, 0, sizeof cfg);
  if (parse_policy(policy, &cfg.gg.policy) != 0) return -1;
  if (n < 1 || n > RPL_SCHED_MAX_WORKERS) {
    PyErr_Format(PyExc_ValueError, "nworkers %d out of range", n);
    return -1;
  }
  int *labels;
  if (parse_hosts(hosts, n, &labels) != 0) return -1;
  const char **names;
  PyObject *names_keep;
  if (parse_names(names_obj, n, &names, &names_keep) != 0) {
    free(labels);
    return -1;
  }
  cfg.host_names = names;
  cfg.bind = bind;
  cfg.token_hex = token;
  cfg.gg.nworkers = n;
  cfg.gg.host_of = labels;
  cfg.gg.group_size = group_size;
  cfg.gg.c_thres = c_thres;
  cfg.gg.inter_intra = inter_intra;
  cfg.gg.seed = seed;
  cfg.gg.partner_wait_ms = wait_ms;
  cfg.gg.max_isolated = max_isolated;
  cfg.gg.period_max = period_max;
  cfg.heartbeat_ms = hb;
  cfg.dead_ms = dead;
  cfg.join_ms = join;
  cfg.standby = standby;
  rpl_error err;
  rpl_status st;
  if (o->c) {
    PyErr_SetString(PyExc_RuntimeError, "Coordinator already initialised");
    free(labels);
    free((void *)names);
    Py_XDECREF(names_keep);
    return -1;
  }
  Py_BEGIN_ALLOW_THREADS st = rpl_coord_create(&cfg, &o->c, &err);
  Py_END_ALLOW_THREADS free(labels);
  free((void *)names); /* copied by the coordinator */
  Py_XDECREF(names_keep);
  if (st != RPL_OK) {
    raise_rpl(st, &err);
    return -1;
  }
  return 0;
}

#define COORD_READY(o)                                                        \
  if (!(o)->c) {                                                              \
    PyErr_SetString(PyExc_RuntimeError, "Coordinator is closed");             \
    return NULL;                                                              \
  }

static PyObject *Coord_start(CoordObject *o, PyObject *unused) {
  COORD_READY(o);
  rpl_error err;
  rpl_status st = rpl_coord_start(o->c, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}

static PyObject *Coord_run(CoordObject *o, PyObject *unused) {
  COORD_READY(o);
  rpl_error err;
  rpl_status st;
  Py_BEGIN_ALLOW_THREADS st = rpl_coord_run(o->c, &err);
  Py_END_ALLOW_THREADS if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}

static PyObject *Coord_stop(CoordObject *o, PyObject *unused) {
  if (o->c) {
    Py_BEGIN_ALLOW_THREADS rpl_coord_stop(o->c);
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static PyObject *Coord_close(CoordObject *o, PyObject *unused) {
  if (o->c) {
    rpl_coord *c = o->c;
    o->c = NULL;
    Py_BEGIN_ALLOW_THREADS rpl_coord_destroy(c);
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static PyObject *Coord_endpoint(CoordObject *o, void *unused) {
  COORD_READY(o);
  return PyUnicode_FromString(rpl_coord_endpoint(o->c));
}

static PyObject *Coord_token(CoordObject *o, void *unused) {
  COORD_READY(o);
  return PyUnicode_FromString(rpl_coord_token(o->c));
}

static PyObject *Coord_counters(CoordObject *o, PyObject *unused) {
  COORD_READY(o);
  rpl_coord_counters k;
  rpl_coord_get_counters(o->c, &k);
  return Py_BuildValue("{sKsKsKsKsKsKsKsKsKsK}", "messages", (unsigned long long)k.messages,
                       "malformed", (unsigned long long)k.malformed, "bad_token",
                       (unsigned long long)k.bad_token, "errors_sent",
                       (unsigned long long)k.errors_sent, "dead_declared",
                       (unsigned long long)k.dead_declared, "send_failures",
                       (unsigned long long)k.send_failures, "wrong_route",
                       (unsigned long long)k.wrong_route, "replayed",
                       (unsigned long long)k.replayed, "rebinds", (unsigned long long)k.rebinds,
                       "bad_token_quiet", (unsigned long long)k.bad_token_quiet);
}

static PyObject *Coord_active_workers(CoordObject *o, PyObject *args) {
  COORD_READY(o);
  int except_rank = -1;
  if (!PyArg_ParseTuple(args, "|i", &except_rank)) return NULL;
  return PyLong_FromLong(rpl_coord_active_workers(o->c, except_rank));
}

static PyMethodDef Coord_methods[] = {
    {"active_workers", (PyCFunction)Coord_active_workers, METH_VARARGS,
     "active_workers(except_rank=-1): workers neither left nor dead"},
    {"start", (PyCFunction)Coord_start, METH_NOARGS, "serve on a background thread"},
    {"run", (PyCFunction)Coord_run, METH_NOARGS, "serve on this thread until stop()"},
    {"stop", (PyCFunction)Coord_stop, METH_NOARGS, "stop serving (joins the thread)"},
    {"close", (PyCFunction)Coord_close, METH_NOARGS, "stop and free"},
    {"counters", (PyCFunction)Coord_counters, METH_NOARGS, "service counters"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Coord_getset[] = {
    {"endpoint", (getter)Coord_endpoint, NULL, "endpoint clients connect to", NULL},
    {"token", (getter)Coord_token, NULL, "job token (hex)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject CoordType = {PyVarObject_HEAD_INIT(NULL, 0)};

/* ---- Client ----------------------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD rpl_gg_client *cl;
  int nworkers;
  int *members;
} ClientObject;

static void Client_dealloc(ClientObject *o) {
  if (o->cl) {
    Py_BEGIN_ALLOW_THREADS rpl_gg_client_destroy(o->cl);
    Py_END_ALLOW_THREADS
  }
  free(o->members);
  Py_TYPE(o)->tp_free((PyObject *)o);
}

static int Client_init(ClientObject *o, PyObject *args, PyObject *kw) {
  static const char *kwl[] = {"endpoint", "token", "rank", "nworkers", "host_label", "timeout_ms",
                        "request_timeout_ms", "heartbeat_ms", NULL};
  rpl_gg_client_config cc;
  memset(&cc, 0, sizeof cc);
  cc.host_label = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ssii|iiii", (char **)kwl, &cc.endpoint, &cc.token_hex,
                                   &cc.rank, &cc.nworkers, &cc.host_label, &cc.timeout_ms,
                                   &cc.request_timeout_ms, &cc.heartbeat_ms))
    return -1;
  if (o->cl) {
    PyErr_SetString(PyExc_RuntimeError, "Client already initialised");
    return -1;
  }
  rpl_error err;
  rpl_status st;
  Py_BEGIN_ALLOW_THREADS st = rpl_gg_client_create(&cc, &o->cl, &err);
  Py_END_ALLOW_THREADS if (st != RPL_OK) {
    raise_rpl(st, &err);
    return -1;
  }
  o->nworkers = cc.nworkers;
  o->members = (int *)malloc(sizeof(int) * (size_t)cc.nworkers);
  if (!o->members) {
    PyErr_NoMemory();
    return -1;
  }
  return 0;
}

#define CLIENT_READY(o)                                                       \
  if (!(o)->cl) {                                                             \
    PyErr_SetString(PyExc_RuntimeError, "Client is closed");                  \
    return NULL;                                                              \
  }

static PyObject *Client_request(ClientObject *o, PyObject *args) {
  unsigned long long round;
  if (!PyArg_ParseTuple(args, "K", &round)) return NULL;
  CLIENT_READY(o);
  rpl_error err;
  rpl_status st;
  int n = 0;
  uint64_t gid = 0;
  Py_BEGIN_ALLOW_THREADS st =
      rpl_gg_client_request(o->cl, round, o->members, o->nworkers, &n, &gid, &err);
  Py_END_ALLOW_THREADS if (st != RPL_OK) return raise_rpl(st, &err);
  PyObject *m = int_list(o->members, n);
  return m ? Py_BuildValue("(KN)", (unsigned long long)gid, m) : NULL;
}

static PyObject *Client_done(ClientObject *o, PyObject *args) {
  unsigned long long gid;
  unsigned int status = 0;
  if (!PyArg_ParseTuple(args, "K|I", &gid, &status)) return NULL;
  CLIENT_READY(o);
  rpl_error err;
  rpl_status st = rpl_gg_client_done(o->cl, gid, status, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}

static PyObject *Client_fence(ClientObject *o, PyObject *unused) {
  CLIENT_READY(o);
  rpl_error err;
  rpl_status st = rpl_gg_client_fence(o->cl, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}

static PyObject *Client_unfence(ClientObject *o, PyObject *unused) {
  CLIENT_READY(o);
  rpl_error err;
  rpl_status st = rpl_gg_client_unfence(o->cl, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}

static PyObject *Client_leave(ClientObject *o, PyObject *unused) {
  CLIENT_READY(o);
  rpl_error err;
  rpl_status st;
  Py_BEGIN_ALLOW_THREADS st = rpl_gg_client_leave(o->cl, &err);
  Py_END_ALLOW_THREADS if (st != RPL_OK) return raise_rpl(st, &err);
  Py_RETURN_NONE;
}

static PyObject *Client_close(ClientObject *o, PyObject *unused) {
  if (o->cl) {
    rpl_gg_client *cl = o->cl;
    o->cl = NULL;
    Py_BEGIN_ALLOW_THREADS rpl_gg_client_destroy(cl);
    Py_END_ALLOW_THREADS
  }
  Py_RETURN_NONE;
}

static PyObject *Client_stats(ClientObject *o, PyObject *unused) {
  CLIENT_READY(o);
  rpl_gg_client_stats s;
  rpl_gg_client_get_stats(o->cl, &s);
  return Py_BuildValue("{sKsKsKsKsdsKsI}", "requests", (unsigned long long)s.requests,
                       "cancels", (unsigned long long)s.cancels, "heartbeats_sent",
                       (unsigned long long)s.heartbeats_sent, "heartbeats_acked",
                       (unsigned long long)s.heartbeats_acked, "wait_s", s.wait_s, "passes",
                       (unsigned long long)s.passes, "period", (unsigned int)s.period);
}

static PyMethodDef Client_methods[] = {
    {"request", (PyCFunction)Client_request, METH_VARARGS,
     "request(round) -> (group_id, members); blocks until the group is formed. group_id 0: the "
     "coordinator's adaptive period passed the round (members = [rank]; no done to send)"},
    {"done", (PyCFunction)Client_done, METH_VARARGS, "done(group_id, status=0)"},
    {"fence", (PyCFunction)Client_fence, METH_NOARGS, "fence()"},
    {"unfence", (PyCFunction)Client_unfence, METH_NOARGS, "unfence()"},
    {"leave", (PyCFunction)Client_leave, METH_NOARGS, "leave() and wait for the ack"},
    {"close", (PyCFunction)Client_close, METH_NOARGS, "stop heartbeats, close sockets"},
    {"stats", (PyCFunction)Client_stats, METH_NOARGS,
     "client counters (passes: rounds passed; period: the adaptive period in the last answer, "
     "0 before the first)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject ClientType = {PyVarObject_HEAD_INIT(NULL, 0)};

/* ---- module -------------------------------------------------------------------------------- */

static PyObject *py_status(PyObject *self, PyObject *args, PyObject *kw) {
  static const char *kwl[] = {"endpoint", "token", "timeout_ms", "rank", NULL};
  const char *endpoint, *token;
  int timeout_ms = 5000, rank = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "ss|ii", (char **)kwl, &endpoint, &token,
                                   &timeout_ms, &rank))
    return NULL;
  char *json = NULL;
  rpl_error err;
  rpl_status st;
  Py_BEGIN_ALLOW_THREADS st =
      rank < 0 ? rpl_gg_query_status(endpoint, token, timeout_ms, &json, &err)
               : rpl_gg_query_rank_status(endpoint, token, rank, timeout_ms, &json, &err);
  Py_END_ALLOW_THREADS if (st != RPL_OK) return raise_rpl(st, &err);
  PyObject *s = PyUnicode_FromString(json);
  free(json);
  return s;
}

static PyObject *py_status_table(PyObject *self, PyObject *args) {
  const char *json;
  Py_ssize_t len;
  if (!PyArg_ParseTuple(args, "s#", &json, &len)) return NULL;
  char *table = NULL;
  rpl_error err;
  rpl_status st = rpl_coord_status_table(json, (size_t)len, &table, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  PyObject *s = PyUnicode_FromString(table);
  free(table);
  return s;
}

static PyObject *py_generate_token(PyObject *self, PyObject *unused) {
  uint8_t tok[RPL_TOKEN_LEN];
  char hex[2 * RPL_TOKEN_LEN + 1];
  rpl_error err;
  rpl_status st = rpl_token_generate(tok, &err);
  if (st != RPL_OK) return raise_rpl(st, &err);
  rpl_token_to_hex(tok, hex);
  return PyUnicode_FromString(hex);
}

static PyMethodDef module_methods[] = {
    {"static_round", (PyCFunction)(void (*)(void))py_static_round, METH_VARARGS | METH_KEYWORDS,
     "static_round(nworkers, host_of, round) -> list of groups (sorted lists), a partition"},
    {"status", (PyCFunction)(void (*)(void))py_status, METH_VARARGS | METH_KEYWORDS,
     "status(endpoint, token, timeout_ms=5000, rank=-1) -> JSON text of a running coordinator: "
     "its whole status document, or with rank >= 0 that rank's summary (its step and slowdown, "
     "the slowest ranks), from the first coordinator of a comma-separated endpoint list that "
     "serves the rank"},
    {"status_table", (PyCFunction)py_status_table, METH_VARARGS,
     "status_table(json) -> the status document as the table ripples-coordinator --status "
     "prints"},
    {"generate_token", py_generate_token, METH_NOARGS, "a fresh job token (32 hex digits)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ripples_pg._gg",
                                    "Group Generator: policies, coordinator and client.", -1,
                                    module_methods, NULL, NULL, NULL, NULL};

/* Filled in at import: designated initializers would not compile as C++. */
static void init_types(void) {
  GGType.tp_name = "ripples_pg._gg.GroupGenerator";
  GGType.tp_basicsize = sizeof(GGObject);
  GGType.tp_dealloc = (destructor)GG_dealloc;
  GGType.tp_flags = Py_TPFLAGS_DEFAULT;
  GGType.tp_doc = "GroupGenerator(policy, nworkers, host_of=None, group_size=0, c_thres=0, "
                  "inter_intra=False, seed=0, partner_wait_ms=0, max_isolated=0, period_max=0): "
                  "the policy state machine, no I/O (advance() moves its clock; the adaptive "
                  "period needs it). period_max: 0 = default (DEFAULT_PERIOD_MAX), 1 or "
                  "negative = average at every request.";
  GGType.tp_methods = GG_methods;
  GGType.tp_init = (initproc)GG_init;
  GGType.tp_new = PyType_GenericNew;

  CoordType.tp_name = "ripples_pg._gg.Coordinator";
  CoordType.tp_basicsize = sizeof(CoordObject);
  CoordType.tp_dealloc = (destructor)Coord_dealloc;
  CoordType.tp_flags = Py_TPFLAGS_DEFAULT;
  CoordType.tp_doc = "Coordinator(nworkers, policy='smart', bind=None, token=None, host_of=None, "
                     "group_size=0, c_thres=0, inter_intra=False, seed=0, heartbeat_ms=0, "
                     "dead_ms=0, join_ms=0, partner_wait_ms=0, max_isolated=0, period_max=0, "
                     "standby=False, host_names=None): the Group Generator service (bound at "
                     "construction; period_max: the adaptive period, see GroupGenerator; "
                     "standby: a failover coordinator, every worker out until it registers; "
                     "host_names: each rank's host name, for the status and the slow-worker "
                     "lines it writes on stderr).";
  CoordType.tp_methods = Coord_methods;
  CoordType.tp_getset = Coord_getset;
  CoordType.tp_init = (initproc)Coord_init;
  CoordType.tp_new = PyType_GenericNew;

  ClientType.tp_name = "ripples_pg._gg.Client";
  ClientType.tp_basicsize = sizeof(ClientObject);
  ClientType.tp_dealloc = (destructor)Client_dealloc;
  ClientType.tp_flags = Py_TPFLAGS_DEFAULT;
  ClientType.tp_doc = "Client(endpoint, token, rank, nworkers, host_label=-1, timeout_ms=0, "
                      "request_timeout_ms=0, heartbeat_ms=0): a worker's connection to the "
                      "coordinator.";
  ClientType.tp_methods = Client_methods;
  ClientType.tp_init = (initproc)Client_init;
  ClientType.tp_new = PyType_GenericNew;
}

PyMODINIT_FUNC PyInit__gg(void) {
  init_types();
  if (PyType_Ready(&GGType) < 0 || PyType_Ready(&CoordType) < 0 || PyType_Ready(&ClientType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&module);
  if (!m) return NULL;
  Py_INCREF(&GGType);
  Py_INCREF(&CoordType);
  Py_INCREF(&ClientType);
  PyModule_AddObject(m, "GroupGenerator", (PyObject *)&GGType);
  PyModule_AddObject(m, "Coordinator", (PyObject *)&CoordType);
  PyModule_AddObject(m, "Client", (PyObject *)&ClientType);
  PyModule_AddIntConstant(m, "DEFAULT_GROUP_SIZE", RPL_GG_DEFAULT_GROUP_SIZE);
  PyModule_AddIntConstant(m, "DEFAULT_C_THRES", RPL_GG_DEFAULT_C_THRES);
  PyModule_AddIntConstant(m, "STATIC_PERIOD", RPL_STATIC_PERIOD);
  PyModule_AddIntConstant(m, "DEFAULT_PERIOD_MAX", RPL_GG_DEFAULT_PERIOD_MAX);
  PyModule_AddIntConstant(m, "MAX_PERIOD", RPL_GG_MAX_PERIOD);
  PyModule_AddIntConstant(m, "PROTOCOL_VERSION", RPL_PROTO_VERSION);
  PyObject *pol = Py_BuildValue("(ssss)", "static", "random", "smart", "adpsgd");
  if (pol) PyModule_AddObject(m, "POLICIES", pol);
  return m;
}
