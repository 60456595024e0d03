// ProcessGroupRipples: see ProcessGroupRipples.hpp. The backend's lifecycle (creation,
// shutdown, stats) and its entry points: each checks its arguments with TensorArgs and makes
// one call to the Submitter's post() (Submitter.hpp) with the core operation and a function
// that stages its tensors. No communication algorithm lives here.
#include <Python.h>  // only to release the GIL around blocking waits, when it is held

#include "ProcessGroupRipples.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "Errors.hpp"
#include "StoreAdapter.hpp"
#include "TensorArgs.hpp"

namespace ripples {

namespace {

// Releases the GIL for its scope if (and only if) this thread holds it. Used where torch may
// call us with or without the GIL (shutdown), so that threads that need the GIL to finish
// (a Python .then callback on a completion thread) can run while we wait for them.
class GilRelease {
 public:
  GilRelease() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      state_ = PyEval_SaveThread();
    }
  }
  ~GilRelease() {
    if (state_ != nullptr) {
      PyEval_RestoreThread(state_);
    }
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

thread_local PartialMode tlsPartialMode = PartialMode::kGroupDefault;

}  // namespace

// ---- lifecycle ---------------------------------------------------------------------------------

ProcessGroupRipples::ProcessGroupRipples(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    Config cfg)
    : Backend(rank, size), cfg_(std::move(cfg)) {
  TORCH_CHECK_VALUE(size >= 1, "ripples: process group size must be >= 1, got ", size);
  TORCH_CHECK_VALUE(
      rank >= 0 && rank < size, "ripples: rank ", rank, " is out of range for size ", size);
  checkConfig(cfg_, size);
  TORCH_CHECK_VALUE(store.defined(), "ripples: the process group needs a c10d store");

  group_ = std::make_shared<GroupShared>();
  group_->rank = rank;
  group_->size = size;
  group_->timeout_s = cfg_.timeout_s;
  group_->name = c10::str(
      "ripples process group '", cfg_.name.empty() ? std::string("?") : cfg_.name,
      "' (rank ", rank, " of ", size, ")");
  group_->last_done_ns.store(nowNs());

  createComm(store);
  executor_ = std::make_shared<CompletionExecutor>(group_->name);
  executor_->start();
  submitter_ = std::make_unique<Submitter>(cfg_, comm_, group_, executor_);
  init();
}

// The core communicator, with partial rounds when the group has a schedule.
void ProcessGroupRipples::createComm(const c10::intrusive_ptr<c10d::Store>& store) {
  const rpl_comm_config cc = commConfig(cfg_, group_->rank, group_->size);
  StoreAdapter adapter(store);
  const rpl_store rs = adapter.view();

  rpl_error err;
  std::memset(&err, 0, sizeof(err));
  rpl_status st = rpl_comm_create(&cc, &rs, &comm_, &err);
  if (st != RPL_OK) {
    comm_ = nullptr;
    throwStatus(
        st,
        c10::str(
            "ripples: could not create ", group_->name, ": ", err.msg, " (",
            rpl_status_name(st), ")"));
  }
  if (cfg_.schedule.empty()) {
    return;
  }
  const rpl_partial_config pc = partialConfig(cfg_, processFenceDomain());
  st = rpl_comm_enable_partial(comm_, &pc, &err);
  if (st != RPL_OK) {
    rpl_comm_destroy(comm_);
    comm_ = nullptr;
    throwStatus(
        st,
        c10::str(
            "ripples: could not enable the '", cfg_.schedule, "' schedule on ",
            group_->name, ": ", err.msg, " (", rpl_status_name(st), ")"));
  }
}

ProcessGroupRipples::~ProcessGroupRipples() {
  // May run with the GIL held (torch's Python holder): never wait here for a thread that may
  // need it. The core's progress thread never does; completion threads are detached.
  submitter_->close();
  // Never needs the GIL; gives up waiting for device copies once stopped.
  submitter_->stopStaging("shut down before its device copies finished");
  if (comm_ != nullptr) {
    rpl_comm_destroy(comm_);  // shuts down if needed, joins the progress thread
    comm_ = nullptr;
  }
  if (executor_) {
    executor_->stop(0);
  }
}

void ProcessGroupRipples::shutdown() {
  if (comm_ != nullptr && !submitter_->isClosed()) {
    // Graceful (destroy_process_group, interpreter exit): a partial round still in flight --
    // an overlapped one at the end of a training loop -- has members exchanging with this
    // worker; it finishes first, within its timeout (at most kSettleMaxS). abort() does not wait.
    GilRelease nogil;
    rpl_comm_settle_partial(comm_, std::min(cfg_.timeout_s, kSettleMaxS));
  }
  shutdownNow();
}

void ProcessGroupRipples::shutdownNow() {
  std::lock_guard<std::mutex> g(shutdownMu_);
  if (!submitter_->close()) {
    return;
  }
  GilRelease nogil;
  if (comm_ != nullptr) {
    // Queued operations complete with RPL_ERR_CLOSED; one running inline on a caller's thread
    // (in the middle of a hand-off) is interrupted. A submission racing with this is refused.
    rpl_comm_shutdown(comm_);
  }
  submitter_->waitForHandoffs();  // an inline one returns once interrupted
  submitter_->stopStaging("shut down before its device copies finished");
  if (executor_) {
    executor_->stop(std::min(30.0, std::max(1.0, cfg_.timeout_s)));
  }
}

void ProcessGroupRipples::abort() {
  shutdownNow();
}

std::string ProcessGroupRipples::listenAddress() const {
  char buf[96] = "";
  if (comm_ != nullptr) rpl_comm_listen_address(comm_, buf, sizeof(buf));
  return buf;
}

rpl_comm_counters ProcessGroupRipples::counters() const {
  rpl_comm_counters c;
  std::memset(&c, 0, sizeof(c));
  if (comm_ != nullptr) {
    rpl_comm_get_counters(comm_, &c);
  }
  return c;
}

std::vector<std::string> ProcessGroupRipples::peerPaths() const {
  std::vector<std::string> out;
  if (comm_ == nullptr) return out;
  for (int p = 0; p < getSize(); p++) {
    const char* path = rpl_comm_peer_path(comm_, p);
    out.emplace_back(path != nullptr ? path : "");
  }
  return out;
}

rpl_partial_stats ProcessGroupRipples::partialStats() const {
  rpl_partial_stats s;
  std::memset(&s, 0, sizeof(s));
  if (comm_ != nullptr) {
    rpl_comm_partial_stats(comm_, &s);
  }
  return s;
}

std::vector<rpl_trace_entry> ProcessGroupRipples::trace(uint64_t from) const {
  std::vector<rpl_trace_entry> out;
  if (comm_ == nullptr) {
    return out;
  }
  std::vector<rpl_trace_entry> chunk(1024);
  for (;;) {
    size_t n = rpl_comm_trace(comm_, from, chunk.data(), chunk.size());
    out.insert(out.end(), chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(n));
    if (n < chunk.size()) {
      return out;
    }
    from += n;
  }
}

bool ProcessGroupRipples::lastRound(rpl_round_outcome* out, std::vector<int>* members) const {
  if (comm_ == nullptr) {
    return false;
  }
  members->assign(static_cast<size_t>(getSize()), 0);
  if (rpl_comm_partial_last(comm_, out, members->data(), getSize()) == 0) {
    return false;
  }
  members->resize(static_cast<size_t>(std::min(out->nmembers, getSize())));
  return true;
}

int ProcessGroupRipples::roundGroup(uint64_t round, double timeoutS, rpl_round_outcome* out,
                                    std::vector<int>* members) const {
  if (comm_ == nullptr) {
    return 0;
  }
  members->assign(static_cast<size_t>(getSize()), 0);
  int rc = rpl_comm_partial_group(comm_, round, timeoutS, out, members->data(), getSize());
  members->resize(rc == 1 ? static_cast<size_t>(std::min(out->nmembers, getSize())) : 0);
  return rc;
}

void ProcessGroupRipples::giveGroup(const std::vector<int>& members, uint64_t groupId) {
  checkOpen("give_group");
  // Past the group's size the core refuses by count, before reading any member.
  const int n = static_cast<int>(std::min<size_t>(members.size(), INT_MAX));
  rpl_error err;
  rpl_status st = rpl_comm_partial_give(comm_, members.data(), n, groupId, &err);
  if (st != RPL_OK) {
    throwRefused(group_->name, "give_group", st, err.msg);
  }
}

void ProcessGroupRipples::expectGroup() {
  checkOpen("expect_group");
  rpl_error err;
  rpl_status st = rpl_comm_partial_expect(comm_, &err);
  if (st != RPL_OK) {
    throwRefused(group_->name, "expect_group", st, err.msg);
  }
}

void ProcessGroupRipples::fenceAlone() {
  checkOpen("fence_alone");
  rpl_error err;
  rpl_status st = rpl_comm_fence_alone(comm_, &err);
  if (st != RPL_OK) {
    throwRefused(group_->name, "fence_alone", st, err.msg);
  }
}

rpl_domain* processFenceDomain() {
  // One per process, on purpose: an exact collective on any ripples group must fence the
  // dynamic schedules of all of them (docs/design.md §3). It lives as long as the process.
  static rpl_domain* domain = [] {
    rpl_domain* d = nullptr;
    rpl_error err;
    TORCH_CHECK(rpl_domain_create(&d, &err) == RPL_OK, "ripples: ", err.msg);
    return d;
  }();
  return domain;
}

PartialMode setThreadPartialMode(PartialMode mode) {
  PartialMode prev = tlsPartialMode;
  tlsPartialMode = mode;
  return prev;
}

// Only what the caller asked for: whether a partial round may run is decided once, by the core
// (rpl_partial_eligible: floating SUM/AVG buffers), which runs any other exactly and counts it
// in exact_fallbacks.
rpl_op_kind ProcessGroupRipples::requestedAllreduceKind() const {
  if (cfg_.schedule.empty() || tlsPartialMode == PartialMode::kExact) {
    return RPL_OP_ALLREDUCE;
  }
  bool partial = tlsPartialMode == PartialMode::kPartial || cfg_.partial_by_default;
  return partial ? RPL_OP_PARTIAL_ALLREDUCE : RPL_OP_ALLREDUCE;
}

// ---- entry points ------------------------------------------------------------------------------

namespace {
// `n` equal consecutive shares of `t`'s elements (the caller has checked that they divide).
std::vector<size_t> equalShares(const at::Tensor& t, int n) {
  return std::vector<size_t>(n, static_cast<size_t>(t.numel()) / n);
}

// The "into tensor" collectives: `whole` holds one `part` per rank of a group of `size`.
// Returns their dtype. `partSide`, `wholeSide`: "input", "output".
rpl_dtype checkPartsOf(
    const at::Tensor& part,
    const char* partSide,
    const at::Tensor& whole,
    const char* wholeSide,
    int size,
    const char* opName) {
  const std::string partWhat = std::string("the ") + partSide + " tensor";
  const std::string wholeWhat = std::string("the ") + wholeSide + " tensor";
  const rpl_dtype d = checkTensor(part, opName, partWhat);
  checkTensor(whole, opName, wholeWhat);
  checkSameDtype(whole, part, opName, wholeWhat, partWhat);
  checkNumel(
      whole, part.numel() * size, opName, wholeWhat,
      std::string("group size x ") + partSide + " elements");
  return d;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  static const Entry e{c10d::OpType::BROADCAST, "ripples:broadcast", "broadcast"};
  checkOpen(e.name);
  TORCH_CHECK_VALUE(!tensors.empty(), "ripples broadcast: no tensor given");
  checkRank(opts.rootRank, size_, e.name, "root rank");
  TORCH_CHECK_VALUE(
      opts.rootTensor >= 0 && opts.rootTensor < static_cast<int64_t>(tensors.size()),
      "ripples broadcast: rootTensor ", opts.rootTensor, " is out of range for ",
      tensors.size(), " tensor(s)");
  const at::Tensor& src = tensors[opts.rootTensor];
  const rpl_dtype d = checkTensor(src, e.name, "tensor");
  checkAllLike(tensors, src, e.name, "tensors", "the root tensor");
  rpl_op_desc desc = makeDesc(RPL_OP_BROADCAST);
  desc.root = static_cast<int>(opts.rootRank);
  return submitter_->post(e, opts.timeout, tensors, {tensors}, {desc}, [&](Call& c) {
    const at::Tensor buf = c.inout(src, d, "tensor");
    // Legacy multi-tensor form (as gloo): the other local tensors receive the root tensor too.
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (static_cast<int64_t>(i) != opts.rootTensor) {
        c.copyTo(buf, tensors[i], "tensors" + ordinal(i));
      }
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  static const Entry e{c10d::OpType::ALLREDUCE, "ripples:all_reduce", "allreduce"};
  checkOpen(e.name);
  TORCH_CHECK_VALUE(
      tensors.size() == 1,
      "ripples allreduce: expects exactly one tensor, got ", tensors.size(),
      " (use allreduce_coalesced / all_reduce_coalesced for several tensors)");
  TORCH_CHECK_VALUE(
      !opts.sparseIndices.has_value(),
      "ripples allreduce: AllreduceOptions.sparseIndices is not supported (a sparse COO "
      "tensor is)");
  if (tensors[0].defined() && tensors[0].is_sparse()) {
    return sparseAllreduce(tensors[0], opts);
  }
  const rpl_dtype d = checkTensor(tensors[0], e.name, "tensor");
  rpl_op_desc desc = makeDesc(requestedAllreduceKind());
  desc.redop = toRplRedop(opts.reduceOp, d, e.name);
  return submitter_->post(e, opts.timeout, tensors, {tensors}, {desc},
                          [&](Call& c) { c.inout(tensors[0], d, "tensor"); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  static const Entry e{
      c10d::OpType::ALLREDUCE_COALESCED, "ripples:all_reduce", "allreduce_coalesced"};
  checkOpen(e.name);
  TORCH_CHECK_VALUE(!tensors.empty(), "ripples allreduce_coalesced: no tensors given");
  TORCH_CHECK_VALUE(
      tensors.size() <= static_cast<size_t>(INT32_MAX),
      "ripples allreduce_coalesced: too many tensors");
  std::vector<rpl_dtype> dts(tensors.size());
  rpl_op_desc desc = makeDesc(requestedAllreduceKind());
  for (size_t i = 0; i < tensors.size(); ++i) {
    dts[i] = checkTensor(tensors[i], e.name, "tensors" + ordinal(i));
    desc.redop = toRplRedop(opts.reduceOp, dts[i], e.name);
  }
  return submitter_->post(e, opts.timeout, tensors, {tensors}, {desc}, [&](Call& c) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      c.inout(tensors[i], dts[i], "tensors" + ordinal(i));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  static const Entry e{c10d::OpType::REDUCE, "ripples:reduce", "reduce"};
  checkOpen(e.name);
  TORCH_CHECK_VALUE(
      tensors.size() == 1, "ripples reduce: expects exactly one tensor, got ", tensors.size());
  TORCH_CHECK_VALUE(
      opts.rootTensor == 0, "ripples reduce: rootTensor must be 0, got ", opts.rootTensor);
  checkRank(opts.rootRank, size_, e.name, "root rank");
  const rpl_dtype d = checkTensor(tensors[0], e.name, "tensor");
  rpl_op_desc desc = makeDesc(RPL_OP_REDUCE);
  desc.redop = toRplRedop(opts.reduceOp, d, e.name);
  desc.root = static_cast<int>(opts.rootRank);
  return submitter_->post(e, opts.timeout, tensors, {tensors}, {desc},
                          [&](Call& c) { c.inout(tensors[0], d, "tensor"); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allgather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  static const Entry e{c10d::OpType::ALLGATHER, "ripples:all_gather", "allgather"};
  const char* op = e.name;
  checkOpen(op);
  checkListSize(inputTensors.size(), 1, op, "the input list", "one tensor per process");
  checkListSize(outputTensors.size(), 1, op, "the output list of lists", "one list per process");
  const std::vector<at::Tensor>& outs = outputTensors[0];
  checkListSize(outs.size(), size_, op, "the output list", "one tensor per rank of the group");
  const at::Tensor& input = inputTensors[0];
  const rpl_dtype d = checkTensor(input, op, "the input tensor");
  checkAllLike(outs, input, op, "output", "the input tensor");
  return submitter_->post(
      e, opts.timeout, outs, {inputTensors, outs}, {makeDesc(RPL_OP_ALLGATHER)},
      [&](Call& c) {
        c.in(input, d);
        for (size_t i = 0; i < outs.size(); ++i) {
          c.out(outs[i], d, "output" + ordinal(i));
        }
      },
      inputTensors);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::_allgather_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::AllgatherOptions& opts) {
  static const Entry e{
      c10d::OpType::_ALLGATHER_BASE, "ripples:_allgather_base", "allgather_into_tensor"};
  checkOpen(e.name);
  const rpl_dtype d = checkPartsOf(inputBuffer, "input", outputBuffer, "output", size_, e.name);
  return submitter_->post(
      e, opts.timeout, {outputBuffer}, {inputBuffer, outputBuffer}, {makeDesc(RPL_OP_ALLGATHER)},
      [&](Call& c) {
        c.in(inputBuffer, d);
        c.outSlices(outputBuffer, d, equalShares(outputBuffer, size_), "the output tensor");
      });
}

// output_lists[r][j] receives rank r's inputs[j]: one core allgather per input tensor, all
// in one call (shapes and dtypes may differ between the inputs, as in gloo).
c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  static const Entry e{
      c10d::OpType::ALLGATHER_COALESCED, "ripples:all_gather", "allgather_coalesced"};
  const char* op = e.name;
  checkOpen(op);
  checkListSize(outputLists.size(), size_, op, "the output list of lists",
                "one list per rank of the group");
  std::vector<rpl_dtype> dts(inputs.size());
  for (size_t j = 0; j < inputs.size(); ++j) {
    dts[j] = checkTensor(inputs[j], op, "inputs" + ordinal(j));
  }
  std::vector<at::Tensor> flat;
  for (size_t r = 0; r < outputLists.size(); ++r) {
    const std::string list = "output_lists" + ordinal(r);
    checkListSize(outputLists[r].size(), inputs.size(), op, list, "one tensor per input");
    for (size_t j = 0; j < inputs.size(); ++j) {
      checkLike(outputLists[r][j], inputs[j], op, list + ordinal(j), "inputs" + ordinal(j));
      flat.push_back(outputLists[r][j]);
    }
  }
  return submitter_->post(
      e, opts.timeout, flat, {inputs, flat},
      std::vector<rpl_op_desc>(inputs.size(), makeDesc(RPL_OP_ALLGATHER)),
      [&](Call& c) {
        for (size_t j = 0; j < inputs.size(); ++j) {
          c.in(inputs[j], dts[j]);
          for (int r = 0; r < size_; ++r) {
            c.out(outputLists[r][j], dts[j], "output_lists" + ordinal(r) + ordinal(j));
          }
        }
      },
      inputs);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  static const Entry e{
      c10d::OpType::COALESCED, "ripples:allgather_into_tensor_coalesced",
      "allgather_into_tensor_coalesced"};
  const char* op = e.name;
  checkOpen(op);
  checkListSize(outputs.size(), inputs.size(), op, "the output list", "one per input tensor");
  std::vector<rpl_dtype> dts(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    dts[i] = checkTensor(inputs[i], op, "inputs" + ordinal(i));
    checkTensor(outputs[i], op, "outputs" + ordinal(i));
    checkSameDtype(outputs[i], inputs[i], op, "outputs" + ordinal(i), "inputs" + ordinal(i));
    checkNumel(
        outputs[i], inputs[i].numel() * size_, op, "outputs" + ordinal(i),
        "group size x elements of inputs" + ordinal(i));
  }
  // One core allgather per pair: inputs[i] into the size_ slices of outputs[i].
  return submitter_->post(
      e, opts.timeout, outputs, {inputs, outputs},
      std::vector<rpl_op_desc>(inputs.size(), makeDesc(RPL_OP_ALLGATHER)), [&](Call& c) {
        for (size_t i = 0; i < inputs.size(); ++i) {
          c.in(inputs[i], dts[i]);
          c.outSlices(outputs[i], dts[i], equalShares(outputs[i], size_), "outputs" + ordinal(i));
        }
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::gather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::GatherOptions& opts) {
  static const Entry e{c10d::OpType::GATHER, "ripples:gather", "gather"};
  checkOpen(e.name);
  const RootedList rl = checkRootedList(
      e.name, opts.rootRank, rank_, size_, inputTensors, "input", outputTensors, "output",
      "gather_list");
  const std::vector<at::Tensor>& outs = rl.tensors;
  rpl_op_desc desc = makeDesc(RPL_OP_GATHER);
  desc.root = static_cast<int>(opts.rootRank);
  return submitter_->post(e, opts.timeout, outs, {inputTensors, outs}, {desc}, [&](Call& c) {
    c.in(inputTensors[0], rl.dtype);
    for (size_t i = 0; i < outs.size(); ++i) {
      c.out(outs[i], rl.dtype, "gather_list" + ordinal(i));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ScatterOptions& opts) {
  static const Entry e{c10d::OpType::SCATTER, "ripples:scatter", "scatter"};
  checkOpen(e.name);
  const RootedList rl = checkRootedList(
      e.name, opts.rootRank, rank_, size_, outputTensors, "output", inputTensors, "input",
      "scatter_list");
  const std::vector<at::Tensor>& ins = rl.tensors;
  rpl_op_desc desc = makeDesc(RPL_OP_SCATTER);
  desc.root = static_cast<int>(opts.rootRank);
  return submitter_->post(
      e, opts.timeout, outputTensors, {outputTensors, ins}, {desc}, [&](Call& c) {
        for (const at::Tensor& t : ins) {
          c.in(t, rl.dtype);
        }
        c.out(outputTensors[0], rl.dtype, "the output tensor");
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::reduce_scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ReduceScatterOptions& opts) {
  static const Entry e{c10d::OpType::REDUCE_SCATTER, "ripples:reduce_scatter", "reduce_scatter"};
  const char* op = e.name;
  checkOpen(op);
  checkListSize(outputTensors.size(), 1, op, "the output list", "one tensor per process");
  checkListSize(inputTensors.size(), 1, op, "the input list of lists", "one list per process");
  const at::Tensor& output = outputTensors[0];
  const std::vector<at::Tensor>& ins = inputTensors[0];
  checkListSize(ins.size(), size_, op, "the input list", "one tensor per rank of the group");
  const rpl_dtype d = checkTensor(output, op, "the output tensor");
  checkAllLike(ins, output, op, "input", "the output tensor");
  rpl_op_desc desc = makeDesc(RPL_OP_REDUCE_SCATTER);
  desc.redop = toRplRedop(opts.reduceOp, d, op);
  return submitter_->post(
      e, opts.timeout, outputTensors, {outputTensors, ins}, {desc}, [&](Call& c) {
        for (const at::Tensor& t : ins) {
          c.in(t, d);
        }
        c.out(output, d, "the output tensor");
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::_reduce_scatter_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::ReduceScatterOptions& opts) {
  static const Entry e{
      c10d::OpType::_REDUCE_SCATTER_BASE, "ripples:_reduce_scatter_base", "reduce_scatter_tensor"};
  checkOpen(e.name);
  const rpl_dtype d = checkPartsOf(outputBuffer, "output", inputBuffer, "input", size_, e.name);
  rpl_op_desc desc = makeDesc(RPL_OP_REDUCE_SCATTER);
  desc.redop = toRplRedop(opts.reduceOp, d, e.name);
  return submitter_->post(
      e, opts.timeout, {outputBuffer}, {inputBuffer, outputBuffer}, {desc}, [&](Call& c) {
        c.inSlices(inputBuffer, d, equalShares(inputBuffer, size_));
        c.out(outputBuffer, d, "the output tensor");
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::alltoall_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  static const Entry e{c10d::OpType::ALLTOALL_BASE, "ripples:all_to_all", "all_to_all_single"};
  const char* op = e.name;
  checkOpen(op);
  const rpl_dtype d = checkTensor(inputBuffer, op, "the input tensor");
  checkTensor(outputBuffer, op, "the output tensor");
  checkSameDtype(outputBuffer, inputBuffer, op, "the output tensor", "the input tensor");
  const std::vector<size_t> inCounts =
      splitCounts(inputBuffer, inputSplitSizes, size_, op, "input");
  const std::vector<size_t> outCounts =
      splitCounts(outputBuffer, outputSplitSizes, size_, op, "output");
  return submitter_->post(
      e, opts.timeout, {outputBuffer}, {inputBuffer, outputBuffer}, {makeDesc(RPL_OP_ALLTOALL)},
      [&](Call& c) {
        c.inSlices(inputBuffer, d, inCounts);
        c.outSlices(outputBuffer, d, outCounts, "the output tensor");
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::alltoall(
    std::vector<at::Tensor>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllToAllOptions& opts) {
  static const Entry e{c10d::OpType::ALLTOALL, "ripples:all_to_all", "all_to_all"};
  const char* op = e.name;
  checkOpen(op);
  checkListSize(inputTensors.size(), size_, op, "the input list", "one tensor per rank");
  checkListSize(outputTensors.size(), size_, op, "the output list", "one tensor per rank");
  const rpl_dtype d = checkTensor(inputTensors[0], op, "input" + ordinal(0));
  for (int i = 0; i < size_; ++i) {
    checkTensor(inputTensors[i], op, "input" + ordinal(i));
    checkTensor(outputTensors[i], op, "output" + ordinal(i));
    checkSameDtype(inputTensors[i], inputTensors[0], op, "input" + ordinal(i), "input[0]");
    checkSameDtype(outputTensors[i], inputTensors[0], op, "output" + ordinal(i), "input[0]");
  }
  return submitter_->post(
      e, opts.timeout, outputTensors, {inputTensors, outputTensors}, {makeDesc(RPL_OP_ALLTOALL)},
      [&](Call& c) {
        for (int i = 0; i < size_; ++i) {
          c.in(inputTensors[i], d);
          c.out(outputTensors[i], d, "output" + ordinal(i));
        }
      });
}

// ---- point to point ----------------------------------------------------------------------------

namespace {
// send and recv take one tensor and a peer: another rank of the group, or any rank (`anySource`,
// recvAnysource). Returns the core operation, and the tensor's dtype in *d.
rpl_op_desc p2pDesc(
    const char* opName,
    rpl_op_kind kind,
    const std::vector<at::Tensor>& tensors,
    bool anySource,
    int peer,
    int tag,
    int rank,
    int size,
    rpl_dtype* d) {
  const bool send = kind == RPL_OP_SEND;
  TORCH_CHECK_VALUE(
      tensors.size() == 1, "ripples ", send ? "send" : "recv",
      ": expects exactly one tensor, got ", tensors.size());
  if (anySource) {
    TORCH_CHECK_VALUE(size > 1, "ripples recv: no other rank to receive from in a group of 1");
  } else {
    checkRank(peer, size, opName, send ? "destination rank" : "source rank");
    TORCH_CHECK_VALUE(
        peer != rank, "ripples ", send ? "send: rank " : "recv: rank ", rank,
        send ? " cannot send to itself" : " cannot receive from itself");
  }
  *d = checkTensor(tensors[0], opName, "tensor");
  rpl_op_desc desc = makeDesc(kind);
  desc.root = anySource ? RPL_ANY_SOURCE : peer;
  desc.tag = tag;
  return desc;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int tag) {
  static const Entry e{c10d::OpType::SEND, "ripples:send", "send"};
  checkOpen(e.name);
  rpl_dtype d;
  const rpl_op_desc desc =
      p2pDesc(e.name, RPL_OP_SEND, tensors, false, dstRank, tag, rank_, size_, &d);
  return submitter_->post(e, std::chrono::milliseconds::zero(), tensors, {tensors}, {desc},
                          [&](Call& c) { c.in(tensors[0], d); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int tag) {
  static const Entry e{c10d::OpType::RECV, "ripples:recv", "recv"};
  checkOpen(e.name);
  rpl_dtype d;
  const rpl_op_desc desc =
      p2pDesc(e.name, RPL_OP_RECV, tensors, false, srcRank, tag, rank_, size_, &d);
  return submitter_->post(
      e, std::chrono::milliseconds::zero(), tensors, {tensors}, {desc}, [&](Call& c) {
        c.out(tensors[0], d, "tensor");
        c.setSource(srcRank);  // known at once
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  static const Entry e{
      c10d::OpType::RECVANYSOURCE, "ripples:recvAnySource", "recv (any source)"};
  checkOpen(e.name);
  rpl_dtype d;
  const rpl_op_desc desc =
      p2pDesc(e.name, RPL_OP_RECV, tensors, true, RPL_ANY_SOURCE, tag, rank_, size_, &d);
  return submitter_->post(
      e, std::chrono::milliseconds::zero(), tensors, {tensors}, {desc}, [&](Call& c) {
        c.out(tensors[0], d, "tensor");
        c.reportSource();  // the core writes the sender
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::barrier(const c10d::BarrierOptions& opts) {
  static const Entry e{c10d::OpType::BARRIER, "ripples:barrier", "barrier"};
  checkOpen(e.name);
  return submitter_->post(e, opts.timeout, {}, {}, {makeDesc(RPL_OP_BARRIER)}, [](Call&) {});
}

c10::intrusive_ptr<ProcessGroupRipples> createProcessGroupRipples(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Config& cfg) {
  return c10::make_intrusive<ProcessGroupRipples>(store, rank, size, cfg);
}

}  // namespace ripples
