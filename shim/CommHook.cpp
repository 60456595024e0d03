// The DDP comm hook of wrap(): see CommHook.hpp.
#include "CommHook.hpp"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/extension.h>

#include "ProcessGroupRipples.hpp"

namespace ripples {
namespace {

// Python's time.perf_counter() on Linux: CLOCK_MONOTONIC, in seconds.
double monotonicSeconds() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// The calling thread's partial mode set to exact for one scope (ripples_pg.exact()).
class ExactScope {
 public:
  ExactScope() : prev_(setThreadPartialMode(PartialMode::kExact)) {}
  ~ExactScope() { setThreadPartialMode(prev_); }
  ExactScope(const ExactScope&) = delete;
  ExactScope& operator=(const ExactScope&) = delete;

 private:
  PartialMode prev_;
};

// Whether the exact path all-reduces the bucket with AVG, the core dividing each segment by
// its owner while it is still in cache (1/size of the bucket per rank), instead of dividing
// the whole bucket first: DDP's own path folds the division into its copy of the gradients
// into the bucket, and a separate pass over a 4.4 MB bucket cost ~0.25 ms of a ~6 ms step of
// training-thread CPU (wrap() 0.90-0.97x plain DDP with no straggler). Not for float16, whose
// sums can overflow where the divided gradients do not (why DDP divides first), nor for
// device buffers, where the division is a kernel launch the device runs anyway.
bool coreDivides(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_floating_point() && t.scalar_type() != at::kHalf;
}

}  // namespace

CommHookSwitch::~CommHookSwitch() {
  if (fd_ >= 0) {
    ::close(fd_);
  }
}

void CommHookSwitch::set(bool exact, bool clock, int64_t tid) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (tid != tid_ && fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
    tid_ = tid;
    if (tid_ > 0 && fd_ < 0 && schedOk_) {
      std::string path = "/proc/self/task/" + std::to_string(tid_) + "/schedstat";
      fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      schedOk_ = fd_ >= 0;  // no scheduler statistics here: stop trying
    }
  }
  clock_.store(clock, std::memory_order_release);
  exact_.store(exact, std::memory_order_release);
}

// Caller holds mu_. The file's second field: nanoseconds runnable but waiting for a CPU.
double CommHookSwitch::runQueueWait() {
  if (fd_ < 0) {
    return -1.0;
  }
  char buf[96];
  ssize_t n = ::pread(fd_, buf, sizeof(buf) - 1, 0);
  if (n <= 0) {
    return -1.0;
  }
  buf[n] = '\0';
  char* end = nullptr;
  std::strtoull(buf, &end, 10);  // the time it ran
  if (end == buf) {
    return -1.0;
  }
  char* p = end;
  unsigned long long waited = std::strtoull(p, &end, 10);
  if (end == p) {
    return -1.0;
  }
  return static_cast<double>(waited) * 1e-9;
}

std::vector<HookWindow> CommHookSwitch::takeWindows() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<HookWindow> out;
  out.swap(windows_);
  base_ += static_cast<int64_t>(out.size());
  closed_ = true;  // the next bucket starts a new step's window
  return out;
}

int64_t CommHookSwitch::posted(bool last) {
  if (!clock_.load(std::memory_order_acquire)) {
    return -1;
  }
  double t = monotonicSeconds();
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || windows_.empty()) {  // the first bucket of a backward pass
    double rq = runQueueWait();
    windows_.push_back({t, t, rq, rq});
  }
  closed_ = last;
  return base_ + static_cast<int64_t>(windows_.size()) - 1;
}

void CommHookSwitch::completed(int64_t window) {
  double now = monotonicSeconds();
  std::lock_guard<std::mutex> lock(mu_);
  int64_t i = window - base_;
  if (i < 0 || i >= static_cast<int64_t>(windows_.size())) {
    return;  // taken already (the step was over)
  }
  HookWindow& w = windows_[static_cast<size_t>(i)];
  if (now > w.t1) {
    w.t1 = now;
    w.rq1 = runQueueWait();
  }
}

RipplesCommHook::RipplesCommHook(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                 std::shared_ptr<CommHookSwitch> sw, py::object state,
                                 py::object hook)
    : pg_(std::move(pg)), sw_(std::move(sw)), python_(std::move(state), std::move(hook)) {}

c10::intrusive_ptr<c10::ivalue::Future> RipplesCommHook::runHook(c10d::GradBucket& bucket) {
  if (!sw_->exact()) {
    return python_.runHook(bucket);  // takes the GIL itself
  }
  int64_t window = sw_->posted(bucket.isLast());
  std::vector<at::Tensor> tensors = {bucket.getBufferRef()};
  c10d::AllreduceOptions opts;
  if (coreDivides(tensors[0])) {
    opts.reduceOp = c10d::ReduceOp::AVG;
  } else {
    tensors[0].div_(pg_->getSize());  // before the sum, as DDP's own hook: no fp16 overflow
  }
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    ExactScope exact;  // on the calling thread, which submits the all-reduce
    fut = pg_->allreduce(tensors, opts)->getFuture();
  }
  sw_->countExactBucket();
  if (window < 0) {
    return fut;
  }
  std::shared_ptr<CommHookSwitch> sw = sw_;
  return fut->then(
      [sw, window](c10::ivalue::Future& done) {
        sw->completed(window);
        return done.value();  // rethrows the all-reduce's error into the returned future
      },
      fut->elementType());
}

at::Tensor RipplesCommHook::parseHookResult(const c10::IValue& result) {
  if (result.isPyObject()) {
    return python_.parseHookResult(result);  // the Python hook's future
  }
  // the C++ path's: the all-reduce's value, a list of one tensor (as DDP's own hooks)
  if (result.isTensor()) {
    return result.toTensor();
  }
  return result.toTensorVector()[0];
}

namespace {

py::object secondsOrNone(double v) {
  return v < 0 ? py::none() : py::cast(v);
}

}  // namespace

void bindCommHook(py::module_& m) {
  py::class_<CommHookSwitch, std::shared_ptr<CommHookSwitch>>(
      m, "_CommHookSwitch",
      "What wrap()'s DDP comm hook does with the next buckets (shim/CommHook.hpp); set "
      "by ripples_pg.hooks.RipplesHookState.")
      .def(py::init<>())
      .def("set", &CommHookSwitch::set, py::arg("exact"), py::arg("clock"), py::arg("tid"),
           "exact: all-reduce exactly in C++; clock: record the waiting windows, with the "
           "run-queue wait of thread tid (0: none).")
      .def(
          "take_windows",
          [](CommHookSwitch& sw) {
            std::vector<HookWindow> ws;
            {
              py::gil_scoped_release nogil;  // the mutex is taken on completion threads
              ws = sw.takeWindows();
            }
            py::list out;
            for (const HookWindow& w : ws) {
              out.append(py::make_tuple(w.t0, w.t1, secondsOrNone(w.rq0), secondsOrNone(w.rq1)));
            }
            return out;
          },
          "The waiting windows since the last call: (t0, t1, run-queue wait at t0, at t1); "
          "times as time.perf_counter(), waits in seconds or None.")
      .def_property_readonly("exact", &CommHookSwitch::exact)
      .def_property_readonly("exact_buckets", &CommHookSwitch::exactBuckets);
  m.def(
      "_register_comm_hook",
      [](c10d::Reducer& reducer, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
         std::shared_ptr<CommHookSwitch> sw, py::object state, py::object hook) {
        TORCH_CHECK_VALUE(sw != nullptr, "a _CommHookSwitch is required");
        reducer.register_comm_hook(
            std::make_unique<RipplesCommHook>(pg, std::move(sw), std::move(state),
                                              std::move(hook)));
      },
      py::arg("reducer"), py::arg("process_group"), py::arg("switch"), py::arg("state"),
      py::arg("hook"),
      "Registers wrap()'s comm hook on a DDP reducer: exact steps in C++ while the switch "
      "says so, else hook(state, bucket). A reducer takes one hook.");
}

}  // namespace ripples
