// DeviceStaging: see DeviceStaging.hpp for the sequence of copies, events and threads.
#include "DeviceStaging.hpp"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace ripples {

bool debugStageCpu(uint64_t n) {
  static const int mode = [] {  // 0 off, 1 every call, 2 every other call
    const char* v = std::getenv("RIPPLES_DEBUG_STAGE_CPU");
    if (v == nullptr || v[0] == '\0' || std::strcmp(v, "0") == 0) {
      return 0;
    }
    return std::strcmp(v, "alternate") == 0 ? 2 : 1;
  }();
  return mode == 1 || (mode == 2 && n % 2 == 0);
}

// ---- DeviceStage ---------------------------------------------------------------------------

DeviceStage::DeviceStage(c10::Device device, std::optional<c10::Stream> side)
    : device_(device), side_(device.is_cpu() ? std::nullopt : side) {
  if (!side_) {
    return;
  }
  staged_.emplace(device_.type());
  done_.emplace(device_.type());
  // The side stream starts where the caller's current stream is now: inputs the caller just
  // wrote are complete before we copy them.
  c10::impl::VirtualGuardImpl impl(device_.type());
  c10::Event ready(device_.type());
  ready.record(impl.getStream(device_));
  ready.block(*side_);
}

void DeviceStage::recordUse(const at::Tensor& t) {
  if (!side_ || !t.defined() || !t.has_storage()) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  impl.recordDataPtrOnStream(t.storage().data_ptr(), *side_);
}

at::Tensor DeviceStage::toHost(const at::Tensor& t, bool copy) {
  auto opts = t.options().device(c10::kCPU).memory_format(at::MemoryFormat::Contiguous);
  if (side_) {
    opts = opts.pinned_memory(true);
  }
  at::Tensor host = at::empty(t.sizes(), opts);
  if (copy) {
    copyIn(host, t);
  }
  return host;
}

void DeviceStage::copyIn(const at::Tensor& host, const at::Tensor& dev) {
  if (!side_) {
    host.copy_(dev);
    return;
  }
  c10::StreamGuard guard(*side_);
  host.copy_(dev, /*non_blocking=*/true);
  recordUse(dev);
}

void DeviceStage::markStaged() {
  if (side_) {
    staged_->record(*side_);
  }
}

void DeviceStage::markChunkStaged() {
  if (side_) {
    chunkStaged_.emplace_back(device_.type());
    chunkStaged_.back().record(*side_);
  }
}

bool DeviceStage::staged() const {
  return !side_ || staged_->query();
}

bool DeviceStage::chunkStaged(size_t k) const {
  // Without streams the copies ran on the caller's thread, before the call was queued.
  return !side_ || (k < chunkStaged_.size() && chunkStaged_[k].query());
}

void DeviceStage::copyBack(const at::Tensor& host, const at::Tensor& dst) {
  // Runs on the backend's threads, whose grad and inference modes are not the caller's: a
  // parameter, a view of one, or a tensor made under torch.inference_mode() must be written
  // as the caller could (gloo's copies back fail there: pytorch/pytorch#86830).
  c10::InferenceMode writeAnyTensor;
  if (!side_) {
    dst.copy_(host);
    return;
  }
  c10::StreamGuard guard(*side_);
  dst.copy_(host, /*non_blocking=*/true);  // the host allocator keeps `host` until it ran
  recordUse(dst);
}

void DeviceStage::markDone() {
  if (side_) {
    done_->record(*side_);
  }
}

void DeviceStage::blockCurrentStream() const {
  if (!side_) {
    return;
  }
  c10::impl::VirtualGuardImpl impl(device_.type());
  done_->block(impl.getStream(device_));
}

// ---- SideStreams ---------------------------------------------------------------------------

std::optional<c10::Stream> SideStreams::get(const c10::Device& device) {
  if (device.is_cpu()) {
    return std::nullopt;
  }
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& s : streams_) {
    if (s.first == device.index()) {
      return s.second;
    }
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  c10::Stream s = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  streams_.emplace_back(device.index(), s);
  return s;
}

// ---- StagedSubmitter -----------------------------------------------------------------------

StagedSubmitter::StagedSubmitter(double timeout_s) : timeout_s_(timeout_s) {}

StagedSubmitter::~StagedSubmitter() {
  stop("the process group was destroyed", true);
}

void StagedSubmitter::enqueue(Item item) {
  std::lock_guard<std::mutex> g(mu_);
  if (stopping_) {
    item.fail(Failure::kStopped, stopWhy_, 0);
    return;
  }
  if (!thread_.joinable()) {
    thread_ = std::thread([this] { loop(); });  // may throw: before anything is queued
  }
  queue_.push_back(std::move(item));
  queued_.fetch_add(1, std::memory_order_release);
  cv_.notify_one();
}

bool StagedSubmitter::post(std::function<void()> task) {
  std::lock_guard<std::mutex> g(mu_);
  // The thread exits only once stopping with nothing queued, so a task accepted here runs.
  if (stopping_ || !thread_.joinable()) {
    return false;
  }
  tasks_.push_back(std::move(task));
  cv_.notify_one();
  return true;
}

void StagedSubmitter::stop(const std::string& why, bool join) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!stopping_) {
      stopping_ = true;
      stopWhy_ = why;
    }
  }
  cv_.notify_all();
  if (join && thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
    thread_.join();
  }
}

void StagedSubmitter::runTasks() {
  std::deque<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> g(mu_);
    tasks.swap(tasks_);
  }
  for (auto& t : tasks) {
    t();  // never throws (post()'s contract)
  }
}

bool StagedSubmitter::waitUntil(
    const std::function<bool()>& ready,
    std::chrono::steady_clock::time_point deadline,
    bool* stopping,
    std::string* error) {
  // Poll rather than synchronize(): a wedged device or a shutdown must not hold this thread
  // (and every later operation of the group) forever. Short waits first: copies of small
  // tensors finish within microseconds. A posted task (a pipelined chunk's copy back) ends
  // the wait early, so that it is issued at once rather than after the pause.
  auto pause = std::chrono::microseconds(0);
  for (;;) {
    try {
      if (ready()) {
        return true;
      }
    } catch (const c10::Error& e) {
      *error = e.what_without_backtrace();
      return false;
    } catch (const std::exception& e) {
      *error = e.what();
      return false;
    }
    runTasks();
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (stopping_) {
        *stopping = true;
        return false;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return false;
      }
      if (pause.count() > 0) {
        cv_.wait_for(lk, pause, [&] { return !tasks_.empty() || stopping_; });
      }
    }
    if (pause.count() == 0) {
      std::this_thread::yield();
      pause = std::chrono::microseconds(1);
    } else {
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
  }
}

void StagedSubmitter::loop() {
  pthread_setname_np(pthread_self(), "rpl-stage");
  for (;;) {
    Item* item = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return !queue_.empty() || !tasks_.empty() || stopping_; });
      if (queue_.empty() && tasks_.empty()) {
        return;  // stopping, nothing left (post() refuses from now on)
      }
      if (!queue_.empty()) {
        // Stays at the front until it is submitted, so that callers keep queueing behind it.
        item = &queue_.front();
      }
    }
    runTasks();
    if (item == nullptr) {
      continue;
    }
    bool stopping = false;
    std::string deviceError;
    // Capped so that the cast to the clock's integer nanoseconds cannot overflow.
    const auto deadline = std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(std::min(timeout_s_, 1e9)));
    DeviceStage* st = item->stage;
    size_t from = 0;  // the first part not yet handed to the core
    bool ok = true;
    if (item->parts == 0) {
      ok = st == nullptr ||
          waitUntil([st] { return st->staged(); }, deadline, &stopping, &deviceError);
    } else {
      // Chunk by chunk: chunk k runs in the core while the copies of k+1 finish.
      for (; from < item->parts; ++from) {
        const size_t k = from;
        if (!waitUntil(
                [st, k] { return st->chunkStaged(k); }, deadline, &stopping, &deviceError)) {
          ok = false;
          break;
        }
        if (!item->submitPart(k)) {
          break;  // refused: submitPart dropped the rest; submit() still ends the call
        }
      }
    }
    if (ok) {
      item->submit();
    } else if (stopping) {
      item->fail(Failure::kStopped, stopWhy_, from);
    } else if (!deviceError.empty()) {
      item->fail(
          Failure::kDevice,
          "the device reported an error while its tensors were copied into host memory: " +
              deviceError,
          from);
    } else {
      item->fail(
          Failure::kTimeout,
          "the copies of its device tensors into host memory did not finish within the "
          "group's timeout of " + std::to_string(timeout_s_) + " s (is the device stuck?)",
          from);
    }
    std::lock_guard<std::mutex> g(mu_);
    queue_.pop_front();  // deque: `item` stayed valid while others were pushed behind it
    queued_.fetch_sub(1, std::memory_order_release);  // after its submission: order kept
  }
}

}  // namespace ripples
