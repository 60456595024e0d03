// Call: see Call.hpp. A call's tensors staged into core buffers, and cut into chunks when
// pipelined; its way to the core is the Submitter's (Submitter.cpp).
#include "Call.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

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
    if (stage() && pipelineBytes > 0) {
      // Pipelined: contiguous tensors are copied chunk by chunk once Submitter::submit has
      // cut the call. Others are copied whole now and back at the end, but still cut like the rest
      // (the cut must not depend on a rank's local layout: every rank cuts the same way).
      if (t.is_contiguous()) {
        c = stage()->toHost(t, false);
        deferred_.push_back(ChunkCopy{c, t, read, write});
      } else {
        c = stage()->toHost(t, read);
        if (write) {
          ctx->copyBack.emplace_back(c, t);
        }
        deferred_.push_back(ChunkCopy{c, at::Tensor(), false, false});
      }
      ctx->keepAlive.push_back(c);
      return c;
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

bool Call::cutIntoChunks() {
  OpContext& c = *ctx;
  if (pipelineBytes == 0 || c.descs.size() != 1 || !c.out.empty() ||
      deferred_.size() != c.in.size()) {
    return false;  // not the one in-place operation pipelining was planned for
  }
  size_t total = 0;
  for (size_t i = 0; i < c.in.size(); ++i) {
    const rpl_buf& b = c.in[i];
    const at::Tensor& h = deferred_[i].host;
    if (b.count != static_cast<size_t>(h.numel()) || (b.count > 0 && b.ptr != h.data_ptr())) {
      return false;
    }
    total += b.count * rpl_dtype_size(b.dtype);
  }
  // From the sizes and the setting only, so every rank cuts the same chunks. A huge call gets
  // larger chunks rather than an unbounded number of core operations.
  const size_t chunk = std::max(pipelineBytes, (total + kMaxChunks - 1) / kMaxChunks);
  if (total <= chunk) {
    return false;
  }
  std::vector<rpl_buf> bufs;
  std::vector<size_t> first{0};  // each chunk's first buffer in `bufs`
  std::vector<std::vector<ChunkCopy>> copies(1);
  size_t room = chunk;
  for (size_t i = 0; i < c.in.size(); ++i) {
    const rpl_buf& b = c.in[i];
    if (b.count == 0) {
      bufs.push_back(b);  // still passed (every rank's buffer count must agree)
      continue;
    }
    const size_t esz = rpl_dtype_size(b.dtype);
    const ChunkCopy& whole = deferred_[i];
    const at::Tensor hflat = whole.host.view({-1});
    const at::Tensor dflat = whole.dev.defined() ? whole.dev.view({-1}) : at::Tensor();
    size_t off = 0;
    while (off < b.count) {
      if (room < esz) {  // the chunk is full: start the next (pipelineBytes >= 8 >= esz)
        first.push_back(bufs.size());
        copies.emplace_back();
        room = chunk;
      }
      const size_t n = std::min(room / esz, b.count - off);
      bufs.push_back(rpl_buf{static_cast<char*>(b.ptr) + off * esz, n, b.dtype});
      if (dflat.defined()) {
        const auto o = static_cast<int64_t>(off), len = static_cast<int64_t>(n);
        copies.back().push_back(
            ChunkCopy{hflat.narrow(0, o, len), dflat.narrow(0, o, len), whole.read, whole.write});
      }
      off += n;
      room -= n * esz;
    }
  }
  const rpl_op_desc proto = c.descs[0];
  const size_t n = first.size();
  c.in = std::move(bufs);
  c.descs.assign(n, proto);
  c.chunkDone.resize(n);
  for (size_t k = 0; k < n; ++k) {
    const size_t end = k + 1 < n ? first[k + 1] : c.in.size();
    c.descs[k].in = &c.in[first[k]];
    c.descs[k].nin = static_cast<int>(end - first[k]);
    c.chunkDone[k] = OpContext::ChunkDone{&c, k};
  }
  c.chunks = std::move(copies);
  c.chunkBytes = chunk;
  // The copies in, chunk by chunk, each followed by its event: the staging thread submits
  // chunk k once its event fired, while the copies of k+1 still run.
  for (const auto& ch : c.chunks) {
    for (const ChunkCopy& cc : ch) {
      if (cc.read) {
        stage()->copyIn(cc.host, cc.dev);
      }
    }
    stage()->markChunkStaged();
  }
  deferred_.clear();
  return true;
}

void Call::stageWhole() {
  for (const ChunkCopy& d : deferred_) {
    if (!d.dev.defined()) {
      continue;  // copied already (non-contiguous)
    }
    if (d.read) {
      stage()->copyIn(d.host, d.dev);
    }
    if (d.write) {
      ctx->copyBack.emplace_back(d.host, d.dev);
    }
  }
  deferred_.clear();
}

void Call::setSource(int rank) {
  ctx->work->setSourceRank(rank);
}

void Call::reportSource() {
  for (rpl_op_desc& d : ctx->descs) {
    d.source = &ctx->source;
  }
}

}  // namespace ripples
