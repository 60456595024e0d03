// ProcessGroupRipples: see ProcessGroupRipples.hpp for the design (completion, threading,
// lifetime). This file only validates calls, converts tensors to rpl_buf and back, and plumbs
// works and futures. No communication algorithm lives here.
#include <Python.h>  // only to release the GIL around blocking waits, when it is held

#include "ProcessGroupRipples.hpp"

#include <ATen/MemoryOverlap.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

namespace ripples {

namespace {

// Options(single_copy=True): all-reduce buffers from this size read peers' memory directly
// (below it the handshake costs more than the copies it saves).
constexpr size_t kSingleCopyBytes = 256 * 1024;

// ---- small helpers ------------------------------------------------------------------------

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Releases the GIL for its scope if (and only if) this thread holds it. Used where torch may
// call us with or without the GIL (shutdown), so that threads that need the GIL to finish
// (a Python .then callback on a completion thread) can run while we wait for them.
class GilRelease {
 public:
  GilRelease() {
    if (Py_IsInitialized() && PyGILState_Check()) {
      state_ = PyEval_SaveThread();
    }
  }
  ~GilRelease() {
    if (state_ != nullptr) {
      PyEval_RestoreThread(state_);
    }
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

}  // namespace

std::string pyDtypeName(at::ScalarType st) {
  // "torch.float32"-style names, the way users write them.
  auto names = c10::getDtypeNames(st);
  return "torch." + std::string(names.first);
}

bool toRplDtype(at::ScalarType st, rpl_dtype* out) {
  switch (st) {
    case at::kBool: *out = RPL_BOOL; return true;
    case at::kByte: *out = RPL_UINT8; return true;
    case at::kChar: *out = RPL_INT8; return true;
    case at::kShort: *out = RPL_INT16; return true;
    case at::kInt: *out = RPL_INT32; return true;
    case at::kLong: *out = RPL_INT64; return true;
    case at::kHalf: *out = RPL_FLOAT16; return true;
    case at::kBFloat16: *out = RPL_BFLOAT16; return true;
    case at::kFloat: *out = RPL_FLOAT32; return true;
    case at::kDouble: *out = RPL_FLOAT64; return true;
    default: return false;
  }
}

namespace {

const char* kSupportedDtypes =
    "torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, "
    "torch.float16, torch.bfloat16, torch.float32, torch.float64";

const char* redOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::SUM: return "SUM";
    case c10d::ReduceOp::AVG: return "AVG";
    case c10d::ReduceOp::PRODUCT: return "PRODUCT";
    case c10d::ReduceOp::MIN: return "MIN";
    case c10d::ReduceOp::MAX: return "MAX";
    case c10d::ReduceOp::BAND: return "BAND";
    case c10d::ReduceOp::BOR: return "BOR";
    case c10d::ReduceOp::BXOR: return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

// Maps a c10d ReduceOp to the core's operator and checks that it reduces `dtype`.
rpl_redop toRplRedop(const c10d::ReduceOp& op, rpl_dtype dtype, const char* opName) {
  rpl_redop r;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: r = RPL_SUM; break;
    case c10d::ReduceOp::AVG: r = RPL_AVG; break;
    case c10d::ReduceOp::PRODUCT: r = RPL_PRODUCT; break;
    case c10d::ReduceOp::MIN: r = RPL_MIN; break;
    case c10d::ReduceOp::MAX: r = RPL_MAX; break;
    case c10d::ReduceOp::BAND: r = RPL_BAND; break;
    case c10d::ReduceOp::BOR: r = RPL_BOR; break;
    case c10d::ReduceOp::BXOR: r = RPL_BXOR; break;
    default:
      TORCH_CHECK_TYPE(
          false,
          "ripples ", opName, ": ReduceOp.", redOpName(op.op_),
          " is not supported by the ripples backend (supported: SUM, AVG, PRODUCT, MIN, "
          "MAX, BAND, BOR, BXOR)");
  }
  rpl_error err;
  std::memset(&err, 0, sizeof(err));
  if (rpl_reduce_check(dtype, r, &err) != RPL_OK) {
    TORCH_CHECK_TYPE(
        false,
        "ripples ", opName, ": ReduceOp.", redOpName(op.op_), " cannot reduce tensors of dtype ",
        rpl_dtype_name(dtype), " (", err.msg, ")");
  }
  return r;
}

std::string ordinal(size_t i) {
  return "[" + std::to_string(i) + "]";
}

// Checks one user tensor: defined, CPU or CUDA, strided, supported dtype.
rpl_dtype checkTensor(const at::Tensor& t, const char* opName, const std::string& what) {
  TORCH_CHECK_VALUE(t.defined(), "ripples ", opName, ": ", what, " is an undefined tensor");
  TORCH_CHECK_VALUE(
      t.device().is_cpu() || t.device().is_cuda(),
      "ripples ", opName, ": ", what, " is on device '", t.device().str(),
      "'; the ripples backend handles CPU and CUDA tensors (move it with .cpu(), or use a "
      "backend made for that device)");
  TORCH_CHECK_VALUE(
      t.layout() == c10::kStrided,
      "ripples ", opName, ": ", what, " has layout ", t.layout(),
      "; only dense (strided) tensors are supported");
  rpl_dtype d;
  TORCH_CHECK_TYPE(
      toRplDtype(t.scalar_type(), &d),
      "ripples ", opName, ": ", what, " has dtype ", pyDtypeName(t.scalar_type()),
      ", which the ripples backend does not support (supported: ", kSupportedDtypes, ")");
  return d;
}

// The one device of every tensor of a call: the staging copies, the future's device set and the
// stream the caller waits on all follow from it. Tensors must have passed checkTensor.
c10::Device callDevice(
    const char* opName,
    std::initializer_list<c10::ArrayRef<at::Tensor>> lists) {
  std::optional<c10::Device> dev;
  for (const auto& list : lists) {
    for (const at::Tensor& t : list) {
      if (!dev) {
        dev = t.device();
      } else {
        TORCH_CHECK_VALUE(
            t.device() == *dev,
            "ripples ", opName, ": the tensors of one call are on different devices ('",
            dev->str(), "' and '", t.device().str(),
            "'); put every input and output of a call on the same device");
      }
    }
  }
  return dev.value_or(c10::Device(c10::kCPU));
}

void checkSameDtype(
    const at::Tensor& t,
    const at::Tensor& ref,
    const char* opName,
    const std::string& what,
    const std::string& refWhat) {
  TORCH_CHECK_VALUE(
      t.scalar_type() == ref.scalar_type(),
      "ripples ", opName, ": ", what, " has dtype ", pyDtypeName(t.scalar_type()), " but ",
      refWhat, " has dtype ", pyDtypeName(ref.scalar_type()), "; they must match");
}

void checkNumel(
    const at::Tensor& t,
    int64_t expected,
    const char* opName,
    const std::string& what,
    const std::string& why) {
  TORCH_CHECK_VALUE(
      t.numel() == expected,
      "ripples ", opName, ": ", what, " has ", t.numel(), " elements but ", expected,
      " are expected (", why, ")");
}

void checkWritable(const at::Tensor& t, const char* opName, const std::string& what) {
  TORCH_CHECK_VALUE(
      at::has_internal_overlap(t) != at::MemOverlap::Yes,
      "ripples ", opName, ": ", what,
      " has overlapping memory (for example a result of expand()); results cannot be "
      "written into it. Pass a tensor that owns its elements (e.g. .clone())");
}

void checkListSize(
    size_t got,
    size_t expected,
    const char* opName,
    const std::string& what,
    const std::string& why) {
  TORCH_CHECK_VALUE(
      got == expected,
      "ripples ", opName, ": ", what, " has ", got, " tensors but must have ", expected,
      " (", why, ")");
}

void checkRank(int64_t r, int size, const char* opName, const char* what) {
  TORCH_CHECK_VALUE(
      r >= 0 && r < size,
      "ripples ", opName, ": ", what, " ", r, " is out of range for a process group of size ",
      size, " (valid: 0..", size - 1, ")");
}

rpl_buf bufOf(const at::Tensor& contiguous, rpl_dtype d) {
  rpl_buf b;
  b.count = static_cast<size_t>(contiguous.numel());
  b.ptr = b.count ? contiguous.data_ptr() : nullptr;
  b.dtype = d;
  return b;
}

// Raises the torch exception that corresponds to a core status.
[[noreturn]] void throwStatus(rpl_status st, const std::string& msg) {
  switch (st) {
    case RPL_ERR_INVALID:
    case RPL_ERR_MISMATCH:
      C10_THROW_ERROR(ValueError, msg);
    case RPL_ERR_UNSUPPORTED:
      C10_THROW_ERROR(TypeError, msg);
    case RPL_ERR_TIMEOUT:
    case RPL_ERR_PEER:
    case RPL_ERR_ABORTED:
    case RPL_ERR_SYSTEM:
      C10_THROW_ERROR(DistBackendError, msg);
    case RPL_ERR_NOMEM:
      C10_THROW_ERROR(Error, msg);
    case RPL_ERR_CLOSED:
    default:
      C10_THROW_ERROR(Error, msg);
  }
}

std::exception_ptr statusError(rpl_status st, const std::string& msg) {
  try {
    throwStatus(st, msg);
  } catch (...) {
    return std::current_exception();
  }
}

std::string closedMessage(const GroupShared& g, const std::string& opName) {
  return "ripples " + opName + ": the " + g.name +
      " has been shut down / destroyed (destroy_process_group() or shutdown() was called); "
      "create a new process group to communicate again";
}

std::string failureMessage(
    const GroupShared& g,
    const std::string& opName,
    rpl_status st,
    const std::string& coreMsg) {
  if (st == RPL_ERR_CLOSED) {
    return closedMessage(g, opName) + " [" + coreMsg + "]";
  }
  return "ripples " + opName + " failed on " + g.name + ": " + coreMsg + " (" +
      rpl_status_name(st) + ")";
}

void fillError(rpl_error* err, rpl_status st, const std::string& msg) {
  if (err == nullptr) {
    return;
  }
  err->code = st;
  std::snprintf(err->msg, RPL_ERRMSG_LEN, "%s", msg.c_str());
}

// ---- the c10d store, seen from the core ------------------------------------------------------

struct StoreAdapter {
  c10::intrusive_ptr<c10d::Store> store;
};

rpl_status storeErrorStatus(const std::exception& e) {
  if (dynamic_cast<const c10::DistStoreError*>(&e) != nullptr) {
    return RPL_ERR_TIMEOUT;  // TCPStore reports an expired wait for a key this way
  }
  if (dynamic_cast<const c10::DistNetworkError*>(&e) != nullptr) {
    return RPL_ERR_PEER;
  }
  return RPL_ERR_SYSTEM;
}

rpl_status storeSet(void* ctx, const char* key, const void* val, size_t len, rpl_error* err) {
  try {
    auto* a = static_cast<StoreAdapter*>(ctx);
    const auto* p = static_cast<const uint8_t*>(val);
    a->store->set(std::string(key), std::vector<uint8_t>(p, p + len));
    return RPL_OK;
  } catch (const std::exception& e) {
    rpl_status st = storeErrorStatus(e);
    fillError(err, st, std::string("c10d store set('") + key + "') failed: " + e.what());
    return st;
  } catch (...) {
    fillError(err, RPL_ERR_SYSTEM, std::string("c10d store set('") + key + "') failed");
    return RPL_ERR_SYSTEM;
  }
}

rpl_status storeGet(
    void* ctx,
    const char* key,
    void* buf,
    size_t cap,
    size_t* len,
    rpl_error* err) {
  try {
    auto* a = static_cast<StoreAdapter*>(ctx);
    std::vector<uint8_t> v = a->store->get(std::string(key));  // blocks until the key exists
    if (len != nullptr) {
      *len = v.size();
    }
    if (buf != nullptr && cap > 0 && !v.empty()) {
      std::memcpy(buf, v.data(), std::min(cap, v.size()));
    }
    return RPL_OK;
  } catch (const std::exception& e) {
    rpl_status st = storeErrorStatus(e);
    fillError(
        err, st,
        std::string("c10d store get('") + key +
            "') failed (did every rank of the group create it?): " + e.what());
    return st;
  } catch (...) {
    fillError(err, RPL_ERR_SYSTEM, std::string("c10d store get('") + key + "') failed");
    return RPL_ERR_SYSTEM;
  }
}

// ---- core completion callback ------------------------------------------------------------------

// Runs on the core's progress thread: record, hand over, return. Never throws.
void onDone(void* arg, rpl_status status, const rpl_error* err) {
  auto* ctx = static_cast<OpContext*>(arg);
  ctx->group->last_done_ns.store(nowNs());
  if (status != RPL_OK) {
    ctx->recordError(status, err != nullptr ? err->msg : rpl_status_name(status));
  }
  if (ctx->pending.fetch_sub(1) == 1) {
    ctx->executor->push(ctx);
  }
}

thread_local CompletionExecutor* tlExecutor = nullptr;

}  // namespace

// ---- OpContext ---------------------------------------------------------------------------------

void OpContext::recordError(rpl_status st, const std::string& msg) {
  std::lock_guard<std::mutex> g(errMu);
  if (status == RPL_OK) {
    status = st;
    errMsg = msg;
  }
}

// ---- WorkRipples -------------------------------------------------------------------------------

WorkRipples::WorkRipples(
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
    const std::optional<std::vector<at::Tensor>>& profiled)
    : Work(rank, opType, profilingTitle, profiled ? profiled : outputs),
      opName_(std::move(opName)),
      outputs_(std::move(outputs)),
      // A future that knows the device records an event when completed and makes its users'
      // current streams wait for it (torch's CUDA-aware futures).
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()),
          device.is_cpu() ? std::vector<c10::Device>{} : std::vector<c10::Device>{device})),
      group_(std::move(group)),
      submitted_(std::chrono::steady_clock::now()),
      opTimeout_(opTimeout),
      seq_(seq),
      stage_(std::move(stage)) {}

WorkRipples::~WorkRipples() = default;

int WorkRipples::sourceRank() const {
  const int s = source_.load();
  TORCH_CHECK(
      s >= 0, "ripples ", opName_, ": sourceRank() is only known for a recv, and for a recv "
      "from any source once it completed");
  return s;
}

std::vector<at::Tensor> WorkRipples::result() {
  return outputs_;
}

c10::intrusive_ptr<c10::ivalue::Future> WorkRipples::getFuture() {
  return future_;
}

bool WorkRipples::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto done = [&] { return completed_; };
  if (timeout > std::chrono::milliseconds::zero()) {
    if (!cv_.wait_for(lock, timeout, done)) {
      C10_THROW_ERROR(
          DistBackendError,
          c10::str(
              "ripples ", opName_, " on ", group_->name, " did not complete within the ",
              timeout.count(), " ms given to Work.wait(); the operation is still in flight"));
    }
  } else if (opTimeout_ > std::chrono::milliseconds::zero()) {
    // A per-call timeout (e.g. barrier(timeout=...)) bounds the wait from submission.
    if (!cv_.wait_until(lock, submitted_ + opTimeout_, done)) {
      C10_THROW_ERROR(
          DistBackendError,
          c10::str(
              "ripples ", opName_, " on ", group_->name, " did not complete within its "
              "timeout of ", opTimeout_.count(), " ms; the operation is still in flight"));
    }
  } else {
    // The core fails every operation that runs longer than the group's timeout; operations
    // run one at a time, so ours started when the previous one finished (or when it was
    // submitted). This loop is a backstop that fires only if the core did not report back
    // (a grace period lets the core's own, more precise error arrive first).
    const auto limit = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::duration<double>(group_->timeout_s * 1.05 + 5.0));
    const int64_t submittedNs = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    submitted_.time_since_epoch())
                                    .count();
    for (;;) {
      const int64_t startNs = std::max(submittedNs, group_->last_done_ns.load());
      const auto deadline = std::chrono::steady_clock::time_point(
          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
              std::chrono::nanoseconds(startNs) + limit));
      if (cv_.wait_until(lock, deadline, done)) {
        break;
      }
      if (std::max(submittedNs, group_->last_done_ns.load()) == startNs) {
        C10_THROW_ERROR(
            DistBackendError,
            c10::str(
                "ripples ", opName_, " on ", group_->name,
                " did not complete within the process group's timeout of ", group_->timeout_s,
                " s (the core did not report back)"));
      }
      // An earlier operation finished meanwhile: ours started later; wait on.
    }
  }
  if (exception_) {
    std::rethrow_exception(exception_);
  }
  lock.unlock();
  synchronize();
  return true;
}

void WorkRipples::synchronize() {
  if (stage_ && isCompleted() && exception() == nullptr) {
    stage_->blockCurrentStream();
  }
}

// ---- CompletionExecutor ------------------------------------------------------------------------

CompletionExecutor::CompletionExecutor(std::string label) : label_(std::move(label)) {}

CompletionExecutor::~CompletionExecutor() {
  // Only reached once every thread has exited (they own shared_ptrs): the queue is empty.
  for (auto& kv : queue_) {
    delete kv.second;
  }
}

bool CompletionExecutor::onCompletionThread() {
  return tlExecutor != nullptr;
}

void CompletionExecutor::start() {
  std::unique_lock<std::mutex> lk(mu_);
  spawnLocked(lk);
}

// Starts a detached worker. Called with mu_ held; thread creation failure is tolerated as
// long as another thread exists to drain the queue.
void CompletionExecutor::spawnLocked(std::unique_lock<std::mutex>& /*lk*/) {
  if (threads_ >= kMaxCompletionThreads) {
    return;
  }
  try {
    auto self = shared_from_this();
    std::thread t([self] { self->workerLoop(); });
    t.detach();
    ++threads_;
  } catch (...) {
    // Out of threads: the existing ones will get to the queue eventually.
  }
}

void CompletionExecutor::push(OpContext* ctx) {
  std::unique_lock<std::mutex> lk(mu_);
  try {
    queue_.emplace(ctx->seq, ctx);
  } catch (...) {
    // Out of memory in the completion path: nothing sensible is left to do.
    std::terminate();
  }
  wakeLocked(lk);
}

// The operation whose turn it is must have a thread that is free to take it: a busy thread
// may be blocked in a user callback waiting for exactly this operation.
void CompletionExecutor::wakeLocked(std::unique_lock<std::mutex>& lk) {
  if (!runnableLocked()) {
    return;
  }
  if (idle_ == 0) {
    spawnLocked(lk);
  }
  lk.unlock();
  cv_.notify_one();
}

void CompletionExecutor::advanceTicket(uint64_t seq) {
  std::unique_lock<std::mutex> lk(mu_);
  if (ticket_ != seq) {
    return;
  }
  ticket_ = seq + 1;
  ticketCv_.notify_all();
  wakeLocked(lk);  // the next operation may have finished long ago
}

bool CompletionExecutor::caughtUp(uint64_t seq) {
  std::lock_guard<std::mutex> g(mu_);
  return ticket_ == seq;
}

void CompletionExecutor::completeHere(OpContext* ctx) {
  process(ctx);
}

void CompletionExecutor::stop(double wait_s) {
  std::unique_lock<std::mutex> lk(mu_);
  stopping_ = true;
  cv_.notify_all();
  if (wait_s > 0) {
    const int self = (tlExecutor == this) ? 1 : 0;
    exitCv_.wait_for(
        lk, std::chrono::duration<double>(wait_s), [&] { return threads_ <= self; });
  }
}

void CompletionExecutor::workerLoop() {
  tlExecutor = this;
  pthread_setname_np(pthread_self(), "rpl-complete");
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (runnableLocked()) {
      OpContext* ctx = queue_.begin()->second;
      queue_.erase(queue_.begin());
      lk.unlock();
      process(ctx);
      lk.lock();
      continue;
    }
    if (stopping_ && queue_.empty()) {
      break;
    }
    ++idle_;
    const bool woke = cv_.wait_for(lk, std::chrono::seconds(10), [&] {
      return runnableLocked() || (stopping_ && queue_.empty());
    });
    --idle_;
    if (!woke && threads_ > 1) {
      break;  // surplus thread, idle for a while
    }
  }
  --threads_;
  lk.unlock();
  exitCv_.notify_all();
  tlExecutor = nullptr;
}

void CompletionExecutor::process(OpContext* raw) {
  std::unique_ptr<OpContext> ctx(raw);
  WorkRipples* work = ctx->work.get();
  std::exception_ptr eptr;
  if (ctx->status != RPL_OK) {
    eptr = statusError(
        ctx->status, failureMessage(*ctx->group, work->opName(), ctx->status, ctx->errMsg));
  }

  // Wait for our turn: results become visible in the order operations were issued.
  {
    std::unique_lock<std::mutex> lk(mu_);
    ticketCv_.wait(lk, [&] { return ticket_ == ctx->seq; });
  }

  // Device results are copied back on the group's side stream, which is this thread's current
  // stream while the future completes: the future's event then covers the copies.
  c10::OptionalStreamGuard sideGuard;
  if (ctx->stage && ctx->stage->hasStreams()) {
    sideGuard.reset_stream(*ctx->stage->side());
  }
  if (!eptr) {
    try {
      for (auto& cb : ctx->copyBack) {
        if (ctx->stage) {
          ctx->stage->copyBack(cb.first, cb.second);
        } else {
          cb.second.copy_(cb.first);
        }
      }
      if (ctx->stage) {
        ctx->stage->markDone();
      }
    } catch (...) {
      eptr = std::current_exception();
    }
  }
  ctx->copyBack.clear();
  ctx->keepAlive.clear();
  ctx->in.clear();
  ctx->out.clear();

  // The future's first callback (registered at submission) finishes the Work and passes the
  // ticket on; the user's callbacks run after it, inline, and may block.
  if (ctx->source >= 0) {
    work->setSourceRank(ctx->source);  // before the future: its callbacks may ask
  }
  auto fut = work->getFuture();
  try {
    if (eptr) {
      fut->setError(eptr);
    } else {
      fut->markCompleted(c10::IValue(work->outputs()));
    }
  } catch (...) {
    // A user callback let an exception escape; the future and the Work are complete already.
  }
  // In case the first callback did not run (it always does), never stall later operations.
  if (!work->isCompleted()) {
    work->finishFromExecutor(eptr);
  }
  advanceTicket(ctx->seq);
  // ctx (and with it the Work reference and staging buffers) is released here.
}

// ---- ProcessGroupRipples -------------------------------------------------------------------------

struct ProcessGroupRipples::Call {
  double timeoutS = 0;  // per-call timeout (opts.timeout); 0 = the group's
  std::unique_ptr<OpContext> ctx;
  const char* opName;

  OpContext& c() {
    return *ctx;
  }
  DeviceStage* stage() const {
    return ctx->stage.get();
  }

  // Read-only input: staged if not contiguous or not in host memory.
  rpl_buf in(const at::Tensor& t, rpl_dtype d) {
    at::Tensor c = stage() ? stage()->toHost(t, true) : (t.is_contiguous() ? t : t.contiguous());
    ctx->keepAlive.push_back(c);
    return bufOf(c, d);
  }

  // Read and written in place: staged and copied back if not contiguous or not in host memory.
  // The staging tensor is the last one kept alive (broadcast relies on it).
  rpl_buf inout(const at::Tensor& t, rpl_dtype d, const std::string& what) {
    if (!stage() && t.is_contiguous()) {
      ctx->keepAlive.push_back(t);
      return bufOf(t, d);
    }
    checkWritable(t, opName, what);
    at::Tensor c = stage() ? stage()->toHost(t, true) : t.contiguous();
    ctx->keepAlive.push_back(c);
    ctx->copyBack.emplace_back(c, t);
    return bufOf(c, d);
  }

  // Written only: a fresh contiguous (host) temporary if not contiguous or not in host memory.
  rpl_buf out(const at::Tensor& t, rpl_dtype d, const std::string& what) {
    if (!stage() && t.is_contiguous()) {
      ctx->keepAlive.push_back(t);
      return bufOf(t, d);
    }
    checkWritable(t, opName, what);
    at::Tensor c = stage()
        ? stage()->toHost(t, false)
        : at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
    ctx->keepAlive.push_back(c);
    ctx->copyBack.emplace_back(c, t);
    return bufOf(c, d);
  }

  // A contiguous tensor (the user's, or a temporary copied back) split into `parts` equal
  // consecutive buffers. `read`: the contents matter; `write`: results land in it.
  std::vector<rpl_buf> split(
      const at::Tensor& t,
      rpl_dtype d,
      int parts,
      bool read,
      bool write,
      const std::string& what) {
    at::Tensor c;
    if (!stage() && t.is_contiguous()) {
      c = t;
    } else {
      if (write) {
        checkWritable(t, opName, what);
      }
      if (stage()) {
        c = stage()->toHost(t, read);
      } else {
        c = read ? t.contiguous()
                 : at::empty(
                       t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
      }
      if (write) {
        ctx->copyBack.emplace_back(c, t);
      }
    }
    ctx->keepAlive.push_back(c);
    std::vector<rpl_buf> bufs(parts);
    const size_t each = parts > 0 ? static_cast<size_t>(c.numel()) / parts : 0;
    char* base = c.numel() ? static_cast<char*>(c.data_ptr()) : nullptr;
    const size_t esz = c.element_size();
    for (int i = 0; i < parts; ++i) {
      bufs[i].count = each;
      bufs[i].ptr = each ? base + i * each * esz : nullptr;
      bufs[i].dtype = d;
    }
    return bufs;
  }
};

ProcessGroupRipples::ProcessGroupRipples(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    Config cfg)
    : Backend(rank, size), cfg_(std::move(cfg)) {
  TORCH_CHECK_VALUE(size >= 1, "ripples: process group size must be >= 1, got ", size);
  TORCH_CHECK_VALUE(
      rank >= 0 && rank < size, "ripples: rank ", rank, " is out of range for size ", size);
  TORCH_CHECK_VALUE(
      cfg_.timeout_s > 0, "ripples: timeout must be > 0 seconds, got ", cfg_.timeout_s);
  TORCH_CHECK_VALUE(store.defined(), "ripples: the process group needs a c10d store");

  group_ = std::make_shared<GroupShared>();
  group_->rank = rank;
  group_->size = size;
  group_->timeout_s = cfg_.timeout_s;
  group_->name = c10::str(
      "ripples process group '", cfg_.name.empty() ? std::string("?") : cfg_.name,
      "' (rank ", rank, " of ", size, ")");
  group_->last_done_ns.store(nowNs());

  rpl_comm_config cc;
  std::memset(&cc, 0, sizeof(cc));
  cc.rank = rank;
  cc.size = size;
  cc.timeout_s = cfg_.timeout_s;
  cc.bind_addr = cfg_.bind_addr.empty() ? nullptr : cfg_.bind_addr.c_str();
  cc.job_secret = cfg_.job_secret.c_str();
  cc.name = cfg_.name.empty() ? nullptr : cfg_.name.c_str();
  cc.small_bytes = cfg_.small_bytes;
  cc.chunk_bytes = cfg_.chunk_bytes;
  cc.host_key = cfg_.host_key.empty() ? nullptr : cfg_.host_key.c_str();
  cc.tcp_only = cfg_.tcp_only ? 1 : 0;
  cc.use_ucx = cfg_.use_ucx ? 1 : 0;
  cc.single_copy_bytes = cfg_.single_copy ? kSingleCopyBytes : 0;

  StoreAdapter adapter{store};
  rpl_store rs;
  rs.ctx = &adapter;
  rs.set = &storeSet;
  rs.get = &storeGet;

  rpl_error err;
  std::memset(&err, 0, sizeof(err));
  rpl_status st = rpl_comm_create(&cc, &rs, &comm_, &err);
  if (st != RPL_OK) {
    comm_ = nullptr;
    throwStatus(
        st,
        c10::str(
            "ripples: could not create ", group_->name, ": ", err.msg, " (",
            rpl_status_name(st), ")"));
  }

  if (!cfg_.schedule.empty()) {
    TORCH_CHECK_VALUE(
        cfg_.host_of.empty() || cfg_.host_of.size() == static_cast<size_t>(size),
        "ripples: host_of has ", cfg_.host_of.size(), " entries for a group of ", size);
    rpl_partial_config pc;
    std::memset(&pc, 0, sizeof(pc));
    pc.schedule = cfg_.schedule.c_str();
    pc.host_of = cfg_.host_of.empty() ? nullptr : cfg_.host_of.data();
    pc.endpoint = cfg_.endpoint.empty() ? nullptr : cfg_.endpoint.c_str();
    pc.token_hex = cfg_.token.empty() ? nullptr : cfg_.token.c_str();
    pc.on_failure = cfg_.on_failure_skip ? RPL_ON_FAILURE_SKIP : RPL_ON_FAILURE_RAISE;
    pc.trace = cfg_.trace ? 1 : 0;
    pc.domain = processFenceDomain();
    st = rpl_comm_enable_partial(comm_, &pc, &err);
    if (st != RPL_OK) {
      rpl_comm_destroy(comm_);
      comm_ = nullptr;
      throwStatus(
          st,
          c10::str(
              "ripples: could not enable the '", cfg_.schedule, "' schedule on ",
              group_->name, ": ", err.msg, " (", rpl_status_name(st), ")"));
    }
  }

  executor_ = std::make_shared<CompletionExecutor>(group_->name);
  executor_->start();
  stager_ = std::make_unique<StagedSubmitter>(cfg_.timeout_s);
  init();
}

ProcessGroupRipples::~ProcessGroupRipples() {
  // May run with the GIL held (torch's Python holder): never wait here for a thread that may
  // need it. The core's progress thread never does; completion threads are detached.
  shutdown_.store(true);
  if (stager_) {
    // Never needs the GIL; gives up waiting for device copies once stopped.
    stager_->stop("shut down before its device copies finished", true);
  }
  if (comm_ != nullptr) {
    rpl_comm_destroy(comm_);  // shuts down if needed, joins the progress thread
    comm_ = nullptr;
  }
  if (executor_) {
    executor_->stop(0);
  }
}

void ProcessGroupRipples::shutdown() {
  std::lock_guard<std::mutex> g(shutdownMu_);
  if (shutdown_.exchange(true)) {
    return;
  }
  GilRelease nogil;
  if (comm_ != nullptr) {
    // Queued operations complete with RPL_ERR_CLOSED; one running inline on a caller's thread
    // (which holds submitMu_) is interrupted. A submission racing with this is refused.
    rpl_comm_shutdown(comm_);
  }
  {
    // Waits for submissions in flight (an inline one returns once interrupted).
    std::lock_guard<std::mutex> s(submitMu_);
  }
  if (stager_) {
    stager_->stop("shut down before its device copies finished", true);
  }
  if (executor_) {
    executor_->stop(std::min(30.0, std::max(1.0, cfg_.timeout_s)));
  }
}

void ProcessGroupRipples::abort() {
  shutdown();
}

std::string ProcessGroupRipples::listenAddress() const {
  char buf[96] = "";
  if (comm_ != nullptr) rpl_comm_listen_address(comm_, buf, sizeof(buf));
  return buf;
}

rpl_comm_counters ProcessGroupRipples::counters() const {
  rpl_comm_counters c;
  std::memset(&c, 0, sizeof(c));
  if (comm_ != nullptr) {
    rpl_comm_get_counters(comm_, &c);
  }
  return c;
}

rpl_partial_stats ProcessGroupRipples::partialStats() const {
  rpl_partial_stats s;
  std::memset(&s, 0, sizeof(s));
  if (comm_ != nullptr) {
    rpl_comm_partial_stats(comm_, &s);
  }
  return s;
}

std::vector<rpl_trace_entry> ProcessGroupRipples::trace(uint64_t from) const {
  std::vector<rpl_trace_entry> out;
  if (comm_ == nullptr) {
    return out;
  }
  std::vector<rpl_trace_entry> chunk(1024);
  for (;;) {
    size_t n = rpl_comm_trace(comm_, from, chunk.data(), chunk.size());
    out.insert(out.end(), chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(n));
    if (n < chunk.size()) {
      return out;
    }
    from += n;
  }
}

namespace {
thread_local PartialMode tlsPartialMode = PartialMode::kGroupDefault;
}  // namespace

rpl_domain* processFenceDomain() {
  // One per process, on purpose: an exact collective on any ripples group must fence the
  // dynamic schedules of all of them (DESIGN §3). It lives as long as the process.
  static rpl_domain* domain = [] {
    rpl_domain* d = nullptr;
    rpl_error err;
    TORCH_CHECK(rpl_domain_create(&d, &err) == RPL_OK, "ripples: ", err.msg);
    return d;
  }();
  return domain;
}

PartialMode setThreadPartialMode(PartialMode mode) {
  PartialMode prev = tlsPartialMode;
  tlsPartialMode = mode;
  return prev;
}

rpl_op_kind ProcessGroupRipples::allreduceKind() const {
  if (cfg_.schedule.empty() || tlsPartialMode == PartialMode::kExact) {
    return RPL_OP_ALLREDUCE;
  }
  bool partial = tlsPartialMode == PartialMode::kPartial || cfg_.partial_by_default;
  return partial ? RPL_OP_PARTIAL_ALLREDUCE : RPL_OP_ALLREDUCE;
}

void ProcessGroupRipples::checkOpen(const char* opName) const {
  TORCH_CHECK(!shutdown_.load(), closedMessage(*group_, opName));
}

ProcessGroupRipples::Call ProcessGroupRipples::begin(
    c10d::OpType opType,
    const char* profilingTitle,
    const char* opName,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds opTimeout,
    c10::Device device,
    std::optional<std::vector<at::Tensor>> profiled) {
  checkOpen(opName);
  const bool p2p = opType == c10d::OpType::SEND || opType == c10d::OpType::RECV;
  const uint64_t seq = p2p ? collSeq_.load() : ++collSeq_;
  Call call;
  call.opName = opName;
  call.ctx = std::make_unique<OpContext>();
  if (!device.is_cpu() || debugStageCpu(calls_++)) {
    // Created before any tensor is staged: its side stream waits for the caller's stream.
    call.ctx->stage = std::make_shared<DeviceStage>(device, sideStreams_.get(device));
    ++staged_;
  }
  call.ctx->work = c10::make_intrusive<WorkRipples>(
      getRank(), opType, profilingTitle, opName, std::move(outputs), group_,
      opTimeout.count() > 0 ? opTimeout : std::chrono::milliseconds::zero(), seq, device,
      call.ctx->stage, profiled);
  call.ctx->executor = executor_;
  call.ctx->group = group_;
  // torch's "unset" is negative; the core takes 0 for "the communicator's timeout".
  call.timeoutS = opTimeout.count() > 0 ? static_cast<double>(opTimeout.count()) / 1000.0 : 0;
  return call;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::submit(
    Call& call,
    std::vector<rpl_op_desc> descs) {
  OpContext* ctx = call.ctx.get();
  c10::intrusive_ptr<WorkRipples> work = ctx->work;
  for (auto& d : descs) {
    d.on_done = &onDone;
    d.done_arg = ctx;
    d.timeout_s = call.timeoutS;
  }
  ctx->descs = std::move(descs);
  const int n = static_cast<int>(ctx->descs.size());
  if (ctx->stage) {
    ctx->stage->markStaged();  // after the last toHost() of this call
  }
  rpl_status firstFail = RPL_OK;
  std::string failMsg;
  int accepted = 0;
  bool deferred = false;
  bool ranInline = false;
  {
    std::lock_guard<std::mutex> g(submitMu_);
    checkOpen(call.opName);
    ctx->seq = nextSeq_;
    ctx->pending.store(n + 1);
    // The first callback on the future: finish the Work and let the next operation complete.
    // Registered before anyone else can see the future, so it runs before user callbacks.
    {
      CompletionExecutor* exec = executor_.get();
      WorkRipples* w = work.get();  // kept alive by the OpContext while callbacks run
      const uint64_t seq = ctx->seq;
      work->getFuture()->addCallback(
          [exec, w, seq](c10::ivalue::Future& f) {
            try {
              w->finishFromExecutor(f.hasError() ? f.exception_ptr() : nullptr);
            } catch (...) {
            }
            exec->advanceTicket(seq);
          },
          /*uses_future=*/true);
    }
    // Staged operations (and any issued behind one) reach the core from the staging thread
    // once their device copies are done; from here on they complete like any other.
    deferred = ctx->stage != nullptr || !stager_->idle();
    if (deferred) {
      StagedSubmitter::Item item;
      item.stage = ctx->stage.get();
      item.submit = [this, ctx] {
        rpl_status st = RPL_OK;
        std::string msg;
        {
          std::lock_guard<std::mutex> g2(submitMu_);
          submitToCore(ctx, &st, &msg);
        }
        if (st != RPL_OK) {
          ctx->recordError(st, msg);
        }
        if (ctx->pending.fetch_sub(1) == 1) {
          ctx->executor->push(ctx);
        }
      };
      item.fail = [this, ctx](StagedSubmitter::Failure why, const std::string& msg) {
        failUnsubmitted(
            ctx, why == StagedSubmitter::Failure::kTimeout ? RPL_ERR_TIMEOUT : RPL_ERR_CLOSED,
            msg);
      };
      stager_->enqueue(std::move(item));
      ++nextSeq_;  // it always completes, with an error if it never reaches the core
    } else {
      ranInline = cfg_.inline_small && n == 1 && runInline(ctx, &firstFail, &failMsg);
      accepted = ranInline ? 1 : firstFail != RPL_OK ? 0 : submitToCore(ctx, &firstFail, &failMsg);
      if (accepted > 0 || n == 0) {
        ++nextSeq_;
      }
    }
  }
  if (!deferred && accepted == 0 && n > 0) {
    // Nothing reached the core: report synchronously; the context dies with `call`.
    if (firstFail == RPL_ERR_CLOSED) {
      C10_THROW_ERROR(Error, closedMessage(*group_, call.opName) + " [" + failMsg + "]");
    }
    throwStatus(
        firstFail,
        c10::str("ripples ", call.opName, ": ", failMsg, " (", rpl_status_name(firstFail), ")"));
  }
  call.ctx.release();  // owned by the staging thread / the core / the executor from here on
  if (deferred) {
    return work;
  }
  if (firstFail != RPL_OK) {
    ctx->recordError(firstFail, failMsg);
  }
  if (ctx->pending.fetch_sub(1) == 1) {
    if (ranInline) {
      ctx->executor->completeHere(ctx);  // no hand-off: the latency path's point
    } else {
      ctx->executor->push(ctx);
    }
  }
  return work;
}

bool ProcessGroupRipples::runInline(OpContext* ctx, rpl_status* st, std::string* msg) {
  if (!executor_->caughtUp(ctx->seq)) {
    return false;  // an earlier future is still completing: do not overtake it
  }
  rpl_error err;
  std::memset(&err, 0, sizeof(err));
  int ran = 0;
  rpl_status r = rpl_run_inline(comm_, &ctx->descs[0], &ran, &err);
  if (r != RPL_OK) {
    *st = r;
    *msg = err.msg;
    ctx->pending.fetch_sub(1);  // it will never call on_done
    return false;
  }
  return ran != 0;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::completedWork(
    c10d::OpType opType,
    const char* profilingTitle,
    const char* opName,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds opTimeout) {
  Call call =
      begin(opType, profilingTitle, opName, std::move(outputs), opTimeout, c10::Device(c10::kCPU));
  return submit(call, {});
}

int ProcessGroupRipples::submitToCore(OpContext* ctx, rpl_status* st, std::string* msg) {
  const int n = static_cast<int>(ctx->descs.size());
  int accepted = 0;
  for (int i = 0; i < n; ++i) {
    rpl_error err;
    std::memset(&err, 0, sizeof(err));
    rpl_status r = rpl_submit(comm_, &ctx->descs[i], &err);
    if (r != RPL_OK) {
      *st = r;
      *msg = err.msg;
      ctx->pending.fetch_sub(n - i);  // these will never call on_done
      break;
    }
    ++accepted;
  }
  return accepted;
}

void ProcessGroupRipples::failUnsubmitted(
    OpContext* ctx,
    rpl_status st,
    const std::string& msg) {
  ctx->recordError(st, msg);
  const int n = static_cast<int>(ctx->descs.size());
  if (ctx->pending.fetch_sub(n + 1) == n + 1) {
    ctx->executor->push(ctx);
  }
}

namespace {
rpl_op_desc makeDesc(rpl_op_kind kind) {
  rpl_op_desc d;
  std::memset(&d, 0, sizeof(d));
  d.kind = kind;
  return d;
}
}  // namespace

// ---- collectives -----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  static const char* op = "broadcast";
  checkOpen(op);
  TORCH_CHECK_VALUE(!tensors.empty(), "ripples broadcast: no tensor given");
  checkRank(opts.rootRank, size_, op, "root rank");
  TORCH_CHECK_VALUE(
      opts.rootTensor >= 0 && opts.rootTensor < static_cast<int64_t>(tensors.size()),
      "ripples broadcast: rootTensor ", opts.rootTensor, " is out of range for ",
      tensors.size(), " tensor(s)");
  const at::Tensor& src = tensors[opts.rootTensor];
  rpl_dtype d = checkTensor(src, op, "tensor");
  for (size_t i = 0; i < tensors.size(); ++i) {
    checkTensor(tensors[i], op, "tensors" + ordinal(i));
    checkSameDtype(tensors[i], src, op, "tensors" + ordinal(i), "the root tensor");
    checkNumel(tensors[i], src.numel(), op, "tensors" + ordinal(i), "as the root tensor");
  }

  Call call = begin(c10d::OpType::BROADCAST, "ripples:broadcast", op, tensors, opts.timeout,
      callDevice(op, {tensors}));
  rpl_buf b = call.inout(src, d, "tensor");
  // Legacy multi-tensor form (as gloo): the other local tensors receive the root tensor too.
  at::Tensor bufTensor = call.c().keepAlive.back();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (static_cast<int64_t>(i) != opts.rootTensor) {
      checkWritable(tensors[i], op, "tensors" + ordinal(i));
      call.c().copyBack.emplace_back(bufTensor, tensors[i]);
    }
  }
  call.c().in = {b};
  rpl_op_desc desc = makeDesc(RPL_OP_BROADCAST);
  desc.root = static_cast<int>(opts.rootRank);
  desc.in = call.c().in.data();
  desc.nin = 1;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  static const char* op = "allreduce";
  checkOpen(op);
  TORCH_CHECK_VALUE(
      tensors.size() == 1,
      "ripples allreduce: expects exactly one tensor, got ", tensors.size(),
      " (use allreduce_coalesced / all_reduce_coalesced for several tensors)");
  TORCH_CHECK_VALUE(
      !opts.sparseIndices.has_value(),
      "ripples allreduce: AllreduceOptions.sparseIndices is not supported (a sparse COO "
      "tensor is)");
  if (tensors[0].defined() && tensors[0].is_sparse()) {
    return sparseAllreduce(tensors[0], opts);
  }
  rpl_dtype d = checkTensor(tensors[0], op, "tensor");
  rpl_redop r = toRplRedop(opts.reduceOp, d, op);

  Call call = begin(c10d::OpType::ALLREDUCE, "ripples:all_reduce", op, tensors, opts.timeout,
      callDevice(op, {tensors}));
  call.c().in = {call.inout(tensors[0], d, "tensor")};
  rpl_op_desc desc = makeDesc(allreduceKind());
  desc.redop = r;
  desc.in = call.c().in.data();
  desc.nin = 1;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  static const char* op = "allreduce_coalesced";
  checkOpen(op);
  TORCH_CHECK_VALUE(!tensors.empty(), "ripples allreduce_coalesced: no tensors given");
  TORCH_CHECK_VALUE(
      tensors.size() <= static_cast<size_t>(INT32_MAX),
      "ripples allreduce_coalesced: too many tensors");
  std::vector<rpl_dtype> dts(tensors.size());
  rpl_redop r = RPL_SUM;
  for (size_t i = 0; i < tensors.size(); ++i) {
    dts[i] = checkTensor(tensors[i], op, "tensors" + ordinal(i));
    r = toRplRedop(opts.reduceOp, dts[i], op);
  }

  Call call = begin(
      c10d::OpType::ALLREDUCE_COALESCED, "ripples:all_reduce", op, tensors,
      opts.timeout, callDevice(op, {tensors}));
  for (size_t i = 0; i < tensors.size(); ++i) {
    call.c().in.push_back(call.inout(tensors[i], dts[i], "tensors" + ordinal(i)));
  }
  rpl_op_desc desc = makeDesc(allreduceKind());
  desc.redop = r;
  desc.in = call.c().in.data();
  desc.nin = static_cast<int>(call.c().in.size());
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  static const char* op = "reduce";
  checkOpen(op);
  TORCH_CHECK_VALUE(
      tensors.size() == 1, "ripples reduce: expects exactly one tensor, got ", tensors.size());
  TORCH_CHECK_VALUE(
      opts.rootTensor == 0, "ripples reduce: rootTensor must be 0, got ", opts.rootTensor);
  checkRank(opts.rootRank, size_, op, "root rank");
  rpl_dtype d = checkTensor(tensors[0], op, "tensor");
  rpl_redop r = toRplRedop(opts.reduceOp, d, op);

  Call call = begin(c10d::OpType::REDUCE, "ripples:reduce", op, tensors, opts.timeout,
      callDevice(op, {tensors}));
  call.c().in = {call.inout(tensors[0], d, "tensor")};
  rpl_op_desc desc = makeDesc(RPL_OP_REDUCE);
  desc.redop = r;
  desc.root = static_cast<int>(opts.rootRank);
  desc.in = call.c().in.data();
  desc.nin = 1;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allgather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllgatherOptions& opts) {
  static const char* op = "allgather";
  checkOpen(op);
  checkListSize(inputTensors.size(), 1, op, "the input list", "one tensor per process");
  checkListSize(outputTensors.size(), 1, op, "the output list of lists", "one list per process");
  auto& outs = outputTensors[0];
  checkListSize(outs.size(), size_, op, "the output list", "one tensor per rank of the group");
  const at::Tensor& input = inputTensors[0];
  rpl_dtype d = checkTensor(input, op, "the input tensor");
  for (size_t i = 0; i < outs.size(); ++i) {
    checkTensor(outs[i], op, "output" + ordinal(i));
    checkSameDtype(outs[i], input, op, "output" + ordinal(i), "the input tensor");
    checkNumel(outs[i], input.numel(), op, "output" + ordinal(i), "as the input tensor");
  }

  Call call = begin(c10d::OpType::ALLGATHER, "ripples:all_gather", op, outs, opts.timeout,
      callDevice(op, {inputTensors, outs}), inputTensors);
  call.c().in = {call.in(input, d)};
  for (size_t i = 0; i < outs.size(); ++i) {
    call.c().out.push_back(call.out(outs[i], d, "output" + ordinal(i)));
  }
  rpl_op_desc desc = makeDesc(RPL_OP_ALLGATHER);
  desc.in = call.c().in.data();
  desc.nin = 1;
  desc.out = call.c().out.data();
  desc.nout = static_cast<int>(call.c().out.size());
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::_allgather_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::AllgatherOptions& opts) {
  static const char* op = "allgather_into_tensor";
  checkOpen(op);
  rpl_dtype d = checkTensor(inputBuffer, op, "the input tensor");
  checkTensor(outputBuffer, op, "the output tensor");
  checkSameDtype(outputBuffer, inputBuffer, op, "the output tensor", "the input tensor");
  checkNumel(
      outputBuffer, inputBuffer.numel() * size_, op, "the output tensor",
      "group size x input elements");

  Call call = begin(
      c10d::OpType::_ALLGATHER_BASE, "ripples:_allgather_base", op, {outputBuffer},
      opts.timeout, callDevice(op, {inputBuffer, outputBuffer}));
  call.c().in = {call.in(inputBuffer, d)};
  call.c().out = call.split(outputBuffer, d, size_, false, true, "the output tensor");
  rpl_op_desc desc = makeDesc(RPL_OP_ALLGATHER);
  desc.in = call.c().in.data();
  desc.nin = 1;
  desc.out = call.c().out.data();
  desc.nout = size_;
  return submit(call, {desc});
}

// output_lists[r][j] receives rank r's inputs[j]: one core allgather per input tensor, all
// in one call (shapes and dtypes may differ between the inputs, as in gloo).
c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  static const char* op = "allgather_coalesced";
  checkOpen(op);
  checkListSize(outputLists.size(), size_, op, "the output list of lists",
                "one list per rank of the group");
  std::vector<rpl_dtype> dts(inputs.size());
  for (size_t j = 0; j < inputs.size(); ++j) {
    dts[j] = checkTensor(inputs[j], op, "inputs" + ordinal(j));
  }
  std::vector<at::Tensor> flat;
  for (size_t r = 0; r < outputLists.size(); ++r) {
    const std::string list = "output_lists" + ordinal(r);
    checkListSize(outputLists[r].size(), inputs.size(), op, list, "one tensor per input");
    for (size_t j = 0; j < inputs.size(); ++j) {
      const std::string what = list + ordinal(j);
      checkTensor(outputLists[r][j], op, what);
      checkSameDtype(outputLists[r][j], inputs[j], op, what, "inputs" + ordinal(j));
      checkNumel(outputLists[r][j], inputs[j].numel(), op, what, "as inputs" + ordinal(j));
      flat.push_back(outputLists[r][j]);
    }
  }

  Call call = begin(
      c10d::OpType::ALLGATHER_COALESCED, "ripples:all_gather", op, flat, opts.timeout,
      callDevice(op, {inputs, flat}), inputs);
  auto& ctx = call.c();
  ctx.in.reserve(inputs.size());
  ctx.out.reserve(inputs.size() * size_);
  for (size_t j = 0; j < inputs.size(); ++j) {
    ctx.in.push_back(call.in(inputs[j], dts[j]));
    for (int r = 0; r < size_; ++r) {
      ctx.out.push_back(call.out(outputLists[r][j], dts[j], "output_lists" + ordinal(r) + ordinal(j)));
    }
  }
  std::vector<rpl_op_desc> descs;
  for (size_t j = 0; j < inputs.size(); ++j) {
    rpl_op_desc desc = makeDesc(RPL_OP_ALLGATHER);
    desc.in = &ctx.in[j];
    desc.nin = 1;
    desc.out = &ctx.out[j * size_];
    desc.nout = size_;
    descs.push_back(desc);
  }
  return submit(call, std::move(descs));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  static const char* op = "allgather_into_tensor_coalesced";
  checkOpen(op);
  checkListSize(outputs.size(), inputs.size(), op, "the output list", "one per input tensor");
  std::vector<rpl_dtype> dts(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    dts[i] = checkTensor(inputs[i], op, "inputs" + ordinal(i));
    checkTensor(outputs[i], op, "outputs" + ordinal(i));
    checkSameDtype(outputs[i], inputs[i], op, "outputs" + ordinal(i), "inputs" + ordinal(i));
    checkNumel(
        outputs[i], inputs[i].numel() * size_, op, "outputs" + ordinal(i),
        "group size x elements of inputs" + ordinal(i));
  }

  Call call = begin(
      c10d::OpType::COALESCED, "ripples:allgather_into_tensor_coalesced", op, outputs,
      opts.timeout, callDevice(op, {inputs, outputs}));
  // One core allgather per pair; the buffers of pair i are in[i] and out[i*size ...].
  auto& ctx = call.c();
  ctx.in.reserve(inputs.size());
  ctx.out.reserve(inputs.size() * size_);
  for (size_t i = 0; i < inputs.size(); ++i) {
    ctx.in.push_back(call.in(inputs[i], dts[i]));
    auto parts = call.split(outputs[i], dts[i], size_, false, true, "outputs" + ordinal(i));
    ctx.out.insert(ctx.out.end(), parts.begin(), parts.end());
  }
  std::vector<rpl_op_desc> descs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    rpl_op_desc desc = makeDesc(RPL_OP_ALLGATHER);
    desc.in = &ctx.in[i];
    desc.nin = 1;
    desc.out = &ctx.out[i * size_];
    desc.nout = size_;
    descs.push_back(desc);
  }
  return submit(call, std::move(descs));
}

namespace {
// gather and scatter are mirror images: one tensor of this rank on every rank, and a list of one
// tensor per rank that only the root passes. The labels keep each op's own error messages.
struct RootedList {
  rpl_dtype dtype;                  // of this rank's tensor, which fixes the list's dtype
  std::vector<at::Tensor> tensors;  // the root's list; empty on the other ranks
};

RootedList checkRootedList(
    const char* opName,
    int64_t root,
    int rank,
    int size,
    const std::vector<at::Tensor>& mine,
    const char* mineSide,  // "input" for gather, "output" for scatter
    const std::vector<std::vector<at::Tensor>>& rooted,
    const char* rootedSide,  // the other side
    const char* listName) {  // the torch.distributed argument: "gather_list", "scatter_list"
  checkRank(root, size, opName, "root rank");
  checkListSize(
      mine.size(), 1, opName, std::string("the ") + mineSide + " list", "one tensor per process");
  const std::string mineWhat = std::string("the ") + mineSide + " tensor";
  const at::Tensor& t = mine[0];
  RootedList r;
  r.dtype = checkTensor(t, opName, mineWhat);
  if (root == rank) {
    checkListSize(
        rooted.size(), 1, opName, std::string("the ") + rootedSide + " list of lists on the root",
        "one list per process");
    r.tensors = rooted[0];
    checkListSize(
        r.tensors.size(), size, opName, std::string(listName) + " on the root",
        "one tensor per rank of the group");
    for (size_t i = 0; i < r.tensors.size(); ++i) {
      const std::string what = listName + ordinal(i);
      checkTensor(r.tensors[i], opName, what);
      checkSameDtype(r.tensors[i], t, opName, what, mineWhat);
      checkNumel(r.tensors[i], t.numel(), opName, what, "as " + mineWhat);
    }
  } else {
    TORCH_CHECK_VALUE(
        rooted.empty() || (rooted.size() == 1 && rooted[0].empty()),
        "ripples ", opName, ": only the root (rank ", root, ") may pass a ", listName, "; rank ",
        rank, " passed one");
  }
  return r;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::gather(
    std::vector<std::vector<at::Tensor>>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::GatherOptions& opts) {
  static const char* op = "gather";
  checkOpen(op);
  RootedList rl = checkRootedList(
      op, opts.rootRank, rank_, size_, inputTensors, "input", outputTensors, "output",
      "gather_list");
  const at::Tensor& input = inputTensors[0];
  const rpl_dtype d = rl.dtype;
  const std::vector<at::Tensor>& outs = rl.tensors;

  Call call = begin(c10d::OpType::GATHER, "ripples:gather", op, outs, opts.timeout,
      callDevice(op, {inputTensors, outs}));
  call.c().in = {call.in(input, d)};
  for (size_t i = 0; i < outs.size(); ++i) {
    call.c().out.push_back(call.out(outs[i], d, "gather_list" + ordinal(i)));
  }
  rpl_op_desc desc = makeDesc(RPL_OP_GATHER);
  desc.root = static_cast<int>(opts.rootRank);
  desc.in = call.c().in.data();
  desc.nin = 1;
  desc.out = call.c().out.empty() ? nullptr : call.c().out.data();
  desc.nout = static_cast<int>(call.c().out.size());
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ScatterOptions& opts) {
  static const char* op = "scatter";
  checkOpen(op);
  RootedList rl = checkRootedList(
      op, opts.rootRank, rank_, size_, outputTensors, "output", inputTensors, "input",
      "scatter_list");
  const at::Tensor& output = outputTensors[0];
  const rpl_dtype d = rl.dtype;
  const std::vector<at::Tensor>& ins = rl.tensors;

  Call call = begin(c10d::OpType::SCATTER, "ripples:scatter", op, outputTensors, opts.timeout,
      callDevice(op, {outputTensors, ins}));
  for (size_t i = 0; i < ins.size(); ++i) {
    call.c().in.push_back(call.in(ins[i], d));
  }
  call.c().out = {call.out(output, d, "the output tensor")};
  rpl_op_desc desc = makeDesc(RPL_OP_SCATTER);
  desc.root = static_cast<int>(opts.rootRank);
  desc.in = call.c().in.empty() ? nullptr : call.c().in.data();
  desc.nin = static_cast<int>(call.c().in.size());
  desc.out = call.c().out.data();
  desc.nout = 1;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::reduce_scatter(
    std::vector<at::Tensor>& outputTensors,
    std::vector<std::vector<at::Tensor>>& inputTensors,
    const c10d::ReduceScatterOptions& opts) {
  static const char* op = "reduce_scatter";
  checkOpen(op);
  checkListSize(outputTensors.size(), 1, op, "the output list", "one tensor per process");
  checkListSize(inputTensors.size(), 1, op, "the input list of lists", "one list per process");
  const at::Tensor& output = outputTensors[0];
  auto& ins = inputTensors[0];
  checkListSize(ins.size(), size_, op, "the input list", "one tensor per rank of the group");
  rpl_dtype d = checkTensor(output, op, "the output tensor");
  for (size_t i = 0; i < ins.size(); ++i) {
    checkTensor(ins[i], op, "input" + ordinal(i));
    checkSameDtype(ins[i], output, op, "input" + ordinal(i), "the output tensor");
    checkNumel(ins[i], output.numel(), op, "input" + ordinal(i), "as the output tensor");
  }
  rpl_redop r = toRplRedop(opts.reduceOp, d, op);

  Call call = begin(
      c10d::OpType::REDUCE_SCATTER, "ripples:reduce_scatter", op, outputTensors, opts.timeout,
      callDevice(op, {outputTensors, ins}));
  for (size_t i = 0; i < ins.size(); ++i) {
    call.c().in.push_back(call.in(ins[i], d));
  }
  call.c().out = {call.out(output, d, "the output tensor")};
  rpl_op_desc desc = makeDesc(RPL_OP_REDUCE_SCATTER);
  desc.redop = r;
  desc.in = call.c().in.data();
  desc.nin = size_;
  desc.out = call.c().out.data();
  desc.nout = 1;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::_reduce_scatter_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    const c10d::ReduceScatterOptions& opts) {
  static const char* op = "reduce_scatter_tensor";
  checkOpen(op);
  rpl_dtype d = checkTensor(outputBuffer, op, "the output tensor");
  checkTensor(inputBuffer, op, "the input tensor");
  checkSameDtype(inputBuffer, outputBuffer, op, "the input tensor", "the output tensor");
  checkNumel(
      inputBuffer, outputBuffer.numel() * size_, op, "the input tensor",
      "group size x output elements");
  rpl_redop r = toRplRedop(opts.reduceOp, d, op);

  Call call = begin(
      c10d::OpType::_REDUCE_SCATTER_BASE, "ripples:_reduce_scatter_base", op, {outputBuffer},
      opts.timeout, callDevice(op, {inputBuffer, outputBuffer}));
  call.c().in = call.split(inputBuffer, d, size_, true, false, "the input tensor");
  call.c().out = {call.out(outputBuffer, d, "the output tensor")};
  rpl_op_desc desc = makeDesc(RPL_OP_REDUCE_SCATTER);
  desc.redop = r;
  desc.in = call.c().in.data();
  desc.nin = size_;
  desc.out = call.c().out.data();
  desc.nout = 1;
  return submit(call, {desc});
}

namespace {
// Element counts of each rank's slice of `t` along dim 0 (equal slices if `splits` is empty).
std::vector<size_t> splitCounts(
    const at::Tensor& t,
    const std::vector<int64_t>& splits,
    int size,
    const char* opName,
    const char* what) {
  std::vector<size_t> counts(size, 0);
  if (t.numel() == 0 && splits.empty()) {
    return counts;
  }
  TORCH_CHECK_VALUE(
      t.dim() >= 1, "ripples ", opName, ": the ", what,
      " tensor must have at least one dimension to be split among ranks");
  const int64_t rows = t.size(0);
  const int64_t rowElems = rows > 0 ? t.numel() / rows : 0;
  if (splits.empty()) {
    TORCH_CHECK_VALUE(
        rows % size == 0, "ripples ", opName, ": the ", what, " tensor's first dimension (",
        rows, ") must be divisible by the group size (", size,
        ") when no split sizes are given");
    for (int r = 0; r < size; ++r) {
      counts[r] = static_cast<size_t>(rows / size * rowElems);
    }
    return counts;
  }
  TORCH_CHECK_VALUE(
      splits.size() == static_cast<size_t>(size), "ripples ", opName, ": ", what,
      " split sizes have ", splits.size(), " entries but the group has ", size, " ranks");
  // Each split in [0, rows] before any arithmetic, so that neither the sum (at most size * rows)
  // nor split * rowElems (at most numel) can overflow; both are checked all the same.
  int64_t total = 0;
  for (int r = 0; r < size; ++r) {
    TORCH_CHECK_VALUE(
        splits[r] >= 0, "ripples ", opName, ": ", what, " split size [", r, "] is negative (",
        splits[r], ")");
    TORCH_CHECK_VALUE(
        splits[r] <= rows, "ripples ", opName, ": ", what, " split size [", r, "] (",
        splits[r], ") is larger than the tensor's first dimension (", rows, ")");
    int64_t elems = 0;
    TORCH_CHECK_VALUE(
        !__builtin_add_overflow(total, splits[r], &total) &&
            !__builtin_mul_overflow(splits[r], rowElems, &elems),
        "ripples ", opName, ": ", what, " split sizes overflow at entry [", r, "] (",
        splits[r], ")");
    counts[r] = static_cast<size_t>(elems);
  }
  TORCH_CHECK_VALUE(
      total == rows, "ripples ", opName, ": ", what, " split sizes add up to ", total,
      " but the tensor's first dimension is ", rows);
  return counts;
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::alltoall_base(
    at::Tensor& outputBuffer,
    at::Tensor& inputBuffer,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  static const char* op = "all_to_all_single";
  checkOpen(op);
  rpl_dtype d = checkTensor(inputBuffer, op, "the input tensor");
  checkTensor(outputBuffer, op, "the output tensor");
  checkSameDtype(outputBuffer, inputBuffer, op, "the output tensor", "the input tensor");
  std::vector<size_t> inCounts = splitCounts(inputBuffer, inputSplitSizes, size_, op, "input");
  std::vector<size_t> outCounts =
      splitCounts(outputBuffer, outputSplitSizes, size_, op, "output");

  Call call = begin(
      c10d::OpType::ALLTOALL_BASE, "ripples:all_to_all", op, {outputBuffer}, opts.timeout,
      callDevice(op, {inputBuffer, outputBuffer}));
  // Whole tensors (staged if needed), then per-rank slices at running offsets.
  rpl_buf inAll = call.in(inputBuffer, d);
  rpl_buf outAll = call.out(outputBuffer, d, "the output tensor");
  const size_t esz = inputBuffer.element_size();
  size_t inOff = 0, outOff = 0;
  for (int r = 0; r < size_; ++r) {
    rpl_buf bi{inCounts[r] ? static_cast<char*>(inAll.ptr) + inOff * esz : nullptr,
               inCounts[r], d};
    rpl_buf bo{outCounts[r] ? static_cast<char*>(outAll.ptr) + outOff * esz : nullptr,
               outCounts[r], d};
    inOff += inCounts[r];
    outOff += outCounts[r];
    call.c().in.push_back(bi);
    call.c().out.push_back(bo);
  }
  rpl_op_desc desc = makeDesc(RPL_OP_ALLTOALL);
  desc.in = call.c().in.data();
  desc.nin = size_;
  desc.out = call.c().out.data();
  desc.nout = size_;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::alltoall(
    std::vector<at::Tensor>& outputTensors,
    std::vector<at::Tensor>& inputTensors,
    const c10d::AllToAllOptions& opts) {
  static const char* op = "all_to_all";
  checkOpen(op);
  checkListSize(inputTensors.size(), size_, op, "the input list", "one tensor per rank");
  checkListSize(outputTensors.size(), size_, op, "the output list", "one tensor per rank");
  rpl_dtype d = checkTensor(inputTensors[0], op, "input" + ordinal(0));
  for (int i = 0; i < size_; ++i) {
    checkTensor(inputTensors[i], op, "input" + ordinal(i));
    checkTensor(outputTensors[i], op, "output" + ordinal(i));
    checkSameDtype(inputTensors[i], inputTensors[0], op, "input" + ordinal(i), "input[0]");
    checkSameDtype(outputTensors[i], inputTensors[0], op, "output" + ordinal(i), "input[0]");
  }

  Call call = begin(c10d::OpType::ALLTOALL, "ripples:all_to_all", op, outputTensors, opts.timeout,
      callDevice(op, {inputTensors, outputTensors}));
  for (int i = 0; i < size_; ++i) {
    call.c().in.push_back(call.in(inputTensors[i], d));
    call.c().out.push_back(call.out(outputTensors[i], d, "output" + ordinal(i)));
  }
  rpl_op_desc desc = makeDesc(RPL_OP_ALLTOALL);
  desc.in = call.c().in.data();
  desc.nin = size_;
  desc.out = call.c().out.data();
  desc.nout = size_;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::send(
    std::vector<at::Tensor>& tensors,
    int dstRank,
    int tag) {
  static const char* op = "send";
  checkOpen(op);
  TORCH_CHECK_VALUE(
      tensors.size() == 1, "ripples send: expects exactly one tensor, got ", tensors.size());
  checkRank(dstRank, size_, op, "destination rank");
  TORCH_CHECK_VALUE(
      dstRank != rank_, "ripples send: rank ", rank_, " cannot send to itself");
  rpl_dtype d = checkTensor(tensors[0], op, "tensor");

  Call call = begin(
      c10d::OpType::SEND, "ripples:send", op, tensors, std::chrono::milliseconds::zero(),
      callDevice(op, {tensors}));
  call.c().in = {call.in(tensors[0], d)};
  rpl_op_desc desc = makeDesc(RPL_OP_SEND);
  desc.root = dstRank;
  desc.tag = tag;
  desc.in = call.c().in.data();
  desc.nin = 1;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::recv(
    std::vector<at::Tensor>& tensors,
    int srcRank,
    int tag) {
  static const char* op = "recv";
  checkOpen(op);
  TORCH_CHECK_VALUE(
      tensors.size() == 1, "ripples recv: expects exactly one tensor, got ", tensors.size());
  checkRank(srcRank, size_, op, "source rank");
  TORCH_CHECK_VALUE(
      srcRank != rank_, "ripples recv: rank ", rank_, " cannot receive from itself");
  rpl_dtype d = checkTensor(tensors[0], op, "tensor");

  Call call = begin(
      c10d::OpType::RECV, "ripples:recv", op, tensors, std::chrono::milliseconds::zero(),
      callDevice(op, {tensors}));
  call.c().out = {call.out(tensors[0], d, "tensor")};
  rpl_op_desc desc = makeDesc(RPL_OP_RECV);
  desc.root = srcRank;
  desc.tag = tag;
  desc.out = call.c().out.data();
  desc.nout = 1;
  call.c().work->setSourceRank(srcRank);
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::recvAnysource(
    std::vector<at::Tensor>& tensors,
    int tag) {
  static const char* op = "recv (any source)";
  checkOpen(op);
  TORCH_CHECK_VALUE(
      tensors.size() == 1, "ripples recv: expects exactly one tensor, got ", tensors.size());
  TORCH_CHECK_VALUE(size_ > 1, "ripples recv: no other rank to receive from in a group of 1");
  rpl_dtype d = checkTensor(tensors[0], op, "tensor");

  Call call = begin(
      c10d::OpType::RECVANYSOURCE, "ripples:recvAnySource", op, tensors,
      std::chrono::milliseconds::zero(), callDevice(op, {tensors}));
  call.c().out = {call.out(tensors[0], d, "tensor")};
  rpl_op_desc desc = makeDesc(RPL_OP_RECV);
  desc.root = RPL_ANY_SOURCE;
  desc.tag = tag;
  desc.out = call.c().out.data();
  desc.nout = 1;
  desc.source = &call.c().source;
  return submit(call, {desc});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::barrier(const c10d::BarrierOptions& opts) {
  static const char* op = "barrier";
  checkOpen(op);
  Call call = begin(c10d::OpType::BARRIER, "ripples:barrier", op, {}, opts.timeout,
      c10::Device(c10::kCPU));
  rpl_op_desc desc = makeDesc(RPL_OP_BARRIER);
  return submit(call, {desc});
}

c10::intrusive_ptr<ProcessGroupRipples> createProcessGroupRipples(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const Config& cfg) {
  return c10::make_intrusive<ProcessGroupRipples>(store, rank, size, cfg);
}

}  // namespace ripples
