// The DDP comm hook wrap() registers: exact steps in C++, the rest in Python.
//
// wrap() stays exact (DDP's gradient all-reduce at every step) until a straggler makes
// partial averaging pay, so an even job spends its whole run in the exact phase. A Python comm
// hook costs every gradient bucket two trips through the interpreter (the hook, and the
// future's `then` callback on the completion thread, each taking the GIL): on a
// communication-bound MLP without a straggler this hook took wrap() from 0.83x to 0.87x
// plain DDP (docs/limitations.md, "Speed"). It runs the exact phase as DDP's own built-in
// all-reduce hook does — the bucket's mean, all-reduced exactly whatever the group's partial
// setting (the core divides, see coreDivides), no Python — and calls the Python hook
// (ripples_pg.hooks.ripples_hook) for every other step.
//
// Who decides: Python. ripples_pg.hooks.RipplesHookState sets the switch's `exact` flag
// whenever the step, the end of warm-up or synchronous mode change (all on the training
// thread, between backward passes); the hook only reads it. `clock` says whether the step is
// timed for the warm-up exit: the hook then records the step's waiting window — from the
// first bucket's post to the last all-reduce's completion, with the training thread's
// run-queue wait at both ends (/proc/self/task/<tid>/schedstat) — which the averager takes at
// the step's end (takeWindows). That is what its Python clock recorded, read without Python.
//
// Threads: runHook runs on the thread running backward; a completion callback on the
// backend's completion thread; everything else on the training thread. The switch's windows
// are under its mutex; the flags are atomics.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace ripples __attribute__((visibility("hidden"))) {

// One waiting window of a backward pass: monotonic seconds (Python's time.perf_counter) and
// the training thread's run-queue wait in seconds at its start and end (negative: unknown).
struct HookWindow {
  double t0, t1, rq0, rq1;
};

class CommHookSwitch {
 public:
  CommHookSwitch() = default;
  ~CommHookSwitch();
  CommHookSwitch(const CommHookSwitch&) = delete;
  CommHookSwitch& operator=(const CommHookSwitch&) = delete;

  // exact: the next buckets are all-reduced exactly in C++. clock: and timed, with the
  // run-queue wait of thread `tid` (0: none).
  void set(bool exact, bool clock, int64_t tid);
  bool exact() const { return exact_.load(std::memory_order_acquire); }
  // The windows recorded since the last call (the averager's step clock takes them).
  std::vector<HookWindow> takeWindows();
  // Buckets all-reduced by the C++ path.
  uint64_t exactBuckets() const { return exactBuckets_.load(std::memory_order_relaxed); }
  void countExactBucket() { exactBuckets_.fetch_add(1, std::memory_order_relaxed); }

  // Called by the hook: a bucket is posted (returns the window it belongs to, -1 if the step
  // is not timed) / its all-reduce completed.
  int64_t posted(bool last);
  void completed(int64_t window);

 private:
  double runQueueWait();  // the training thread's, in seconds; -1 if unknown

  std::atomic<bool> exact_{false};
  std::atomic<bool> clock_{false};
  std::atomic<uint64_t> exactBuckets_{0};
  std::mutex mu_;  // everything below
  int64_t tid_ = 0;
  int fd_ = -1;  // tid_'s schedstat file, kept open (one pread per reading)
  bool schedOk_ = true;
  std::vector<HookWindow> windows_;
  int64_t base_ = 0;  // index of windows_[0] since the switch was made (windows are taken)
  bool closed_ = true;  // the last window's pass has posted its last bucket
};

// The hook registered on DDP's reducer. `pg`: the DDP model's process group.
class RipplesCommHook : public c10d::CommHookInterface {
 public:
  RipplesCommHook(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                  std::shared_ptr<CommHookSwitch> sw, py::object state, py::object hook);
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override;
  at::Tensor parseHookResult(const c10::IValue& result) override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<CommHookSwitch> sw_;
  c10d::PythonCommHook python_;
};

// ripples_pg._C._CommHookSwitch and ripples_pg._C._register_comm_hook.
void bindCommHook(py::module_& m);

}  // namespace ripples
