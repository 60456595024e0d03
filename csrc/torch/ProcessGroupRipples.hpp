// ProcessGroupRipples: the c10d::Backend named "ripples".
//
// A thin shim over the C core (csrc/ripples.h): every collective validates its arguments,
// turns tensors into rpl_buf (pointer, count, dtype) — staging non-contiguous tensors through
// contiguous temporaries — and calls rpl_submit. The core completes each operation on its
// progress thread; the shim's completion executor (below) then copies staged results back and
// completes the Work and its future. CUDA tensors are staged through pinned host memory with
// stream semantics (DeviceStaging.hpp); their operations reach the core through the group's
// staging thread once the copies are done.
//
// Completion and threading (why it cannot deadlock):
//   * on_done (core progress thread) only records the status and pushes the operation onto
//     the executor's queue. It never runs user code and never takes a lock that user code holds.
//   * Executor threads ("rpl-complete") pop operations in completion order. Each operation
//     holds a ticket (its per-group sequence number): the thread waits for the previous
//     operation's ticket, copies staged outputs back into the user's tensors, marks the future
//     completed (or sets its error); the future's FIRST callback — registered by the shim before
//     the future is handed out — finishes the Work and passes the ticket on. Only then do the
//     user's .then callbacks run, still on that thread, and they may block (PowerSGD waits on
//     later collectives of the same group inside them).
//   * Nothing between taking a ticket and passing it on can block on user code or on a later
//     operation, so the ticket chain always advances (induction on the sequence number).
//   * Finished operations wait in the queue by ticket; a thread takes only the one whose turn
//     it is, so operations finishing out of order (receives overtaking an earlier receive)
//     hold no thread while they wait. Whenever that operation is there and no thread is idle,
//     another thread is started (bounded by kMaxCompletionThreads). A callback blocked on a
//     later operation therefore never starves that operation of a thread. Deadlock would need
//     kMaxCompletionThreads callbacks blocked at once, each on a later operation of the same
//     group; even then Work.wait() gives up at the timeout bound with an error instead of
//     hanging.
//   * Futures are never completed while the shim holds one of its locks.
//
// Lifetime: shutdown() (destroy_process_group) shuts the core communicator down — queued
// operations fail with a "shut down" error — and stops the completion threads, waiting (with
// the GIL released) a bounded time for them. The destructor never waits for a thread that may
// need the GIL: completion threads are detached and own the executor state by shared_ptr.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "DeviceStaging.hpp"
#include "ripples.h"

// Hidden: nothing here is part of the extension's ABI (and pybind11's own types are hidden, so
// classes bound with it should be too).
namespace ripples __attribute__((visibility("hidden"))) {

constexpr int kMaxCompletionThreads = 32;

// Configuration handed over by the Python creator (ripples_pg/_backend.py), already resolved
// from Options and the environment.
struct Config {
  double timeout_s = 1800.0;  // per operation; > 0
  std::string bind_addr;      // IPv4 address; empty = core default (127.0.0.1)
  std::string name;           // short label for messages and thread names
  size_t small_bytes = 0;     // 0 = core default
  size_t chunk_bytes = 0;     // 0 = core default
  std::string host_key;       // ranks with equal keys share memory; empty = this machine
  bool tcp_only = false;      // never use shared memory
  bool use_ucx = false;       // UCX instead of TCP across hosts
  bool single_copy = false;   // large all-reduces read local peers' memory directly
  bool inline_small = true;   // small collectives run on the caller's thread when idle
  std::string job_secret;     // keys link authentication (never printed); empty = store salt only

  // Partial all-reduce (DESIGN §3). An empty schedule leaves it off for this group.
  std::string schedule;       // "static", "random", "smart", "adpsgd"
  std::vector<int> host_of;   // dense host index of every group rank
  std::string endpoint;       // coordinator (dynamic schedules)
  std::string token;          // the job's coordinator token
  bool on_failure_skip = false;
  bool trace = false;
  bool partial_by_default = false;  // Options(partial=True): no context manager needed
};

// How allreduce calls issued by the current thread treat partial mode: follow the group's
// setting, force a partial round, or force an exact reduction (ripples_pg.partial()/exact()).
enum class PartialMode : int { kGroupDefault = 0, kPartial = 1, kExact = 2 };
// Sets the calling thread's mode and returns the previous one.
PartialMode setThreadPartialMode(PartialMode mode);
// The fence domain shared by every ripples group of this process.
rpl_domain* processFenceDomain();

class CompletionExecutor;

// "torch.float32"-style names, the way users write them.
std::string pyDtypeName(at::ScalarType st);
// The core's dtype for a torch dtype; false if the core has none.
bool toRplDtype(at::ScalarType st, rpl_dtype* out);
struct OpContext;

// State shared by a process group, its works and its in-flight operations. Works and
// operations keep it alive by shared_ptr; it never refers back to the process group.
struct GroupShared {
  std::string name;  // "ripples process group '<name>' (rank r of n)"
  int rank = 0;
  int size = 1;
  double timeout_s = 1800.0;
  // steady_clock nanoseconds at which the core last completed an operation of this group;
  // operations run one at a time in order, so this is when the oldest pending one started.
  std::atomic<int64_t> last_done_ns{0};
};

class WorkRipples : public c10d::Work {
 public:
  WorkRipples(
      int rank,
      c10d::OpType opType,
      const char* profilingTitle,
      std::string opName,
      std::vector<at::Tensor> outputs,
      std::shared_ptr<GroupShared> group,
      std::chrono::milliseconds opTimeout,
      uint64_t seq,
      c10::Device device,
      std::shared_ptr<DeviceStage> stage,
      const std::optional<std::vector<at::Tensor>>& profiled);
  ~WorkRipples() override;

  // For device tensors, returns once the result is complete on the host side and the caller's
  // current stream has been made to wait for the copies back (no device sync).
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override {
    return seq_;
  }
  // The sender of a recv: known at once for recv(src), once complete for recvAnysource.
  int sourceRank() const override;
  void setSourceRank(int rank) {
    source_.store(rank);
  }

  // Used by the completion executor.
  const std::string& opName() const {
    return opName_;
  }
  const std::vector<at::Tensor>& outputs() const {
    return outputs_;
  }
  void finishFromExecutor(std::exception_ptr eptr) {
    finish(std::move(eptr));
  }

 private:
  std::string opName_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::shared_ptr<GroupShared> group_;
  std::chrono::steady_clock::time_point submitted_;
  std::chrono::milliseconds opTimeout_;
  uint64_t seq_;
  std::shared_ptr<DeviceStage> stage_;  // null for host tensors
  std::atomic<int> source_{-1};         // recv only
};

// One accepted call: the buffers handed to the core, the temporaries they point at, what to
// copy back, and the Work to complete. Owned by the core (via on_done's arg) until completion.
struct OpContext {
  c10::intrusive_ptr<WorkRipples> work;
  std::shared_ptr<CompletionExecutor> executor;
  std::shared_ptr<GroupShared> group;
  std::vector<at::Tensor> keepAlive;  // every tensor a buffer points into
  std::vector<std::pair<at::Tensor, at::Tensor>> copyBack;  // (contiguous source, user dest)
  std::vector<rpl_buf> in;
  std::vector<rpl_buf> out;
  std::vector<rpl_op_desc> descs;  // kept for a submission deferred to the staging thread
  std::shared_ptr<DeviceStage> stage;  // device tensors (or RIPPLES_DEBUG_STAGE_CPU); else null
  // A call may be several core operations (allgather_into_tensor_coalesced). `pending` is the
  // number of outstanding ones plus one for the submitting thread.
  std::atomic<int> pending{1};
  std::mutex errMu;
  rpl_status status = RPL_OK;
  std::string errMsg;
  uint64_t seq = 0;
  int source = -1;  // recvAnysource: the sender, written by the core before on_done

  void recordError(rpl_status st, const std::string& msg);
};

class CompletionExecutor : public std::enable_shared_from_this<CompletionExecutor> {
 public:
  explicit CompletionExecutor(std::string label);
  ~CompletionExecutor();

  void start();  // spawns the first thread
  // Called from on_done (core thread) when every core operation of `ctx` has finished.
  void push(OpContext* ctx);
  // Stops accepting work once the queue drains; wakes idle threads. With wait_s > 0, waits at
  // most that long for every thread to exit (never waits for the calling thread itself).
  void stop(double wait_s);
  // Called by the future's first callback: the op with sequence `seq` is complete.
  void advanceTicket(uint64_t seq);
  // Whether every operation before `seq` has completed its future (the latency path may then
  // complete `seq` on the caller's thread without overtaking one).
  bool caughtUp(uint64_t seq);
  // Completes an operation that ran inline, on the calling thread (as a worker would).
  void completeHere(OpContext* ctx);

  static bool onCompletionThread();

 private:
  void workerLoop();
  void process(OpContext* ctx);
  void spawnLocked(std::unique_lock<std::mutex>& lk);
  bool runnableLocked() const {  // the operation whose turn it is has finished
    return !queue_.empty() && queue_.begin()->first == ticket_;
  }
  void wakeLocked(std::unique_lock<std::mutex>& lk);

  std::string label_;
  std::mutex mu_;
  std::condition_variable cv_;        // queue non-empty or stopping
  std::condition_variable ticketCv_;  // ticket advanced
  std::condition_variable exitCv_;    // a thread exited
  // Finished operations waiting for a thread, by ticket. A thread takes only the one whose
  // turn it is: operations that finished early (p2p receives overtaking an earlier one) wait
  // here without holding a thread, so they can never use up the threads the earlier one needs.
  std::map<uint64_t, OpContext*> queue_;
  int threads_ = 0;
  int idle_ = 0;
  bool stopping_ = false;
  uint64_t ticket_ = 0;  // sequence number allowed to complete next
};

class ProcessGroupRipples : public c10d::Backend {
 public:
  ProcessGroupRipples(
      const c10::intrusive_ptr<c10d::Store>& store,
      int rank,
      int size,
      Config cfg);
  ~ProcessGroupRipples() override;

  const std::string getBackendName() const override {
    return "ripples";
  }

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts =
          c10d::AllreduceCoalescedOptions()) override;

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputTensors,
      std::vector<at::Tensor>& inputTensors,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& outputBuffer,
      at::Tensor& inputBuffer,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputTensorLists,
      std::vector<at::Tensor>& inputTensors,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputTensors,
      std::vector<at::Tensor>& inputTensors,
      const c10d::GatherOptions& opts = c10d::GatherOptions()) override;

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputTensors,
      std::vector<std::vector<at::Tensor>>& inputTensors,
      const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputTensors,
      std::vector<std::vector<at::Tensor>>& inputTensors,
      const c10d::ReduceScatterOptions& opts =
          c10d::ReduceScatterOptions()) override;

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& outputBuffer,
      at::Tensor& inputBuffer,
      const c10d::ReduceScatterOptions& opts =
          c10d::ReduceScatterOptions()) override;

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& outputBuffer,
      at::Tensor& inputBuffer,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputTensors,
      std::vector<at::Tensor>& inputTensors,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;

  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dstRank,
      int tag) override;

  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int srcRank,
      int tag) override;

  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override;

  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;

  // Sequence numbers (used by torch's ProcessGroupWrapper under TORCH_DISTRIBUTED_DEBUG=DETAIL):
  // every rank starts at 0 when the group is created (groups are created collectively) and
  // counts the collectives (not send/recv) it issued.
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override {
    return collSeq_.load();
  }

  void shutdown() override;
  void abort() override;

  // Extras for the Python side (stats, tests).
  bool isShutdown() const {
    return shutdown_.load();
  }
  rpl_comm_counters counters() const;
  std::string listenAddress() const;
  uint64_t stagedCalls() const {
    return staged_.load();
  }
  rpl_partial_stats partialStats() const;
  std::vector<rpl_trace_entry> trace(uint64_t from) const;
  const Config& config() const {
    return cfg_;
  }

 private:
  struct Call;  // a call being built: context + work, see the .cpp

  // `device`: where every tensor of the call lives (callDevice()); device tensors are staged.
  // A Work with no core operation: it completes in order with the others, holding `outputs`
  // (for calls whose work was done on the caller's thread).
  c10::intrusive_ptr<c10d::Work> completedWork(
      c10d::OpType opType,
      const char* profilingTitle,
      const char* opName,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds opTimeout);
  // SUM of sparse COO tensors (SparseAllreduce.cpp); blocks until the result is in place.
  c10::intrusive_ptr<c10d::Work> sparseAllreduce(
      at::Tensor& tensor,
      const c10d::AllreduceOptions& opts);
  // `profiled`: the tensors whose shapes the profiler records (default: the outputs).
  Call begin(
      c10d::OpType opType,
      const char* profilingTitle,
      const char* opName,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds opTimeout,
      c10::Device device,
      std::optional<std::vector<at::Tensor>> profiled = std::nullopt);
  // Submits the core operations of `call` (one per descriptor) and returns its Work.
  c10::intrusive_ptr<c10d::Work> submit(Call& call, std::vector<rpl_op_desc> descs);
  // The latency path: runs the single core op of `ctx` on this thread if the core is idle and
  // every earlier future has completed; false if it was not run (or *st says why it failed).
  // Called with submitMu_ held.
  bool runInline(OpContext* ctx, rpl_status* st, std::string* msg);
  // Hands the operations of `ctx` to the core; called with submitMu_ held. Returns how many
  // were accepted; on a refusal fills `st`/`msg` and drops the refused ones from `pending`.
  int submitToCore(OpContext* ctx, rpl_status* st, std::string* msg);
  // Completes `ctx` with an error without it reaching the core (the staging thread's path).
  void failUnsubmitted(OpContext* ctx, rpl_status st, const std::string& msg);
  void checkOpen(const char* opName) const;
  // RPL_OP_PARTIAL_ALLREDUCE when this call should be a partial round, else RPL_OP_ALLREDUCE.
  rpl_op_kind allreduceKind() const;

  Config cfg_;
  std::shared_ptr<GroupShared> group_;
  std::shared_ptr<CompletionExecutor> executor_;
  rpl_comm* comm_ = nullptr;
  std::mutex submitMu_;  // sequence numbers follow the core's submission order
  uint64_t nextSeq_ = 0;
  std::atomic<uint64_t> collSeq_{0};
  std::atomic<bool> shutdown_{false};
  std::mutex shutdownMu_;
  SideStreams sideStreams_;
  std::atomic<uint64_t> calls_{0};   // for RIPPLES_DEBUG_STAGE_CPU=alternate
  std::atomic<uint64_t> staged_{0};  // calls staged through host memory
  std::unique_ptr<StagedSubmitter> stager_;  // joined before comm_ is destroyed
};

// Creates the backend; blocks until every rank of the group has called it.
c10::intrusive_ptr<ProcessGroupRipples> createProcessGroupRipples(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Config& cfg);

}  // namespace ripples
