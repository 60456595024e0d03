// GroupGenerator: the Group Generator's Python binding, ripples_pg._C.gg (no torch in it).
//
// It binds the same C libraries the backend links (csrc/sched, coordinator/), so their code
// and state are in the process once. Blocking calls (the coordinator's create and run, every
// client call that waits on the network, status queries, the command line) release the GIL.
// Errors raise as Errors.hpp's table says for the Group Generator (ValueError, TimeoutError,
// ConnectionError, MemoryError or RuntimeError), with the C library's message.
#include "GroupGenerator.hpp"

#include "Errors.hpp"

#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rpl_coord.h"
#include "rpl_coord_cli.h"
#include "rpl_sched.h"

namespace py = pybind11;

namespace ripples {
namespace {

using Hosts = std::optional<std::vector<int>>;

[[noreturn]] void throwRpl(rpl_status st, const rpl_error& err) {
  throwStatus(StatusUser::kCoordinator, st, err.msg);
}

// Call with the GIL held (after any release around the call that produced st).
void check(rpl_status st, const rpl_error& err) {
  if (st != RPL_OK) throwRpl(st, err);
}

// Runs fn(rpl_error*) -> rpl_status, a C call that may block, without the GIL; raises its
// error once the GIL is back.
template <typename Fn>
void callReleased(Fn&& fn) {
  rpl_error err;
  rpl_status st;
  {
    py::gil_scoped_release nogil;
    st = fn(&err);
  }
  check(st, err);
}

// Seeds, rounds and group ids are taken modulo 2**64, as the C API's uint64_t (a negative
// seed is a valid one).
uint64_t u64(const py::int_& v) {
  unsigned long long x = PyLong_AsUnsignedLongLongMask(v.ptr());
  if (PyErr_Occurred()) throw py::error_already_set();
  return x;
}

void checkWorkers(int n) {
  if (n < 1 || n > RPL_SCHED_MAX_WORKERS)
    throw py::value_error("nworkers " + std::to_string(n) + " out of range");
}

// host_of: None (one host) or one label per worker.
const int* hostLabels(const Hosts& hosts, int n) {
  if (!hosts) return nullptr;
  if (static_cast<int64_t>(hosts->size()) != n)
    throw py::value_error("host_of has " + std::to_string(hosts->size()) +
                          " entries, expected " + std::to_string(n));
  return hosts->data();
}

rpl_policy parsePolicy(const std::string& name) {
  rpl_policy p;
  rpl_error err;
  if (rpl_policy_parse(name.c_str(), &p, &err) != RPL_OK) throw py::value_error(err.msg);
  return p;
}

py::list intList(const int* a, int n) {
  py::list l;
  for (int i = 0; i < n; ++i) l.append(a[i]);
  return l;
}

// The policy knobs GroupGenerator and Coordinator share, into cfg (host_of must outlive it).
void fillPolicy(rpl_gg_config& cfg, const std::string& policy, int n, const Hosts& host_of,
                int group_size, int c_thres, bool inter_intra, const py::int_& seed,
                int partner_wait_ms, int max_isolated, int period_max) {
  cfg.policy = parsePolicy(policy);
  checkWorkers(n);
  cfg.host_of = hostLabels(host_of, n);
  cfg.nworkers = n;
  cfg.group_size = group_size;
  cfg.c_thres = c_thres;
  cfg.inter_intra = inter_intra ? 1 : 0;
  cfg.seed = u64(seed);
  cfg.partner_wait_ms = partner_wait_ms;
  cfg.max_isolated = max_isolated;
  cfg.period_max = period_max;
}

py::list staticRound(int n, const Hosts& host_of, const py::int_& round_obj) {
  checkWorkers(n);
  uint64_t round = u64(round_obj);
  rpl_layout* l;
  rpl_error err;
  check(rpl_layout_create(n, hostLabels(host_of, n), &l, &err), err);
  std::unique_ptr<rpl_layout, void (*)(rpl_layout*)> owned(l, rpl_layout_destroy);
  std::vector<int> m(n);
  std::vector<char> done(n, 0);
  py::list res;
  for (int r = 0; r < n; ++r) {
    if (done[r]) continue;
    int k;
    check(rpl_static_group(l, r, round, m.data(), n, &k, nullptr, &err), err);
    for (int i = 0; i < k; ++i) done[m[i]] = 1;
    res.append(intList(m.data(), k));
  }
  return res;
}

// Counters into a dict: d["f"] = s.f, the Python key being the C field's name.
#define PUT(f) d[#f] = s.f

// ---- GroupGenerator (the policy state machine) ---------------------------------------------

class GroupGenerator {
 public:
  GroupGenerator(const std::string& policy, int n, const Hosts& host_of, int group_size,
                 int c_thres, bool inter_intra, const py::int_& seed, int partner_wait_ms,
                 int max_isolated, int period_max) {
    rpl_gg_config cfg{};
    fillPolicy(cfg, policy, n, host_of, group_size, c_thres, inter_intra, seed,
               partner_wait_ms, max_isolated, period_max);
    rpl_error err;
    check(rpl_gg_create(&cfg, &gg_, &err), err);
    members_.resize(n);
  }
  ~GroupGenerator() { rpl_gg_destroy(gg_); }
  GroupGenerator(const GroupGenerator&) = delete;
  GroupGenerator& operator=(const GroupGenerator&) = delete;

  void request(int w, const py::int_& round) {
    rpl_error err;
    check(rpl_gg_request(gg_, w, u64(round), &err), err);
  }
  void done(int w, const py::int_& gid) {
    rpl_error err;
    check(rpl_gg_done(gg_, w, u64(gid), &err), err);
  }
  // fence, unfence, leave, dead: one worker's event.
  void workerOp(rpl_status (*fn)(rpl_gg*, int, rpl_error*), int w) {
    rpl_error err;
    check(fn(gg_, w, &err), err);
  }

  py::list poll() {
    py::list res;
    rpl_gg_event ev;
    int* m = members_.data();
    while (rpl_gg_poll(gg_, &ev, m, static_cast<int>(members_.size()))) {
      if (ev.kind == RPL_EV_GROUP) {
        res.append(py::make_tuple("group", ev.worker, ev.group_id, ev.round,
                                  intList(m, ev.nmembers), ev.period));
      } else if (ev.kind == RPL_EV_PASS) { // no group: nothing to reduce, no done to send
        res.append(py::make_tuple("pass", ev.worker, ev.round, ev.period));
      } else if (ev.kind == RPL_EV_CANCEL) {
        res.append(py::make_tuple("cancel", ev.worker, ev.group_id, ev.round, ev.culprit,
                                  rpl_reason_name(ev.reason)));
      } else { // a kind this binding does not know: fail loudly rather than drop an answer
        throw std::runtime_error("GroupGenerator.poll: unknown event kind " +
                                 std::to_string(static_cast<int>(ev.kind)));
      }
    }
    return res;
  }

  py::dict stats() const {
    rpl_gg_stats s;
    rpl_gg_get_stats(gg_, &s);
    py::dict d;
    PUT(requests); PUT(groups_created); PUT(groups_handed); PUT(groups_cancelled);
    PUT(singletons_handed); PUT(divisions); PUT(filtered); PUT(conflicts); PUT(implicit_dones);
    PUT(stale_dones); PUT(pending); PUT(deferred); PUT(wait_expired); PUT(isolation_holds);
    PUT(joins); PUT(late); PUT(passes); PUT(period_drops); PUT(late_dropped); PUT(period);
    d["period_max"] = rpl_gg_period_max(gg_);
    return d;
  }

  py::dict worker(int w) const {
    rpl_gg_worker_info s;
    rpl_error err;
    check(rpl_gg_worker(gg_, w, &s, &err), err);
    py::dict d;
    d["state"] = rpl_worker_state_name(s.state);
    PUT(host); PUT(requests); PUT(waiting); PUT(buffered); PUT(head_group); PUT(locked_group);
    PUT(singletons); PUT(lonely); PUT(lonely_max); PUT(deferred); PUT(passes); PUT(step);
    d["waiting"] = s.waiting != 0; // as bools, in their places
    d["deferred"] = s.deferred != 0;
    return d;
  }

  py::object advance(double now) {
    rpl_error err;
    check(rpl_gg_advance(gg_, now, &err), err);
    double next = rpl_gg_next_deadline(gg_);
    return next < 0 ? py::object(py::none()) : py::object(py::float_(next));
  }

 private:
  rpl_gg* gg_ = nullptr;
  std::vector<int> members_; // poll's member buffer, one slot per worker
};

// One C object a Python object owns: close() frees it without the GIL (freeing joins the
// service's thread or closes sockets); get() refuses a closed one with closed_msg.
template <typename T, void (*Destroy)(T*)>
class Owned {
 public:
  explicit Owned(const char* closed_msg) : closed_msg_(closed_msg) {}
  ~Owned() { close(); }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;

  T* get() const {
    if (!p_) throw std::runtime_error(closed_msg_);
    return p_;
  }
  T** out() { return &p_; } // for the C create call
  bool open() const { return p_ != nullptr; }
  void close() {
    T* p = p_;
    p_ = nullptr;
    if (!p) return;
    py::gil_scoped_release nogil;
    Destroy(p);
  }

 private:
  T* p_ = nullptr;
  const char* closed_msg_;
};

// ---- Coordinator ----------------------------------------------------------------------------

class Coordinator {
 public:
  Coordinator(int n, const std::string& policy, const std::optional<std::string>& bind,
              const std::optional<std::string>& token, const Hosts& host_of, int group_size,
              int c_thres, bool inter_intra, const py::int_& seed, int heartbeat_ms,
              int dead_ms, int join_ms, int partner_wait_ms, int max_isolated, int period_max,
              bool standby, const std::optional<std::vector<std::optional<std::string>>>& names) {
    rpl_coord_config cfg{};
    fillPolicy(cfg.gg, policy, n, host_of, group_size, c_thres, inter_intra, seed,
               partner_wait_ms, max_isolated, period_max);
    std::vector<const char*> name_ptrs; // into names; the coordinator copies them
    if (names) {
      if (static_cast<int64_t>(names->size()) != n)
        throw py::value_error("host_names has " + std::to_string(names->size()) +
                              " entries, expected " + std::to_string(n));
      for (const auto& s : *names) name_ptrs.push_back(s ? s->c_str() : nullptr);
      cfg.host_names = name_ptrs.data();
    }
    cfg.bind = bind ? bind->c_str() : nullptr;
    cfg.token_hex = token ? token->c_str() : nullptr;
    cfg.heartbeat_ms = heartbeat_ms;
    cfg.dead_ms = dead_ms;
    cfg.join_ms = join_ms;
    cfg.standby = standby ? 1 : 0;
    callReleased([&](rpl_error* e) { return rpl_coord_create(&cfg, c_.out(), e); });
  }
  void start() {
    rpl_error err;
    check(rpl_coord_start(ready(), &err), err);
  }
  void run() {
    rpl_coord* c = ready();
    callReleased([&](rpl_error* e) { return rpl_coord_run(c, e); });
  }
  void stop() {
    if (!c_.open()) return;
    rpl_coord* c = c_.get();
    py::gil_scoped_release nogil;
    rpl_coord_stop(c);
  }
  void close() { c_.close(); }
  std::string endpoint() const { return rpl_coord_endpoint(ready()); }
  std::string token() const { return rpl_coord_token(ready()); }
  int activeWorkers(int except_rank) const {
    return rpl_coord_active_workers(ready(), except_rank);
  }

  py::dict counters() const {
    rpl_coord_counters s;
    rpl_coord_get_counters(ready(), &s);
    py::dict d;
    PUT(messages); PUT(malformed); PUT(bad_token); PUT(errors_sent); PUT(dead_declared);
    PUT(send_failures); PUT(wrong_route); PUT(replayed); PUT(rebinds); PUT(bad_token_quiet);
    PUT(challenges); PUT(bad_session); PUT(connections_dropped);
    PUT(probes_withheld);
    return d;
  }

 private:
  rpl_coord* ready() const { return c_.get(); }
  Owned<rpl_coord, rpl_coord_destroy> c_{"Coordinator is closed"};
};

// ---- Client -------------------------------------------------------------------------------

class Client {
 public:
  Client(const std::string& endpoint, const std::string& token, int rank, int nworkers,
         int host_label, int timeout_ms, int request_timeout_ms, int heartbeat_ms) {
    rpl_gg_client_config cc{};
    cc.endpoint = endpoint.c_str();
    cc.token_hex = token.c_str();
    cc.rank = rank;
    cc.nworkers = nworkers;
    cc.host_label = host_label;
    cc.timeout_ms = timeout_ms;
    cc.request_timeout_ms = request_timeout_ms;
    cc.heartbeat_ms = heartbeat_ms;
    callReleased([&](rpl_error* e) { return rpl_gg_client_create(&cc, cl_.out(), e); });
    members_.resize(nworkers > 0 ? nworkers : 0);
  }
  py::tuple request(const py::int_& round_obj) {
    rpl_gg_client* cl = ready();
    uint64_t round = u64(round_obj);
    int n = 0;
    uint64_t gid = 0;
    int cap = static_cast<int>(members_.size());
    callReleased([&](rpl_error* e) {
      return rpl_gg_client_request(cl, round, members_.data(), cap, &n, &gid, e);
    });
    return py::make_tuple(gid, intList(members_.data(), n));
  }
  void done(const py::int_& gid, unsigned int status) {
    rpl_error err;
    check(rpl_gg_client_done(ready(), u64(gid), status, &err), err);
  }
  // fence, unfence: a message that does not wait for the coordinator.
  void post(rpl_status (*fn)(rpl_gg_client*, rpl_error*)) {
    rpl_error err;
    check(fn(ready(), &err), err);
  }
  void leave() {
    rpl_gg_client* cl = ready();
    callReleased([&](rpl_error* e) { return rpl_gg_client_leave(cl, e); });
  }
  void close() { cl_.close(); }
  py::dict stats() const {
    rpl_gg_client_stats s;
    rpl_gg_client_get_stats(ready(), &s);
    py::dict d;
    PUT(requests); PUT(cancels); PUT(heartbeats_sent); PUT(heartbeats_acked); PUT(wait_s);
    PUT(heartbeat_ms); PUT(dead_ms);
    PUT(passes); PUT(period); PUT(failovers);
    return d;
  }

 private:
  rpl_gg_client* ready() const { return cl_.get(); }
  Owned<rpl_gg_client, rpl_gg_client_destroy> cl_{"Client is closed"};
  std::vector<int> members_; // request's member buffer, one slot per worker
};

// ---- module functions -----------------------------------------------------------------------

std::string status(const std::string& endpoint, const std::string& token, int timeout_ms,
                   int rank) {
  char* json = nullptr;
  const char *ep = endpoint.c_str(), *tok = token.c_str();
  callReleased([&](rpl_error* e) {
    return rank < 0 ? rpl_gg_query_status(ep, tok, timeout_ms, &json, e)
                    : rpl_gg_query_rank_status(ep, tok, rank, timeout_ms, &json, e);
  });
  std::string s(json);
  std::free(json);
  return s;
}

std::string statusTable(const std::string& json) {
  char* table = nullptr;
  rpl_error err;
  check(rpl_coord_status_table(json.c_str(), json.size(), &table, &err), err);
  std::string s(table);
  std::free(table);
  return s;
}

std::string generateToken() {
  uint8_t tok[RPL_TOKEN_LEN];
  char hex[2 * RPL_TOKEN_LEN + 1];
  rpl_error err;
  check(rpl_token_generate(tok, &err), err);
  rpl_token_to_hex(tok, hex);
  return hex;
}

// The ripples-coordinator command (coordinator/cli.c) on this thread; argv[0] is the program.
int cliMain(const std::vector<std::string>& args) {
  std::vector<std::string> copy(args); // argv is char **: give it writable strings
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  py::gil_scoped_release nogil; // serves until SIGINT/SIGTERM
  return rpl_coord_cli_main(static_cast<int>(copy.size()), argv.data());
}

#undef PUT

// The module's functions: the static schedule, status queries, tokens, the command line.
void bindFunctions(py::module_& m) {
  m.def("static_round", &staticRound, py::arg("nworkers"), py::arg("host_of"), py::arg("round"),
        "static_round(nworkers, host_of, round) -> list of groups (sorted lists), a partition");
  m.def("status", &status, py::arg("endpoint"), py::arg("token"), py::arg("timeout_ms") = 5000,
        py::arg("rank") = -1,
        "status(endpoint, token, timeout_ms=5000, rank=-1) -> JSON text of a running "
        "coordinator: its whole status document, or with rank >= 0 that rank's summary (its "
        "step and slowdown, the slowest ranks), from the first coordinator of a "
        "comma-separated endpoint list that serves the rank");
  m.def("status_table", &statusTable, py::arg("json"),
        "status_table(json) -> the status document as the table ripples-coordinator --status "
        "prints");
  m.def("generate_token", &generateToken, "a fresh job token (32 hex digits)");
  m.def("cli_main", &cliMain, py::arg("argv"),
        "cli_main(argv) -> exit status: the ripples-coordinator command line "
        "(coordinator/cli.c) run on this thread, argv[0] being the program name; serves until "
        "SIGINT/SIGTERM, whose handlers it replaces for the run");
}

// fillPolicy's knobs as Python spells them (keyword, default), written once for both classes
// that take them: GroupGenerator and Coordinator. Each takes them in two runs, the
// Coordinator's own timings between (the positional order is the API, so it stays).
#define POLICY_DOC_HEAD "host_of=None, group_size=0, c_thres=0, inter_intra=False, seed=0, "
#define POLICY_DOC_TAIL "partner_wait_ms=0, max_isolated=0, period_max=0"
#define POLICY_ARGS_HEAD                                                                 \
  py::arg("host_of") = py::none(), py::arg("group_size") = 0, py::arg("c_thres") = 0,   \
      py::arg("inter_intra") = false, py::arg("seed") = 0
#define POLICY_ARGS_TAIL \
  py::arg("partner_wait_ms") = 0, py::arg("max_isolated") = 0, py::arg("period_max") = 0

void bindPolicy(py::module_& m) {
  py::class_<GroupGenerator>(
      m, "GroupGenerator",
      "GroupGenerator(policy, nworkers, " POLICY_DOC_HEAD POLICY_DOC_TAIL "): the policy "
      "state machine, no I/O (advance() moves its clock; the adaptive period needs it). "
      "period_max: 0 = default (DEFAULT_PERIOD_MAX), 1 or negative = average at every request.")
      .def(py::init<const std::string&, int, const Hosts&, int, int, bool, const py::int_&, int,
                    int, int>(),
           py::arg("policy"), py::arg("nworkers"), POLICY_ARGS_HEAD, POLICY_ARGS_TAIL)
      .def("request", &GroupGenerator::request, "request(worker, round): ask for a group")
      .def("done", &GroupGenerator::done, "done(worker, group_id)")
      .def("fence", [](GroupGenerator& g, int w) { g.workerOp(rpl_gg_fence, w); },
           "fence(worker)")
      .def("unfence", [](GroupGenerator& g, int w) { g.workerOp(rpl_gg_unfence, w); },
           "unfence(worker)")
      .def("leave", [](GroupGenerator& g, int w) { g.workerOp(rpl_gg_leave, w); },
           "leave(worker)")
      .def("dead", [](GroupGenerator& g, int w) { g.workerOp(rpl_gg_dead, w); }, "dead(worker)")
      .def("poll", &GroupGenerator::poll,
           "poll() -> [('group', worker, gid, round, members, period) | ('pass', worker, round, "
           "period) | ('cancel', worker, gid, round, culprit, reason)]: 'pass' = the adaptive "
           "period answered the request with no group (a no-op round: ask again for the next "
           "round, no done); period = the adaptive period when answered (1 = every request "
           "averages)")
      .def("stats", &GroupGenerator::stats,
           "counters as a dict (passes, period_drops, period: the adaptive period now; "
           "period_max: its effective bound)")
      .def("worker", &GroupGenerator::worker,
           "worker(w) -> dict (passes: requests passed; step: its compute step in seconds of "
           "the GG's clock, 0 = unknown)")
      .def("advance", &GroupGenerator::advance,
           "advance(now_s) -> next deadline or None: move the clock, end waits for partners");
}

void bindCoordinator(py::module_& m) {
  py::class_<Coordinator>(
      m, "Coordinator",
      "Coordinator(nworkers, policy='smart', bind=None, token=None, " POLICY_DOC_HEAD
      "heartbeat_ms=0, dead_ms=0, join_ms=0, " POLICY_DOC_TAIL ", standby=False, "
      "host_names=None): the Group Generator service (bound at construction; period_max: the "
      "adaptive period, see GroupGenerator; standby: a failover coordinator, every worker out "
      "until it registers; host_names: each rank's host name, for the status and the "
      "slow-worker lines it writes on stderr).")
      .def(py::init<int, const std::string&, const std::optional<std::string>&,
                    const std::optional<std::string>&, const Hosts&, int, int, bool,
                    const py::int_&, int, int, int, int, int, int, bool,
                    const std::optional<std::vector<std::optional<std::string>>>&>(),
           py::arg("nworkers"), py::arg("policy") = "smart", py::arg("bind") = py::none(),
           py::arg("token") = py::none(), POLICY_ARGS_HEAD, py::arg("heartbeat_ms") = 0,
           py::arg("dead_ms") = 0, py::arg("join_ms") = 0, POLICY_ARGS_TAIL,
           py::arg("standby") = false, py::arg("host_names") = py::none())
      .def("active_workers", &Coordinator::activeWorkers, py::arg("except_rank") = -1,
           "active_workers(except_rank=-1): workers neither left nor dead")
      .def("start", &Coordinator::start, "serve on a background thread")
      .def("run", &Coordinator::run, "serve on this thread until stop()")
      .def("stop", &Coordinator::stop, "stop serving (joins the thread)")
      .def("close", &Coordinator::close, "stop and free")
      .def("counters", &Coordinator::counters, "service counters")
      .def_property_readonly("endpoint", &Coordinator::endpoint, "endpoint clients connect to")
      .def_property_readonly("token", &Coordinator::token, "job token (hex)");
}

#undef POLICY_DOC_HEAD
#undef POLICY_DOC_TAIL
#undef POLICY_ARGS_HEAD
#undef POLICY_ARGS_TAIL

void bindClient(py::module_& m) {
  py::class_<Client>(
      m, "Client",
      "Client(endpoint, token, rank, nworkers, host_label=-1, timeout_ms=0, "
      "request_timeout_ms=0, heartbeat_ms=0): a worker's connection to the coordinator.")
      .def(py::init<const std::string&, const std::string&, int, int, int, int, int, int>(),
           py::arg("endpoint"), py::arg("token"), py::arg("rank"), py::arg("nworkers"),
           py::arg("host_label") = -1, py::arg("timeout_ms") = 0,
           py::arg("request_timeout_ms") = 0, py::arg("heartbeat_ms") = 0)
      .def("request", &Client::request,
           "request(round) -> (group_id, members); blocks until the group is formed. group_id "
           "0: the coordinator's adaptive period passed the round (members = [rank]; no done to "
           "send)")
      .def("done", &Client::done, py::arg("group_id"), py::arg("status") = 0u,
           "done(group_id, status=0)")
      .def("fence", [](Client& c) { c.post(rpl_gg_client_fence); }, "fence()")
      .def("unfence", [](Client& c) { c.post(rpl_gg_client_unfence); }, "unfence()")
      .def("leave", &Client::leave, "leave() and wait for the ack")
      .def("close", &Client::close, "stop heartbeats, close sockets")
      .def("stats", &Client::stats,
           "client counters (passes: rounds passed; period: the adaptive period in the last "
           "answer, 0 before the first; failovers: registrations after a lost coordinator)");
}

} // namespace

void bindGroupGenerator(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "gg", "Group Generator: policies, coordinator and client (ripples_pg.backend._gg re-exports it).");
  bindFunctions(m);
  bindPolicy(m);
  bindCoordinator(m);
  bindClient(m);
  m.attr("DEFAULT_GROUP_SIZE") = RPL_GG_DEFAULT_GROUP_SIZE;
  m.attr("DEFAULT_C_THRES") = RPL_GG_DEFAULT_C_THRES;
  m.attr("STATIC_PERIOD") = RPL_STATIC_PERIOD;
  m.attr("DEFAULT_PERIOD_MAX") = RPL_GG_DEFAULT_PERIOD_MAX;
  m.attr("MAX_PERIOD") = RPL_GG_MAX_PERIOD;
  m.attr("PROTOCOL_VERSION") = RPL_PROTO_VERSION;
  m.attr("POLICIES") = py::make_tuple("static", "random", "smart", "adpsgd");
}

} // namespace ripples
