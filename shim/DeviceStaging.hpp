// DeviceStaging: device (CUDA) tensors through pinned host memory, with stream semantics.
//
// The core reads and writes host memory only. A call on device tensors is staged:
//   1. on the caller's thread, the group's side stream waits for the caller's current stream
//      (an event, never a device sync) and copies every input into pinned host memory
//      (non_blocking); an event marks the end of those copies ("staged");
//   2. the group's staging thread ("rpl-stage", see StagedSubmitter) waits for that event off
//      the caller's thread and only then hands the operation to the core, in issue order;
//   3. on completion the executor copies results back on the side stream (non_blocking) and
//      records "done"; Work.wait() makes the caller's current stream wait for "done", and the
//      future, created with the device, records its own event on the side stream.
// The caching allocator is told about every use of a device tensor on the side stream, so a
// tensor the caller frees early is not reused under a copy still in flight.
//
// Only torch's device-generic API is used (c10::Event, c10::Stream, the device guard
// interface), so the same build runs on CPU-only and CUDA builds of torch; nothing here needs
// the CUDA toolkit. For tests on machines without a GPU, RIPPLES_DEBUG_STAGE_CPU sends CPU
// tensors through the same path (plain host copies, no streams), so that everything but the
// stream calls is exercised: "1" every call, "alternate" every other call of a group (staged
// and direct calls then interleave, as CPU and CUDA calls do on one group).
//
// Pipelined staging (Config::stage_chunk_bytes > 0; Call.cpp cuts the call): an exact
// all-reduce or broadcast larger than one chunk becomes one core operation per chunk (a
// non-contiguous tensor in it is copied whole, before the first chunk and after the last).
// Step 1 then copies chunk by chunk, recording one event per chunk; the
// staging thread submits chunk k as soon as its event fired (the copies of k+1 overlap the
// transfer of k); each chunk's completion hands its copy back to the staging thread (post()),
// which issues it on the side stream at once (overlapping the transfer of the chunks after
// it) and only then counts the chunk as finished, so "done" is recorded after every copy.
// The chunks are ordinary core operations: every rank must cut them the same way (the core's
// per-operation size check fails a call whose ranks differ).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

// Whether a CPU call is staged anyway (RIPPLES_DEBUG_STAGE_CPU, read once); `n` counts the
// group's calls.
bool debugStageCpu(uint64_t n);

// A piece of a pipelined call: `host` and `dev` are flat views of the same elements of a host
// staging tensor and the user's (contiguous) tensor.
struct ChunkCopy {
  at::Tensor host;
  at::Tensor dev;
  bool read = true;   // copied into host memory before the chunk runs
  bool write = true;  // copied back once it completed
};

// The staging of one call. Created on the caller's thread by begin(); afterwards used by the
// staging thread (staged, chunkStaged, and copyBack of pipelined chunks) and the completion
// executor (copyBack, markDone), one at a time.
class DeviceStage {
 public:
  // `side` is the group's side stream for `device`; ignored (may be nullopt) for CPU.
  DeviceStage(c10::Device device, std::optional<c10::Stream> side);

  const c10::Device& device() const {
    return device_;
  }
  bool hasStreams() const {
    return side_.has_value();
  }
  const std::optional<c10::Stream>& side() const {
    return side_;
  }

  // A contiguous host tensor (pinned for devices) shaped like `t`; with `copy`, filled from `t`
  // on the side stream.
  at::Tensor toHost(const at::Tensor& t, bool copy);
  // Fills `host` from `dev` (same shape; `host` from toHost) on the side stream.
  void copyIn(const at::Tensor& host, const at::Tensor& dev);
  // Records "staged" on the side stream: after the last toHost of the call.
  void markStaged();
  // Pipelined calls: records the event of the next chunk, after its copyIn()s.
  void markChunkStaged();
  // Whether the staging copies (of the whole call / of chunk k) are done. Never blocks: the
  // staging thread polls, so that a wedged device or a shutdown cannot hold it.
  bool staged() const;
  bool chunkStaged(size_t k) const;
  // Copies a host result back into the user's device tensor on the side stream.
  void copyBack(const at::Tensor& host, const at::Tensor& dst);
  // Records "done" on the side stream: after the last copyBack.
  void markDone();
  // Makes the calling thread's current stream of the device wait for "done".
  void blockCurrentStream() const;

 private:
  void recordUse(const at::Tensor& t);  // the allocator must not reuse t before the side stream

  c10::Device device_;
  std::optional<c10::Stream> side_;
  std::optional<c10::Event> staged_;
  std::optional<c10::Event> done_;
  std::vector<c10::Event> chunkStaged_;  // filled before the call reaches the staging thread
};

// One side stream per device index, created on first use (the group's, so that its calls are
// ordered on the device as they are in the core).
class SideStreams {
 public:
  std::optional<c10::Stream> get(const c10::Device& device);

 private:
  std::mutex mu_;
  std::vector<std::pair<c10::DeviceIndex, c10::Stream>> streams_;
};

// The group's staging thread: hands operations to the core in issue order, each only once its
// staging copies are done. Operations without staging go through it too while any staged one
// is queued (the core must see them in order); otherwise they are submitted directly.
class StagedSubmitter {
 public:
  // kDevice: the device reported an error while its copies were polled (a fault of an
  // earlier kernel, say); the message says which.
  enum class Failure { kStopped, kTimeout, kDevice };
  static rpl_status statusOf(Failure why) {
    return why == Failure::kTimeout ? RPL_ERR_TIMEOUT
        : why == Failure::kDevice   ? RPL_ERR_SYSTEM
                                    : RPL_ERR_CLOSED;
  }
  struct Item {
    DeviceStage* stage = nullptr;    // nullptr: nothing to wait for
    // Pipelined calls: the number of chunks. Chunk k goes to the core through submitPart(k)
    // once stage->chunkStaged(k); submit() follows the last. 0: the whole call at once.
    size_t parts = 0;
    // Hands chunk k to the core; false if the core refused it (the rest are then dropped,
    // their failure recorded by submitPart itself). Never throws.
    std::function<bool(size_t)> submitPart;
    std::function<void()> submit;    // hands the operation to the core; never throws
    // Completes it with an error instead: the parts from `from` on never reach the core (0
    // for a whole call). Never throws.
    std::function<void(Failure, const std::string&, size_t from)> fail;
  };

  explicit StagedSubmitter(double timeout_s);
  ~StagedSubmitter();  // stops and joins; the owner must outlive what `submit` touches
  StagedSubmitter(const StagedSubmitter&) = delete;
  StagedSubmitter& operator=(const StagedSubmitter&) = delete;

  // Both called with the group's submit lock held, so the order of calls is the issue order.
  // idle(): nothing is queued or being submitted, so a call without staging may go to the
  // core directly (one atomic load: the path of every host call). enqueue(): the thread
  // submits the operation after those queued before it (or fails it once stopped).
  bool idle() const {
    return queued_.load(std::memory_order_acquire) == 0;
  }
  void enqueue(Item item);
  // Runs `task` on the staging thread soon (between waits; not ordered with the queue). For
  // the chunks of pipelined calls, whose copies back it issues; called from the core's
  // progress thread, so it only queues. False once stopping: the caller deals with it.
  bool post(std::function<void()> task);
  // Stops the thread: queued operations not yet submitted fail (kStopped, `why`). With join,
  // waits for it.
  void stop(const std::string& why, bool join);

 private:
  void loop();
  // Waits until ready() or the deadline, running posted tasks meanwhile. False on timeout,
  // once stopping (*stopping says so) or if ready() threw (*error holds its message: an
  // exception must not end this thread, and the process with it).
  bool waitUntil(
      const std::function<bool()>& ready,
      std::chrono::steady_clock::time_point deadline,
      bool* stopping,
      std::string* error);
  void runTasks();

  double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;  // an item or a task arrived, or stopping
  std::deque<Item> queue_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<size_t> queued_{0};  // queue_.size(), readable without mu_
  bool stopping_ = false;
  std::string stopWhy_;
  std::thread thread_;
};

}  // namespace ripples
