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
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace ripples __attribute__((visibility("hidden"))) {

// Whether a CPU call is staged anyway (RIPPLES_DEBUG_STAGE_CPU, read once); `n` counts the
// group's calls.
bool debugStageCpu(uint64_t n);

// The staging of one call. Created on the caller's thread by begin(); afterwards used by the
// staging thread (waitStaged) and the completion executor (copyBack, markDone), one at a time.
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
  // Records "staged" on the side stream: after the last toHost of the call.
  void markStaged();
  // Blocks (not on the caller's thread) until the staging copies are done, at most
  // `timeout_s`, or until `abandon()` returns true. Returns false on timeout/abandon.
  bool waitStaged(double timeout_s, const std::function<bool()>& abandon);
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
  enum class Failure { kStopped, kTimeout };
  struct Item {
    DeviceStage* stage = nullptr;    // nullptr: nothing to wait for
    std::function<void()> submit;    // hands the operation to the core; never throws
    // Completes it with an error instead; never throws.
    std::function<void(Failure, const std::string&)> fail;
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
  // Stops the thread: queued operations not yet submitted fail (kStopped, `why`). With join,
  // waits for it.
  void stop(const std::string& why, bool join);

 private:
  void loop();

  double timeout_s_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::atomic<size_t> queued_{0};  // queue_.size(), readable without mu_
  bool stopping_ = false;
  std::string stopWhy_;
  std::thread thread_;
};

}  // namespace ripples
