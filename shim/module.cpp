// ripples_pg._C: the pybind11 module. Exposes the backend class (a subclass of torch's
// c10d Backend, so torch can register it in a ProcessGroup), its configuration (Config.cpp)
// and the factory the Python creator (ripples_pg/backend/_register.py) calls with a filled Config.
#include <torch/extension.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <utility>
#include <vector>

#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include "CommHook.hpp"
#include "Config.hpp"
#include "Errors.hpp"
#include "GroupGenerator.hpp"
#include "ProcessGroupRipples.hpp"
#include "sched/rpl_sched.h"

namespace py = pybind11;

namespace ripples __attribute__((visibility("hidden"))) {
// ripples_pg._C.Config (Config.cpp; declared here so Config.hpp stays free of pybind11).
void bindConfig(py::module_& m);
}  // namespace ripples

namespace {
// A flat dict from a name/value list (a trace entry), Python seeing the keys in that order.
py::dict dictOf(std::initializer_list<std::pair<const char*, py::object>> items) {
  py::dict d;
  for (const auto& kv : items) {
    d[kv.first] = kv.second;
  }
  return d;
}

// The first n of values (none if n <= 0).
template <typename T>
py::list listOf(const T* values, int n) {
  py::list l;
  for (int i = 0; i < n; ++i) {
    l.append(values[i]);
  }
  return l;
}

using PG = ripples::ProcessGroupRipples;

// Every key is the core's field name (ripples.h, RPL_COMM_COUNTERS), plus what the shim
// knows: each peer's path and its staging counters (SHIM_COUNTERS).
#define SHIM_COUNTERS(X)                                                                     \
  X(paths, pg.peerPaths(),                                                                   \
    "per group rank, what carries this rank's traffic with it now: 'self', 'shm', "          \
    "'shm+single-copy', 'shm-resuming', 'closed', 'dead', 'tcp' or 'ucx'")                   \
  X(ops_staged, pg.submitter().stagedCalls(),                                                \
    "calls on CUDA tensors, staged through pinned host memory")                              \
  X(ops_staged_pipelined, pg.submitter().pipelinedCalls(),                                   \
    "of ops_staged, those staged in chunks (stage_chunk_bytes)")                             \
  X(stage_chunks, pg.submitter().stageChunks(),                                              \
    "the chunks of ops_staged_pipelined, one core operation each")

py::dict countersDict(const PG& pg) {
  rpl_comm_counters c;
  {
    py::gil_scoped_release nogil;  // never holds other Python threads up
    c = pg.counters();
  }
  py::dict d;
#define PUT_(name, doc) d[#name] = py::cast(c.name);
  RPL_COMM_COUNTERS(PUT_)
#undef PUT_
#define PUT_(name, value, doc) d[#name] = py::cast(value);
  SHIM_COUNTERS(PUT_)
#undef PUT_
  return d;
}

// Every key is the core's field name (ripples.h, RPL_PARTIAL_STATS and group_sizes).
py::dict partialStatsDict(const PG& pg) {
  rpl_partial_stats s;
  {
    py::gil_scoped_release nogil;  // never holds other Python threads up
    s = pg.partialStats();
  }
  py::dict d;
#define PUT_(type, name, doc) d[#name] = py::cast(s.name);
  RPL_PARTIAL_STATS(PUT_)
#undef PUT_
  d["group_sizes"] = listOf(s.group_sizes, RPL_HIST_BUCKETS);
  return d;
}

// (key, what it means) of every key of counters() and partial_stats(), in their order: what
// docs/stats.md is generated from (scripts/stats_doc.py).
py::list statsFields() {
  py::list out;
#define ROW_(name, doc) out.append(py::make_tuple("counters", #name, doc));
  RPL_COMM_COUNTERS(ROW_)
#undef ROW_
#define ROW_(name, value, doc) out.append(py::make_tuple("counters", #name, doc));
  SHIM_COUNTERS(ROW_)
#undef ROW_
#define ROW_(type, name, doc) out.append(py::make_tuple("partial_stats", #name, doc));
  RPL_PARTIAL_STATS(ROW_)
#undef ROW_
  out.append(py::make_tuple("partial_stats", "group_sizes",
                            "rounds by group size (index: the size; the last bucket: 16 or "
                            "more)"));
  return out;
}

std::string coordinatorStatus(const PG& pg, int timeout_ms) {
  const ripples::Config& cfg = pg.config();
  TORCH_CHECK(!cfg.endpoint.empty(), "this group has no coordinator (schedule '",
              cfg.schedule, "')");
  char* json = nullptr;
  rpl_error err;
  rpl_status st;
  {
    py::gil_scoped_release nogil;
    st = rpl_gg_query_rank_status(cfg.endpoint.c_str(), cfg.token.c_str(), pg.getRank(),
                                  timeout_ms, &json, &err);
  }
  if (st != RPL_OK) {
    ripples::throwStatus(ripples::StatusUser::kCoordinator, st, err.msg);
  }
  std::string out(json);
  std::free(json);
  return out;
}

py::list traceList(const PG& pg, uint64_t from) {
  py::list out;
  for (const rpl_trace_entry& e : pg.trace(from)) {
    // Only the first RPL_TRACE_MEMBERS members are recorded (nmembers may be larger).
    out.append(dictOf({
        {"round", py::cast(e.round)},
        {"group_id", py::cast(e.group_id)},
        {"status", py::cast(e.status)},
        {"members", listOf(e.members, std::min(e.nmembers, RPL_TRACE_MEMBERS))},
        {"nmembers", py::cast(e.nmembers)},
    }));
  }
  return out;
}

// The last partial round as a dict, or None before the first one.
py::object lastRoundDict(const PG& pg) {
  rpl_round_outcome o;
  std::vector<int> members;
  bool have;
  {
    py::gil_scoped_release nogil;  // never holds other Python threads up
    have = pg.lastRound(&o, &members);
  }
  if (!have) {
    return py::none();
  }
  return dictOf({
      {"round", py::cast(o.round)},
      {"group_id", py::cast(o.group_id)},
      {"members", py::cast(members)},
      {"status", py::cast(o.status)},
      {"moved", py::cast(o.moved != 0)},
      {"given", py::cast(o.given != 0)},
  });
}

// The group of partial round `round` once it is known (before its data moves): a dict, None
// when the round ended without one, TimeoutError past timeout_s.
py::object roundGroupDict(const PG& pg, uint64_t round, double timeoutS) {
  if (!(timeoutS >= 0)) {
    throw py::value_error("round_group: timeout_s must be a number >= 0");
  }
  rpl_round_outcome o;
  std::vector<int> members;
  int rc;
  {
    py::gil_scoped_release nogil;  // blocks until the round has its group
    rc = pg.roundGroup(round, timeoutS, &o, &members);
  }
  if (rc < 0) {
    PyErr_SetString(PyExc_TimeoutError,
                    "round_group: the partial round had no group within timeout_s (not "
                    "started yet, or waiting for its coordinator)");
    throw py::error_already_set();
  }
  if (rc == 0) {
    return py::none();
  }
  return dictOf({
      {"round", py::cast(o.round)},
      {"group_id", py::cast(o.group_id)},
      {"members", py::cast(members)},
      {"given", py::cast(o.given != 0)},
  });
}

// The configuration the group was created with, as read-only properties.
void bindConfigProperties(py::class_<PG, c10::intrusive_ptr<PG>, c10d::Backend>& c) {
  c.def_property_readonly(
       "timeout_s", [](const PG& pg) { return pg.config().timeout_s; },
       "Per-operation timeout of the core communicator, in seconds.")
      .def_property_readonly(
          "bind_addr", [](const PG& pg) { return pg.config().bind_addr; },
          "IPv4 address this rank's peers connect to (empty: the core default, 127.0.0.1).")
      .def_property_readonly("name", [](const PG& pg) { return pg.config().name; })
      .def_property_readonly(
          "schedule", [](const PG& pg) { return pg.config().schedule; },
          "The partial-round schedule of this group ('' if partial rounds are off).")
      .def_property_readonly(
          "partial_by_default", [](const PG& pg) { return pg.config().partial_by_default; })
      .def_property_readonly(
          "compression", [](const PG& pg) { return pg.config().compression; },
          "Partial rounds' wire format across hosts: none, bf16, fp16 or int8.")
      .def_property_readonly(
          "host_of", [](const PG& pg) { return pg.config().host_of; },
          "Dense host index of every rank of the group.");
}

void bindBackend(py::module_& m) {
  py::class_<PG, c10::intrusive_ptr<PG>, c10d::Backend> c(m, "ProcessGroupRipples");
  bindConfigProperties(c);
  c.def_property_readonly(
       "listen_address", [](const PG& pg) { return pg.listenAddress(); },
       "'ADDR:PORT' of the listener this rank's peers connect to.")
      .def_property_readonly("is_shutdown", [](const PG& pg) { return pg.isShutdown(); })
      .def("counters", &countersDict,
           "Counters of the core communicator (operations, bytes, connections) and of the "
           "calls whose tensors were staged through host memory (device tensors).")
      .def("partial_stats", &partialStatsDict,
           "Partial-round counters of this rank (see ripples_pg.stats).")
      .def("coordinator_status", &coordinatorStatus, py::arg("timeout_ms") = 2000,
           "This rank's summary from its coordinator (JSON text: its step and slowdown, the "
           "slowest ranks; coordinator/PROTOCOL.md); blocks up to timeout_ms per endpoint of "
           "the failover list. Raises if none answers. See ripples_pg.stats.")
      .def("trace", &traceList, py::arg("start") = 0,
           "Per-round trace entries from index `start` (needs Options(trace=True)).")
      .def("last_round", &lastRoundDict,
           "This rank's last partial round, traced or not: {round, group_id, members (group "
           "ranks, sorted; all of them), status (0 = done), moved (data moved between "
           "members), given (its group came from give_group)}; None before the first.")
      .def("round_group", &roundGroupDict, py::arg("round"), py::arg("timeout_s"),
           "The group of this rank's partial round number `round` (as last_round()'s "
           "`round`; while no round is queued or running, the next one's number is "
           "partial_stats()['rounds']) as soon as the round has it, before its data moves: "
           "{round, group_id, members, given}, a group of one included. None when that round "
           "ended without a group (last_round() says why) or a later round's is known; "
           "TimeoutError when it has none within timeout_s.")
      .def("give_group", &PG::giveGroup, py::arg("members"), py::arg("group_id"),
           // Takes the core's lock only briefly; no Python object is touched.
           py::call_guard<py::gil_scoped_release>(),
           "Gives this rank's next partial round its group instead of the schedule's: "
           "`members` (group ranks, strictly increasing, this rank among them) and `group_id` "
           "(the same on every member, nonzero for two or more members). No schedule or "
           "coordinator is asked for that round. Raises ValueError for invalid arguments, a "
           "group given earlier that has not had its round, or a round still queued or "
           "running (give once it completed).")
      .def("expect_group", &PG::expectGroup, py::call_guard<py::gil_scoped_release>(),
           "Makes this rank's next partial round wait for the group give_group() gives it, "
           "even when given after the round was submitted (up to the round's deadline, then "
           "the round fails as timed out and a later give is refused), instead of asking its "
           "schedule: the round keeps its place among the group's operations before its group "
           "is known. Raises ValueError while a round is queued or running, or when the next "
           "round already has or expects a given group.")
      .def("fence_alone", &PG::fenceAlone, py::call_guard<py::gil_scoped_release>(),
           "Takes this group out of the process's fence domain: its exact collectives stop "
           "fencing the other ripples groups' dynamic schedules (and theirs stop fencing its "
           "own). Only for a group whose collectives no other group's partial round can wait "
           "for, such as FSDP's shard group under ripples_pg.fsdp. Raises ValueError while an "
           "operation is queued or running on it.");
}


}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ripples_pg C++ shim: the 'ripples' c10d backend over the ripples C core";

  // torch's c10d classes (Backend, Store, Work) must be registered before ours derives
  // from them.
  py::module_::import("torch.distributed");
  ripples::bindConfig(m);
  bindBackend(m);

  m.def("stats_fields", &statsFields,
        "(accessor, key, meaning) of every key of counters() and partial_stats(), from the "
        "core's tables (ripples.h)");
  m.def("has_ucx", []() { return rpl_has_ucx() != 0; },
        "Whether this build has the UCX transport (Options(transport='ucx')).");
  m.def(
      "_set_partial_mode",
      [](int mode) {
        TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, "partial mode must be 0, 1 or 2");
        return static_cast<int>(
            ripples::setThreadPartialMode(static_cast<ripples::PartialMode>(mode)));
      },
      py::arg("mode"),
      "Sets this thread's partial mode (0 group default, 1 partial, 2 exact); returns the "
      "previous one.");
  m.def(
      "_create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const ripples::Config& cfg) {
        return ripples::createProcessGroupRipples(store, rank, size, cfg);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("config"),
      // Blocks until every rank of the group has joined (through the store).
      py::call_guard<py::gil_scoped_release>(),
      "Creates the backend from a filled Config; every rank of the group must call it.");

  m.attr("CORE_VERSION") = py::make_tuple(RPL_VERSION_MAJOR, RPL_VERSION_MINOR);
  m.attr("MAX_COMPLETION_THREADS") = ripples::kMaxCompletionThreads;
  ripples::bindGroupGenerator(m);  // _C.gg: policies, coordinator, client, CLI
  ripples::bindCommHook(m);  // wrap()'s DDP comm hook
}
