// RipplesWork: the Work a ripples call returns, the state of one call in flight (OpContext),
// and the completion executor that finishes calls in issue order.
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
#pragma once

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "DeviceStaging.hpp"
#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

constexpr int kMaxCompletionThreads = 32;

class CompletionExecutor;

// steady_clock now, in nanoseconds.
int64_t nowNs();

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
  // Pipelined staging (DeviceStaging.hpp): descs[k] is chunk k, whose copies are chunks[k];
  // chunkDone[k] is its on_done argument. Empty otherwise.
  struct ChunkDone {
    OpContext* ctx;
    size_t k;
  };
  std::vector<std::vector<ChunkCopy>> chunks;
  std::vector<ChunkDone> chunkDone;
  size_t chunkBytes = 0;  // the chunk size the call was cut with (for messages)
  StagedSubmitter* stager = nullptr;  // issues the chunks' copies back; outlives the core

  bool failed();

  void recordError(rpl_status st, const std::string& msg);
  // `n` outstanding parts are over (finished, or will never run): the last one hands the call
  // to the executor.
  void finishParts(int n);
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

// The core's completion callback (rpl_op_desc.on_done, done_arg = the OpContext). Runs on the
// core's progress thread: records the status, hands the context to the executor once every
// core operation of the call is done, returns. Never throws.
void onDone(void* arg, rpl_status status, const rpl_error* err);

}  // namespace ripples
