// Submitter: the one path from an entry point to the core (as NCCL's ncclInfo goes through
// ncclEnqueueCheck), the same for every entry point.
//
// An entry point checks its arguments (TensorArgs.hpp), then makes one call:
//
//     return submitter_->post(entry, opts.timeout, outputs, {tensors...}, {desc},
//                             [&](Call& c) { c.in(input, d); c.out(output, d, "the output"); });
//
// post() begins a Call (Call.hpp) with its Work, sequence number and device staging,
// lets the entry point stage its tensors, binds each descriptor to its buffers, registers the
// completion, and hands the call to the core: run inline (the latency path), through the
// staging thread (device tensors, and any call issued behind one), or queued.
//
// Owns: the sequence numbers (the collective count torch's debug wrapper reads, and the issue
// order the completion executor follows), whether the group still takes calls, the group's
// device side streams, the staging thread (StagedSubmitter, DeviceStaging.hpp) and the counts
// of staged calls. Borrows from the process group, which owns them: the core communicator —
// destroyed only after stopStaging(), as the staging thread submits to it — and the
// completion executor (shared with every call in flight).
//
// Threads: post() runs on the caller's thread. submitMu_ makes each hand-off one step, so that
// sequence numbers follow the core's submission order; the staging thread takes it too when it
// submits what it held back. The core's progress thread only reports completions (onDone,
// RipplesWork.hpp; a pipelined chunk's, Submitter.cpp).
//
// Errors: invalid arguments and a closed group raise on the caller's thread; so does a call
// the core refuses before any of it was accepted (Errors.hpp, throwRefused). Anything later —
// a refused operation after others were accepted, a staging timeout, a device error, a
// shutdown — completes the Work with that error instead.
#pragma once

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
#include "Call.hpp"
#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

class Submitter {
 public:
  // `comm` and `executor` must be running; `comm` must outlive stopStaging().
  Submitter(
      const Config& cfg,
      rpl_comm* comm,
      std::shared_ptr<GroupShared> group,
      std::shared_ptr<CompletionExecutor> executor);
  Submitter(const Submitter&) = delete;
  Submitter& operator=(const Submitter&) = delete;

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
  // A Work with no core operation: it completes in order with the others, holding `outputs`
  // (for calls whose work was done on the caller's thread).
  c10::intrusive_ptr<c10d::Work> completedWork(
      const Entry& entry,
      std::vector<at::Tensor> outputs,
      std::chrono::milliseconds timeout);

  // Raises the "shut down" error once close() was called.
  void checkOpen(const char* opName) const;
  bool isClosed() const {
    return closed_.load();
  }
  // Refuses every call from now on. False if closed already.
  bool close() {
    return !closed_.exchange(true);
  }
  // Returns once no hand-off is in flight (one running inline returns once the core
  // communicator is shut down).
  void waitForHandoffs() {
    std::lock_guard<std::mutex> g(submitMu_);
  }
  // Stops the staging thread and waits for it: calls it still holds fail with `why`.
  void stopStaging(const std::string& why) {
    stager_.stop(why, true);
  }

  // The collectives issued (not send/recv): every rank starts at 0 with the group.
  uint64_t collectiveSeq() const {
    return collSeq_.load();
  }
  uint64_t stagedCalls() const {
    return staged_.load();
  }
  uint64_t pipelinedCalls() const {
    return pipelined_.load();
  }
  uint64_t stageChunks() const {
    return stageChunks_.load();
  }

 private:
  // How a call left submit()'s lock: through the staging thread (deferred), run here, or
  // `accepted` operations queued in the core (0: refused, firstFail/failMsg say why).
  struct Handoff {
    bool deferred = false;
    bool ranInline = false;
    int accepted = 0;
    rpl_status firstFail = RPL_OK;
    std::string failMsg;
  };

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

  rpl_comm* const comm_;  // the process group's
  const std::shared_ptr<GroupShared> group_;
  const std::shared_ptr<CompletionExecutor> executor_;
  const size_t stageChunkBytes_;  // Config::stage_chunk_bytes
  const bool inlineSmall_;        // Config::inline_small
  std::mutex submitMu_;  // sequence numbers follow the core's submission order
  uint64_t nextSeq_ = 0;
  std::atomic<uint64_t> collSeq_{0};
  std::atomic<bool> closed_{false};
  SideStreams sideStreams_;
  std::atomic<uint64_t> calls_{0};        // for RIPPLES_DEBUG_STAGE_CPU=alternate
  std::atomic<uint64_t> staged_{0};       // calls staged through host memory
  std::atomic<uint64_t> pipelined_{0};    // of those, pipelined in chunks
  std::atomic<uint64_t> stageChunks_{0};  // the core operations (chunks) of those
  // Last, so that it is stopped and joined before anything its items touch is destroyed.
  StagedSubmitter stager_;
};

}  // namespace ripples
