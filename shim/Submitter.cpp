// Submitter: see Submitter.hpp. A call's way from post() to the core, and the callbacks of a
// pipelined call's chunks.
#include "Submitter.hpp"

#include <c10/util/Exception.h>

#include <cstring>

#include "Errors.hpp"
#include "TensorArgs.hpp"

namespace ripples {

namespace {
// Issues chunk k's copies back (on the staging thread), unless the call failed already: a
// failed call copies nothing more (chunks before the failure may have been written back).
void copyChunkBack(OpContext* ctx, size_t k) {
  if (ctx->failed()) {
    return;
  }
  try {
    for (const ChunkCopy& cc : ctx->chunks[k]) {
      if (cc.write) {
        ctx->stage->copyBack(cc.host, cc.dev);
      }
    }
  } catch (const std::exception& e) {
    ctx->recordError(
        RPL_ERR_SYSTEM, std::string("copying its results back to the device failed: ") + e.what());
  } catch (...) {  // a task must not throw (StagedSubmitter::post): the call would never end
    ctx->recordError(RPL_ERR_SYSTEM, "copying its results back to the device failed");
  }
}

// on_done of a pipelined call's chunk (core progress thread): records, hands the copy back to
// the staging thread, returns. The chunk counts as finished only once its copy is issued, so
// the executor's "done" event follows every copy. Never throws.
void onChunkDone(void* arg, rpl_status status, const rpl_error* err) {
  auto* cd = static_cast<OpContext::ChunkDone*>(arg);
  OpContext* ctx = cd->ctx;
  const size_t k = cd->k;
  ctx->group->last_done_ns.store(nowNs());
  try {
    if (status != RPL_OK) {
      std::string msg = err != nullptr ? err->msg : rpl_status_name(status);
      if (status == RPL_ERR_MISMATCH) {
        // The likeliest cause where it is pipelining's: ranks that cut differently.
        msg += " (this call was pipelined in chunks of " + std::to_string(ctx->chunkBytes) +
            " bytes: every rank must set the same stage_chunk_bytes and pass tensors on the "
            "same kind of device, or set stage_chunk_bytes=0)";
      }
      ctx->recordError(status, msg);
    }
    if (ctx->stager->post([ctx, k] {
          copyChunkBack(ctx, k);
          ctx->finishParts(1);
        })) {
      return;
    }
    ctx->recordError(
        RPL_ERR_CLOSED,
        "the process group shut down before its results were copied back to the device");
  } catch (...) {
    ctx->recordError(RPL_ERR_NOMEM, "out of memory completing a pipelined chunk");
  }
  ctx->finishParts(1);  // never as if the copy had been made: the error is recorded
}
}  // namespace

Submitter::Submitter(
    const Config& cfg,
    rpl_comm* comm,
    std::shared_ptr<GroupShared> group,
    std::shared_ptr<CompletionExecutor> executor)
    : comm_(comm),
      group_(std::move(group)),
      executor_(std::move(executor)),
      stageChunkBytes_(cfg.stage_chunk_bytes),
      inlineSmall_(cfg.inline_small),
      stager_(cfg.timeout_s) {}

c10::intrusive_ptr<c10d::Work> Submitter::post(
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
  call.pipelineBytes = pipelineChunkBytes(call);
  stage(call);
  return submit(call);
}

c10::intrusive_ptr<c10d::Work> Submitter::completedWork(
    const Entry& entry,
    std::vector<at::Tensor> outputs,
    std::chrono::milliseconds timeout) {
  return post(entry, timeout, std::move(outputs), {}, {}, [](Call&) {});
}

void Submitter::checkOpen(const char* opName) const {
  TORCH_CHECK(!closed_.load(), closedMessage(group_->name, opName));
}

Call Submitter::begin(
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
      group_->rank, entry.type, entry.title, entry.name, std::move(outputs), group_,
      opTimeout.count() > 0 ? opTimeout : std::chrono::milliseconds::zero(), seq, device,
      call.ctx->stage, profiled);
  call.ctx->executor = executor_;
  call.ctx->group = group_;
  // torch's "unset" is negative; the core takes 0 for "the communicator's timeout".
  call.timeoutS = opTimeout.count() > 0 ? static_cast<double>(opTimeout.count()) / 1000.0 : 0;
  return call;
}

size_t Submitter::pipelineChunkBytes(const Call& call) const {
  const OpContext& c = *call.ctx;
  if (stageChunkBytes_ == 0 || !c.stage || c.descs.size() != 1) {
    return 0;
  }
  // Only where a chunk can be a core operation of its own with the same result: an exact
  // all-reduce (elementwise) or broadcast. A partial round must stay one round (its chunks
  // could be placed in different groups); the other collectives are left whole.
  const rpl_op_kind k = c.descs[0].kind;
  return k == RPL_OP_ALLREDUCE || k == RPL_OP_BROADCAST ? stageChunkBytes_ : 0;
}

// A submission in four steps, each its own function: bind the descriptors to the staged
// buffers, register the completion callback, hand the call off (the staging thread, the
// latency path or the core's queue), then finish (a synchronous refusal, or the completion).
c10::intrusive_ptr<c10d::Work> Submitter::submit(Call& call) {
  OpContext* ctx = call.ctx.get();
  c10::intrusive_ptr<WorkRipples> work = ctx->work;
  if (call.pipelineBytes > 0 && !call.cutIntoChunks()) {
    call.stageWhole();
  }
  const bool pipelined = !ctx->chunks.empty();
  bindDescs(call, pipelined);
  if (ctx->stage) {
    ctx->stage->markStaged();  // after the last toHost() of this call
  }
  Handoff h;
  {
    std::lock_guard<std::mutex> g(submitMu_);
    checkOpen(call.opName);
    ctx->seq = nextSeq_;
    ctx->pending.store(static_cast<int>(ctx->descs.size()) + 1);
    registerCompletion(ctx);
    h = handOff(ctx, pipelined);
  }
  finishSubmit(call, h);
  return work;
}

void Submitter::bindDescs(Call& call, bool pipelined) {
  OpContext* ctx = call.ctx.get();
  const int n = static_cast<int>(ctx->descs.size());
  if (pipelined) {
    // Chunk k (its buffers set by cutIntoChunks) completes through onChunkDone.
    for (int i = 0; i < n; ++i) {
      rpl_op_desc& d = ctx->descs[i];
      d.on_done = &onChunkDone;
      d.done_arg = &ctx->chunkDone[i];
      d.timeout_s = call.timeoutS;
    }
    ctx->stager = &stager_;
    ++pipelined_;
    stageChunks_ += static_cast<uint64_t>(n);
    return;
  }
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
}

void Submitter::registerCompletion(OpContext* ctx) {
  // The first callback on the future: finish the Work and let the next operation complete.
  // Registered before anyone else can see the future, so it runs before user callbacks.
  CompletionExecutor* exec = executor_.get();
  WorkRipples* w = ctx->work.get();  // kept alive by the OpContext while callbacks run
  const uint64_t seq = ctx->seq;
  ctx->work->getFuture()->addCallback(
      [exec, w, seq](c10::ivalue::Future& f) {
        try {
          w->finishFromExecutor(f.hasError() ? f.exception_ptr() : nullptr);
        } catch (...) {
        }
        exec->advanceTicket(seq);
      },
      /*uses_future=*/true);
}

Submitter::Handoff Submitter::handOff(OpContext* ctx, bool pipelined) {
  Handoff h;
  // Staged operations (and any issued behind one) reach the core from the staging thread
  // once their device copies are done; from here on they complete like any other.
  h.deferred = ctx->stage != nullptr || !stager_.idle();
  if (h.deferred) {
    stager_.enqueue(pipelined ? pipelinedItem(ctx) : stagedItem(ctx));
    ++nextSeq_;  // it always completes, with an error if it never reaches the core
    return h;
  }
  const int n = static_cast<int>(ctx->descs.size());
  // The latency path only for what may take it: one operation, inline calls allowed, and no
  // earlier future still completing (never overtake it). The core decides the rest.
  if (inlineSmall_ && n == 1 && executor_->caughtUp(ctx->seq)) {
    h.accepted = submitInline(ctx, &h.ranInline, &h.firstFail, &h.failMsg);
  } else {
    h.accepted = submitToCore(ctx, &h.firstFail, &h.failMsg);
  }
  if (h.accepted > 0 || n == 0) {
    ++nextSeq_;
  }
  return h;
}

void Submitter::finishSubmit(Call& call, const Handoff& h) {
  OpContext* ctx = call.ctx.get();
  if (!h.deferred && h.accepted == 0 && !ctx->descs.empty()) {
    // Nothing reached the core: report synchronously; the context dies with `call`.
    throwRefused(group_->name, call.opName, h.firstFail, h.failMsg);
  }
  call.ctx.release();  // owned by the staging thread / the core / the executor from here on
  if (h.deferred) {
    return;
  }
  if (h.firstFail != RPL_OK) {
    ctx->recordError(h.firstFail, h.failMsg);
  }
  if (ctx->pending.fetch_sub(1) == 1) {
    if (h.ranInline) {
      ctx->executor->completeHere(ctx);  // no hand-off: the latency path's point
    } else {
      ctx->executor->push(ctx);
    }
  }
}

int Submitter::submitInline(
    OpContext* ctx,
    bool* ranHere,
    rpl_status* st,
    std::string* msg) {
  rpl_error err;
  std::memset(&err, 0, sizeof(err));
  int ran = 0;
  rpl_status r = rpl_submit_inline(comm_, &ctx->descs[0], &ran, &err);
  if (r != RPL_OK) {
    *st = r;
    *msg = err.msg;
    ctx->pending.fetch_sub(1);  // it will never call on_done
    return 0;
  }
  *ranHere = ran != 0;
  return 1;
}

int Submitter::submitToCore(OpContext* ctx, rpl_status* st, std::string* msg) {
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

StagedSubmitter::Item Submitter::pipelinedItem(OpContext* ctx) {
  const size_t n = ctx->descs.size();
  StagedSubmitter::Item item;
  item.stage = ctx->stage.get();
  item.parts = n;
  item.submitPart = [this, ctx, n](size_t k) {
    rpl_error err;
    std::memset(&err, 0, sizeof(err));
    rpl_status st;
    {
      std::lock_guard<std::mutex> g(submitMu_);
      st = rpl_submit(comm_, &ctx->descs[k], &err);
    }
    if (st == RPL_OK) {
      return true;
    }
    ctx->recordError(st, err.msg);
    ctx->finishParts(static_cast<int>(n - k));  // chunks k.. never reach the core
    return false;
  };
  item.submit = [ctx] { ctx->finishParts(1); };  // the submitting thread's part
  item.fail = [ctx, n](StagedSubmitter::Failure why, const std::string& msg, size_t from) {
    ctx->recordError(StagedSubmitter::statusOf(why), msg);
    ctx->finishParts(static_cast<int>(n - from) + 1);
  };
  return item;
}

StagedSubmitter::Item Submitter::stagedItem(OpContext* ctx) {
  StagedSubmitter::Item item;
  item.stage = ctx->stage.get();
  item.submit = [this, ctx] {
    rpl_status st = RPL_OK;
    std::string msg;
    {
      std::lock_guard<std::mutex> g(submitMu_);
      submitToCore(ctx, &st, &msg);
    }
    if (st != RPL_OK) {
      ctx->recordError(st, msg);
    }
    ctx->finishParts(1);
  };
  item.fail = [this, ctx](StagedSubmitter::Failure why, const std::string& msg, size_t) {
    failUnsubmitted(ctx, StagedSubmitter::statusOf(why), msg);
  };
  return item;
}

void Submitter::failUnsubmitted(
    OpContext* ctx,
    rpl_status st,
    const std::string& msg) {
  ctx->recordError(st, msg);
  ctx->finishParts(static_cast<int>(ctx->descs.size()) + 1);
}

}  // namespace ripples
