// RipplesWork: see RipplesWork.hpp (completion and threading).
#include "RipplesWork.hpp"

#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <algorithm>
#include <thread>

#include "Errors.hpp"

namespace ripples {

namespace {
thread_local CompletionExecutor* tlExecutor = nullptr;
}  // namespace

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Runs on the core's progress thread: record, hand over, return. Never throws.
void onDone(void* arg, rpl_status status, const rpl_error* err) {
  auto* ctx = static_cast<OpContext*>(arg);
  ctx->group->last_done_ns.store(nowNs());
  if (status != RPL_OK) {
    ctx->recordError(status, err != nullptr ? err->msg : rpl_status_name(status));
  }
  ctx->finishParts(1);
}

// ---- OpContext ---------------------------------------------------------------------------------

void OpContext::recordError(rpl_status st, const std::string& msg) {
  std::lock_guard<std::mutex> g(errMu);
  if (status == RPL_OK) {
    status = st;
    errMsg = msg;
  }
}

bool OpContext::failed() {
  std::lock_guard<std::mutex> g(errMu);
  return status != RPL_OK;
}

void OpContext::finishParts(int n) {
  if (pending.fetch_sub(n) == n) {
    executor->push(this);
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
    if (stage_) {
      stage_->blockCurrentStream();  // copies issued before the failure come first
    }
    std::rethrow_exception(exception_);
  }
  lock.unlock();
  synchronize();
  return true;
}

void WorkRipples::synchronize() {
  // Also after an error: "done" then follows whatever copies back were issued (see process()).
  if (stage_ && isCompleted()) {
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
        ctx->status, failureMessage(ctx->group->name, work->opName(), ctx->status, ctx->errMsg));
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
          c10::InferenceMode writeAnyTensor;  // as DeviceStage::copyBack: not the caller's thread
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
  if (eptr && ctx->stage) {
    // A pipelined call that failed midway may have issued copies of its first chunks back on
    // the side stream: "done" follows them, and wait() makes the caller's stream wait for it
    // even on error, so they never land under the caller's later work (a recovery, a retry).
    try {
      ctx->stage->markDone();
    } catch (...) {
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

}  // namespace ripples
