// ProcessGroupRipples: the c10d::Backend named "ripples".
//
// A thin shim over the C core (csrc/ripples.h): every collective validates its arguments,
// turns tensors into rpl_buf (pointer, count, dtype) — staging non-contiguous tensors through
// contiguous temporaries — and calls rpl_submit. The core completes each operation on its
// progress thread; the shim's completion executor (RipplesWork.hpp) then copies staged results
// back and completes the Work and its future. CUDA tensors are staged through pinned host
// memory with stream semantics (DeviceStaging.hpp); their operations reach the core through
// the group's staging thread once the copies are done.
//
// The shim's parts, each in its own file: TensorArgs (argument checks, dtype and ReduceOp
// translation), Submission (the one path every entry point takes to the core), RipplesWork
// (Work, and the completion executor: why completion cannot deadlock), DeviceStaging (device
// tensors), StoreAdapter (the c10d store for the core's rendezvous), Errors (core statuses as
// torch exceptions), SparseAllreduce (sparse COO tensors). This file is the backend itself:
// its lifecycle and its entry points.
//
// Lifetime: shutdown() (destroy_process_group) first lets a partial round in flight finish
// (bounded: its members are exchanging with this worker), then shuts the core communicator
// down — other queued operations fail with a "shut down" error — and stops the completion
// threads, waiting (with the GIL released) a bounded time for them; abort() does not wait. The destructor never waits for a thread that may
// need the GIL: completion threads are detached and own the executor state by shared_ptr.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <c10/util/ArrayRef.h>
#include <c10/util/FunctionRef.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "Config.hpp"
#include "DeviceStaging.hpp"
#include "RipplesWork.hpp"
#include "ripples.h"

// Hidden: nothing here is part of the extension's ABI (and pybind11's own types are hidden, so
// classes bound with it should be too).
namespace ripples __attribute__((visibility("hidden"))) {

// How allreduce calls issued by the current thread treat partial mode: follow the group's
// setting, force a partial round, or force an exact reduction (ripples_pg.partial()/exact()).
enum class PartialMode : int { kGroupDefault = 0, kPartial = 1, kExact = 2 };
// Sets the calling thread's mode and returns the previous one.
PartialMode setThreadPartialMode(PartialMode mode);
// The fence domain shared by every ripples group of this process.
rpl_domain* processFenceDomain();

class Call;   // Submission.hpp
struct Entry;  // Submission.hpp

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
  // Per group rank: what carries this rank's traffic with it now (rpl_comm_peer_path).
  std::vector<std::string> peerPaths() const;
  std::string listenAddress() const;
  uint64_t stagedCalls() const {
    return staged_.load();
  }
  uint64_t pipelinedCalls() const {
    return pipelined_.load();
  }
  uint64_t stageChunks() const {
    return stageChunks_.load();
  }
  rpl_partial_stats partialStats() const;
  std::vector<rpl_trace_entry> trace(uint64_t from) const;
  const Config& config() const {
    return cfg_;
  }

 private:
  // Creates comm_ from cfg_ (constructor); raises as the core's status says.
  void createComm(const c10::intrusive_ptr<c10d::Store>& store);
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

  // ---- the submission path (Submission.hpp, Submission.cpp) ----
  // The one call of every entry point: begins a call on the device of `tensors` (every input
  // and output), lets `stage` put its tensors into core buffers, submits `descs` and returns
  // the Work. `outputs`: what the Work's result and future hold; `profiled`: the tensors whose
  // shapes the profiler records (default: the outputs).
  c10::intrusive_ptr<c10d::Work> post(
      const Entry& entry,
      std::chrono::milliseconds timeout,
      std::vector<at::Tensor> outputs,
      std::initializer_list<c10::ArrayRef<at::Tensor>> tensors,
      std::vector<rpl_op_desc> descs,
      c10::function_ref<void(Call&)> stage,
      std::optional<std::vector<at::Tensor>> profiled = std::nullopt);
  // The Work and context of a call on `device` (device tensors are staged); counts it.
  Call begin(
      const Entry& entry,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds opTimeout,
      c10::Device device,
      std::optional<std::vector<at::Tensor>> profiled);
  // The chunk size `call` (begun, its descriptors set) is pipelined with; 0: not pipelined.
  size_t pipelineChunkBytes(const Call& call) const;
  // Submits the core operations of `call` (its context's descriptors) and returns its Work.
  c10::intrusive_ptr<c10d::Work> submit(Call& call);
  // How a call left submit()'s lock: through the staging thread (deferred), run here, or
  // `accepted` operations queued in the core (0: refused, firstFail/failMsg say why).
  struct Handoff {
    bool deferred = false;
    bool ranInline = false;
    int accepted = 0;
    rpl_status firstFail = RPL_OK;
    std::string failMsg;
  };
  // submit()'s steps: each descriptor's buffers, callback and timeout; the future's first
  // callback; the hand-off (called with submitMu_ held); a refusal raised or the completion.
  void bindDescs(Call& call, bool pipelined);
  void registerCompletion(OpContext* ctx);
  Handoff handOff(OpContext* ctx, bool pipelined);
  void finishSubmit(Call& call, const Handoff& h);
  // The staging thread's item for a pipelined call: its chunks to the core one by one.
  StagedSubmitter::Item pipelinedItem(OpContext* ctx);
  // The staging thread's item for a staged (not pipelined) call: all its operations at once.
  StagedSubmitter::Item stagedItem(OpContext* ctx);
  // The latency path: hands the single core op of `ctx` to rpl_submit_inline, which runs it on
  // this thread when it can (*ranHere) or queues it. Returns 1 if accepted, else 0 with
  // `st`/`msg` saying why. Called with submitMu_ held, every earlier future completed.
  int submitInline(OpContext* ctx, bool* ranHere, rpl_status* st, std::string* msg);
  // Hands the operations of `ctx` to the core; called with submitMu_ held. Returns how many
  // were accepted; on a refusal fills `st`/`msg` and drops the refused ones from `pending`.
  int submitToCore(OpContext* ctx, rpl_status* st, std::string* msg);
  // Completes `ctx` with an error without it reaching the core (the staging thread's path).
  void failUnsubmitted(OpContext* ctx, rpl_status st, const std::string& msg);
  void checkOpen(const char* opName) const;
  // shutdown() without waiting for partial rounds in flight (abort(), and shutdown() after).
  void shutdownNow();
  // The longest a graceful shutdown waits for a partial round in flight (its own timeout, if
  // shorter): past it the round is interrupted, as abort() does at once.
  static constexpr double kSettleMaxS = 60.0;
  // RPL_OP_PARTIAL_ALLREDUCE when this thread (ripples_pg.partial()/exact()) or the group
  // (Options.partial) asks for a partial round, else RPL_OP_ALLREDUCE; the core decides.
  rpl_op_kind requestedAllreduceKind() const;

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
  std::atomic<uint64_t> pipelined_{0};    // of those, pipelined in chunks
  std::atomic<uint64_t> stageChunks_{0};  // the core operations (chunks) of those
  std::unique_ptr<StagedSubmitter> stager_;  // joined before comm_ is destroyed
};

// Creates the backend; blocks until every rank of the group has called it.
c10::intrusive_ptr<ProcessGroupRipples> createProcessGroupRipples(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Config& cfg);

}  // namespace ripples
