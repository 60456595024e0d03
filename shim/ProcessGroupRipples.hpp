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
// translation), Submitter (the one path every entry point takes to the core, with its
// sequence numbers and staging thread), Call (what an entry point stages its tensors
// into), RipplesWork (Work, and the completion executor: why completion cannot
// deadlock), DeviceStaging (device tensors), StoreAdapter (the c10d store for the core's
// rendezvous), Errors (core statuses as torch exceptions), SparseAllreduce (sparse COO
// tensors). This file is the backend itself: its lifecycle and its entry points.
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

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "Config.hpp"
#include "RipplesWork.hpp"
#include "Submitter.hpp"
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
    return submitter_->collectiveSeq();
  }

  void shutdown() override;
  void abort() override;

  // Extras for the Python side (stats, tests).
  bool isShutdown() const {
    return submitter_->isClosed();
  }
  rpl_comm_counters counters() const;
  // Per group rank: what carries this rank's traffic with it now (rpl_comm_peer_path).
  std::vector<std::string> peerPaths() const;
  std::string listenAddress() const;
  // The submission path, for its staging counters.
  const Submitter& submitter() const {
    return *submitter_;
  }
  rpl_partial_stats partialStats() const;
  std::vector<rpl_trace_entry> trace(uint64_t from) const;
  // The last partial round's outcome and every one of its members (rpl_comm_partial_last);
  // false before the first round.
  bool lastRound(rpl_round_outcome* out, std::vector<int>* members) const;
  // The group of partial round `round` once known, before its data moves
  // (rpl_comm_partial_group): 1 with it, 0 ended without one, -1 timed out. Blocks.
  int roundGroup(uint64_t round, double timeoutS, rpl_round_outcome* out,
                 std::vector<int>* members) const;
  // Gives the next partial round its group (rpl_comm_partial_give): group ranks, sorted.
  // Raises ValueError for invalid members or id, a group still waiting for its round, or a
  // round still queued or running.
  void giveGroup(const std::vector<int>& members, uint64_t groupId);
  // rpl_comm_partial_expect: the next partial round waits for the group given to it.
  void expectGroup();
  // rpl_comm_fence_alone: this group's exact collectives stop fencing the other groups.
  void fenceAlone();
  const Config& config() const {
    return cfg_;
  }

 private:
  // Creates comm_ from cfg_ (constructor); raises as the core's status says.
  void createComm(const c10::intrusive_ptr<c10d::Store>& store);
  // SUM of sparse COO tensors (SparseAllreduce.cpp); blocks until the result is in place.
  c10::intrusive_ptr<c10d::Work> sparseAllreduce(
      at::Tensor& tensor,
      const c10d::AllreduceOptions& opts);
  void checkOpen(const char* opName) const {
    submitter_->checkOpen(opName);
  }
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
  std::mutex shutdownMu_;
  // Created once comm_ and executor_ run; its staging thread is stopped before comm_ is
  // destroyed.
  std::unique_ptr<Submitter> submitter_;
};

// Creates the backend; blocks until every rank of the group has called it.
c10::intrusive_ptr<ProcessGroupRipples> createProcessGroupRipples(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Config& cfg);

}  // namespace ripples
