// Call: what an entry point hands the Submitter (Submitter.hpp) — the Entry that names
// the operation, the core operations (makeDesc), and the Call its tensors are staged into.
//
// `entry` names the operation (torch's OpType, the profiler's title, the name in messages);
// `desc` is the core operation with its own fields set (kind, root, redop, tag: makeDesc); the
// entry point's staging function puts the call's tensors into core buffers through the Call,
// in the order the core reads them. Submitter::post does the rest, the same way for every
// entry point.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <memory>
#include <string>
#include <vector>

#include "DeviceStaging.hpp"
#include "RipplesWork.hpp"
#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

// The identity of an entry point.
struct Entry {
  c10d::OpType type;
  const char* title;  // the profiler's: "ripples:all_reduce"
  const char* name;   // in messages: "allreduce"
};

// A core operation of `kind`; every other field zero (root 0, SUM, tag 0, no buffers).
rpl_op_desc makeDesc(rpl_op_kind kind);

// A call being built: the context that will be handed to the core and the buffers staged into
// it. A contiguous tensor of an unstaged call is used as it is; any other (non-contiguous, or
// in a staged call: device tensors, RIPPLES_DEBUG_STAGE_CPU) goes through a contiguous host
// tensor, copied back on completion when results land in it. Inputs and outputs are appended
// in order; a call of n core operations gives operation i the i-th of n equal shares of each
// (coalesced calls stage one share per operation). A pipelined call (pipelineBytes > 0, set
// by Submitter::post before staging) defers the copies of its in-place tensors:
// Submitter::submit cuts its one operation into chunks and copies chunk by chunk
// (DeviceStaging.hpp).
class Call {
 public:
  // Read-only input.
  void in(const at::Tensor& t, rpl_dtype d);
  // Read and written in place (one input buffer). Returns the tensor the core reads and
  // writes: `t` itself, or its staging tensor.
  at::Tensor inout(const at::Tensor& t, rpl_dtype d, const std::string& what);
  // Written only; a temporary need not be filled first.
  void out(const at::Tensor& t, rpl_dtype d, const std::string& what);
  // One buffer per count: consecutive slices of `t`, staged as a whole as above.
  void inSlices(const at::Tensor& t, rpl_dtype d, const std::vector<size_t>& counts);
  void outSlices(
      const at::Tensor& t,
      rpl_dtype d,
      const std::vector<size_t>& counts,
      const std::string& what);
  // `dest` receives the contents of `from` (a tensor this call writes) on completion too.
  void copyTo(const at::Tensor& from, const at::Tensor& dest, const std::string& what);
  // recv(src): the sender is known before the call completes.
  void setSource(int rank);
  // recvAnysource: the core writes the sender into the context before on_done.
  void reportSource();

  // Used by the Submitter.
  std::unique_ptr<OpContext> ctx;
  const char* opName = nullptr;
  double timeoutS = 0;  // per-call timeout (opts.timeout); 0 = the group's
  size_t pipelineBytes = 0;  // the chunk size; 0 = copy whole tensors

  // Cuts the staged buffers into core operations of at most pipelineBytes (larger for a huge
  // call, so that it makes about kMaxChunks at most), their copies into ctx->chunks. False, with nothing changed,
  // where the call does not split (one chunk, or buffers other than in-place ones).
  bool cutIntoChunks();
  // The whole-tensor path for the deferred copies (a call that did not split).
  void stageWhole();
  static constexpr size_t kMaxChunks = 1024;

 private:
  DeviceStage* stage() const {
    return ctx->stage.get();
  }
  // The tensor the core uses for `t` (kept alive by the context). `read`: it must hold t's
  // contents; `write`: results land in it, so a copy is copied back into `t`.
  at::Tensor hostTensor(const at::Tensor& t, bool read, bool write, const std::string& what);
  std::vector<ChunkCopy> deferred_;  // pipelined: one per buffer of ctx->in, in order
  void slices(
      const at::Tensor& c,
      rpl_dtype d,
      const std::vector<size_t>& counts,
      std::vector<rpl_buf>& into);
};

}  // namespace ripples
