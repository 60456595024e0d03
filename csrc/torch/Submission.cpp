// Submission: see Submission.hpp. The Call's staging of tensors, and the submission path of
// ProcessGroupRipples (begin, post, submit and the core hand-offs behind them).
#include "Submission.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "Errors.hpp"
#include "ProcessGroupRipples.hpp"
#include "TensorArgs.hpp"

namespace ripples {

rpl_op_desc makeDesc(rpl_op_kind kind) {
  rpl_op_desc d;
  std::memset(&d, 0, sizeof(d));
  d.kind = kind;
  return d;
}

// ---- Call --------------------------------------------------------------------------------------

at::Tensor Call::hostTensor(
    const at::Tensor& t,
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
               : at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
    }
    if (write) {
      ctx->copyBack.emplace_back(c, t);
    }
  }
  ctx->keepAlive.push_back(c);
  return c;
}

void Call::in(const at::Tensor& t, rpl_dtype d) {
  ctx->in.push_back(bufOf(hostTensor(t, true, false, ""), d));
}

at::Tensor Call::inout(const at::Tensor& t, rpl_dtype d, const std::string& what) {
  at::Tensor c = hostTensor(t, true, true, what);
  ctx->in.push_back(bufOf(c, d));
  return c;
}

void Call::out(const at::Tensor& t, rpl_dtype d, const std::string& what) {
  ctx->out.push_back(bufOf(hostTensor(t, false, true, what), d));
}

void Call::slices(
    const at::Tensor& c,
    rpl_dtype d,
    const std::vector<size_t>& counts,
    std::vector<rpl_buf>& into) {
  char* base = c.numel() ? static_cast<char*>(c.data_ptr()) : nullptr;
  const size_t esz = c.element_size();
  size_t off = 0;
  for (size_t n : counts) {
    into.push_back(rpl_buf{n ? base + off * esz : nullptr, n, d});
    off += n;
  }
}

void Call::inSlices(const at::Tensor& t, rpl_dtype d, const std::vector<size_t>& counts) {
  slices(hostTensor(t, true, false, ""), d, counts, ctx->in);
}

void Call::outSlices(
    const at::Tensor& t,
    rpl_dtype d,
    const std::vector<size_t>& counts,
    const std::string& what) {
  slices(hostTensor(t, false, true, what), d, counts, ctx->out);
}

void Call::copyTo(const at::Tensor& from, const at::Tensor& dest, const std::string& what) {
  checkWritable(dest, opName, what);
  ctx->copyBack.emplace_back(from, dest);
}

void Call::setSource(int rank) {
  ctx->work->setSourceRank(rank);
}

void Call::reportSource() {
  for (rpl_op_desc& d : ctx->descs) {
    d.source = &ctx->source;
  }
}

// ---- the submission path -----------------------------------------------------------------------

void ProcessGroupRipples::checkOpen(const char* opName) const {
  TORCH_CHECK(!shutdown_.load(), closedMessage(group_->name, opName));
}

Call ProcessGroupRipples::begin(
    const Entry& entry,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds opTimeout,
    c10::Device device,
    std::optional<std::vector<at::Tensor>> profiled) {
  checkOpen(entry.name);
  const bool p2p = entry.type == c10d::OpType::SEND || entry.type == c10d::OpType::RECV;
  const uint64_t seq = p2p ? collSeq_.load() : ++collSeq_;
  Call call;
  call.opName = entry.name;
  call.ctx = std::make_unique<OpContext>();
  if (!device.is_cpu() || debugStageCpu(calls_++)) {
    // Created before any tensor is staged: its side stream waits for the caller's stream.
    call.ctx->stage = std::make_shared<DeviceStage>(device, sideStreams_.get(device));
    ++staged_;
  }
  call.ctx->work = c10::make_intrusive<WorkRipples>(
      getRank(), entry.type, entry.title, entry.name, std::move(outputs), group_,
      opTimeout.count() > 0 ? opTimeout : std::chrono::milliseconds::zero(), seq, device,
      call.ctx->stage, profiled);
  call.ctx->executor = executor_;
  call.ctx->group = group_;
  // torch's "unset" is negative; the core takes 0 for "the communicator's timeout".
  call.timeoutS = opTimeout.count() > 0 ? static_cast<double>(opTimeout.count()) / 1000.0 : 0;
  return call;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::post(
    const Entry& entry,
    std::chrono::milliseconds timeout,
    std::vector<at::Tensor> outputs,
    std::initializer_list<c10::ArrayRef<at::Tensor>> tensors,
    std::vector<rpl_op_desc> descs,
    c10::function_ref<void(Call&)> stage,
    std::optional<std::vector<at::Tensor>> profiled) {
  const c10::Device device = callDevice(entry.name, tensors);
  Call call = begin(entry, std::move(outputs), timeout, device, std::move(profiled));
  call.ctx->descs = std::move(descs);
  stage(call);
  return submit(call);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::completedWork(
    c10d::OpType opType,
    const char* profilingTitle,
    const char* opName,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds opTimeout) {
  return post(
      Entry{opType, profilingTitle, opName}, opTimeout, std::move(outputs), {}, {},
      [](Call&) {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::submit(Call& call) {
  OpContext* ctx = call.ctx.get();
  c10::intrusive_ptr<WorkRipples> work = ctx->work;
  const int n = static_cast<int>(ctx->descs.size());
  // Operation i of n gets the i-th of n equal shares of the staged inputs and outputs.
  const size_t nin = n > 0 ? ctx->in.size() / n : 0;
  const size_t nout = n > 0 ? ctx->out.size() / n : 0;
  TORCH_INTERNAL_ASSERT(nin * n == ctx->in.size() && nout * n == ctx->out.size());
  for (int i = 0; i < n; ++i) {
    rpl_op_desc& d = ctx->descs[i];
    d.in = nin > 0 ? &ctx->in[i * nin] : nullptr;
    d.nin = static_cast<int>(nin);
    d.out = nout > 0 ? &ctx->out[i * nout] : nullptr;
    d.nout = static_cast<int>(nout);
    d.on_done = &onDone;
    d.done_arg = ctx;
    d.timeout_s = call.timeoutS;
  }
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
        ctx->finishParts(1);
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
    throwRefused(group_->name, call.opName, firstFail, failMsg);
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
  ctx->finishParts(static_cast<int>(ctx->descs.size()) + 1);
}

}  // namespace ripples
