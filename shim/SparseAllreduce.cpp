// SparseAllreduce: the SUM of sparse COO tensors, with gloo's semantics (issue 17).
//
// Every rank coalesces its tensor, the ranks exchange a fixed-size description (nnz, the
// sparse and dense dimensions, dtype, sizes) with one allgather, then their indices and
// values padded to the largest nnz with two more, and each rank sums what it received into a
// coalesced result that replaces its tensor's contents (as gloo's `tensor.copy_(result)`).
// Sparse gradients (embeddings) are the case this serves. The exchange runs on the caller's
// thread, through this group's own allgathers, so the call returns once the result is in
// place; the Work it returns is already complete. Tensors that differ between ranks (sizes,
// dtype, sparse layout) make every rank raise the same error before any values move.
//
// Everything a peer sends is checked before it sizes a buffer or indexes memory
// (docs/design.md §8: every size a peer sends is bounded): each description must be well
// formed (dims within kMaxDims and consistent, a dtype this backend reduces, sizes >= 0, nnz
// between 0 and the number of sparse positions) and equal to rank 0's; the padded buffers'
// sizes are computed with overflow checks; and every index received must lie inside the
// tensor's sizes, so that a bad index cannot reach a later to_dense(). All ranks see the same
// descriptions and indices, so they all raise the same ValueError, naming the rank, and stay
// in step.
#include "ProcessGroupRipples.hpp"
#include "TensorArgs.hpp"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace ripples {

namespace {

constexpr int64_t kMaxDims = 32;
// nnz, sparse_dim, dense_dim, ndim, dtype, then up to kMaxDims sizes
constexpr int64_t kMetaLen = 5 + kMaxDims;

// Why the description `m` is malformed, or "" when it is well formed. Only a
// well-formed description may be passed to describe() or used to size anything.
std::string malformed(const int64_t* m) {
  const int64_t nnz = m[0], sparseDim = m[1], denseDim = m[2], ndim = m[3], dtype = m[4];
  if (ndim < 0 || ndim > kMaxDims) {
    return "it has " + std::to_string(ndim) + " dimensions (at most " +
        std::to_string(kMaxDims) + ")";
  }
  if (sparseDim < 0 || denseDim < 0 || sparseDim > ndim || denseDim != ndim - sparseDim) {
    return std::to_string(sparseDim) + " sparse and " + std::to_string(denseDim) +
        " dense dimensions do not add up to " + std::to_string(ndim);
  }
  rpl_dtype d;
  if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions) ||
      !toRplDtype(static_cast<c10::ScalarType>(dtype), &d)) {
    return "dtype code " + std::to_string(dtype) + " is not one this backend reduces";
  }
  int64_t positions = 1;  // sparse positions, saturating at INT64_MAX
  for (int64_t i = 0; i < kMaxDims; ++i) {
    const int64_t n = m[5 + i];
    if (i >= ndim) {
      if (n != 0) {
        return "size entry " + std::to_string(i) + " is set past its " +
            std::to_string(ndim) + " dimensions";
      }
      continue;
    }
    if (n < 0) {
      return "size " + std::to_string(i) + " is negative (" + std::to_string(n) + ")";
    }
    if (i < sparseDim && __builtin_mul_overflow(positions, n, &positions)) {
      positions = INT64_MAX;
    }
  }
  if (nnz < 0 || nnz > positions) {
    return "nnz " + std::to_string(nnz) + " is outside [0, " + std::to_string(positions) +
        "] (the number of sparse positions)";
  }
  return "";
}

// a * b * c as a count of elements or bytes, or -1 if it does not fit in int64.
int64_t checkedProduct(int64_t a, int64_t b, int64_t c) {
  int64_t ab, abc;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) {
    return -1;
  }
  return abc;
}

std::string describe(const int64_t* m) {
  std::string s = "size [";
  for (int64_t i = 0; i < m[3]; ++i) {
    s += (i ? ", " : "") + std::to_string(m[5 + i]);
  }
  return s + "], " + std::to_string(m[1]) + " sparse and " + std::to_string(m[2]) +
      " dense dims, dtype " + pyDtypeName(static_cast<c10::ScalarType>(m[4]));
}

bool sameLayout(const int64_t* a, const int64_t* b) {
  for (int64_t i = 1; i < kMetaLen; ++i) {
    if (a[i] != b[i]) {
      return false;
    }
  }
  return true;
}

void checkSparseArgs(const at::Tensor& tensor, const c10d::AllreduceOptions& opts) {
  TORCH_CHECK_VALUE(
      tensor.layout() == c10::kSparse,
      "ripples allreduce: tensor has layout ", tensor.layout(),
      "; of the sparse layouts only COO (torch.sparse_coo) is supported");
  TORCH_CHECK_VALUE(
      opts.reduceOp == c10d::ReduceOp::SUM,
      "ripples allreduce: sparse tensors are summed only (ReduceOp.SUM), as with gloo");
  TORCH_CHECK_VALUE(
      tensor.device().is_cpu(),
      "ripples allreduce: sparse tensors must be on the CPU, got device '",
      tensor.device().str(), "'");
  rpl_dtype d;
  TORCH_CHECK_TYPE(
      toRplDtype(tensor.scalar_type(), &d),
      "ripples allreduce: the sparse tensor's values have dtype ",
      pyDtypeName(tensor.scalar_type()), ", which the ripples backend does not support");
  TORCH_CHECK_VALUE(
      tensor.dim() <= kMaxDims,
      "ripples allreduce: sparse tensors of more than ", kMaxDims, " dimensions");
}

// Step 1, who has what: every rank's description of `input` (kMetaLen each), checked, so
// that every rank sees the same and all decide alike. *maxNnz: the largest nnz.
at::Tensor gatherLayouts(
    c10d::Backend& pg,
    const at::Tensor& input,
    const c10d::AllgatherOptions& ag,
    int64_t* maxNnz) {
  const int size = pg.getSize();
  auto i64 = at::TensorOptions().dtype(at::kLong);
  at::Tensor meta = at::zeros({kMetaLen}, i64);
  int64_t* m = meta.data_ptr<int64_t>();
  m[0] = input._nnz();
  m[1] = input.sparse_dim();
  m[2] = input.dense_dim();
  m[3] = input.dim();
  m[4] = static_cast<int64_t>(input.scalar_type());
  for (int64_t i = 0; i < input.dim(); ++i) {
    m[5 + i] = input.size(i);
  }
  at::Tensor metas = at::empty({size * kMetaLen}, i64);
  pg._allgather_base(metas, meta, ag)->wait();
  const int64_t* all = metas.data_ptr<int64_t>();
  for (int r = 0; r < size; ++r) {
    const std::string why = malformed(all + r * kMetaLen);
    TORCH_CHECK_VALUE(
        why.empty(), "ripples allreduce: rank ", r,
        " sent a malformed sparse tensor description: ", why);
  }
  *maxNnz = 0;
  for (int r = 0; r < size; ++r) {
    const int64_t* mr = all + r * kMetaLen;
    TORCH_CHECK_VALUE(
        sameLayout(mr, all),
        "ripples allreduce: the sparse tensors differ between ranks: rank 0 has ",
        describe(all), ", rank ", r, " has ", describe(mr));
    *maxNnz = std::max(*maxNnz, mr[0]);
  }
  return metas;
}

// Every rank's indices and values, padded to the largest nnz so that one allgather moves
// each.
struct Gathered {
  at::Tensor idxAll;  // size x [sparseDim, maxNnz]
  at::Tensor valAll;  // size x valShape, flattened
  std::vector<int64_t> valShape;  // one rank's values: [maxNnz, dense sizes...]
};

// Step 2. The largest nnz is bounded by the sparse positions (checked in step 1); the
// gathered buffers must still be addressable.
Gathered gatherEntries(
    c10d::Backend& pg,
    const at::Tensor& input,
    int64_t maxNnz,
    const c10d::AllgatherOptions& ag) {
  const int size = pg.getSize();
  const int64_t sparseDim = input.sparse_dim(), nnz = input._nnz();
  auto i64 = at::TensorOptions().dtype(at::kLong);
  Gathered g;
  g.valShape = input._values().sizes().vec();
  g.valShape[0] = maxNnz;
  int64_t denseElems = 1;
  for (size_t i = 1; i < g.valShape.size(); ++i) {
    denseElems = checkedProduct(denseElems, g.valShape[i], 1);
    TORCH_CHECK_VALUE(
        denseElems >= 0, "ripples allreduce: the sparse tensor's dense part is too large");
  }
  const int64_t idxElems = checkedProduct(size, std::max<int64_t>(sparseDim, 1), maxNnz);
  const int64_t idxBytes = idxElems < 0 ? -1 : checkedProduct(idxElems, 8, 1);
  const int64_t valElems = checkedProduct(size, maxNnz, denseElems);
  const int64_t valBytes = valElems < 0 ? -1 : checkedProduct(valElems, input.element_size(), 1);
  TORCH_CHECK_VALUE(
      idxBytes >= 0 && valBytes >= 0,
      "ripples allreduce: gathering sparse tensors of up to ", maxNnz, " entries from ", size,
      " ranks would need more memory than can be addressed");
  at::Tensor idx = at::zeros({sparseDim, maxNnz}, i64);
  at::Tensor val = at::zeros(g.valShape, input._values().options());
  if (nnz > 0) {
    idx.narrow(1, 0, nnz).copy_(input._indices());
    val.narrow(0, 0, nnz).copy_(input._values());
  }
  g.idxAll = at::empty({size * idx.numel()}, i64);
  g.valAll = at::empty({size * val.numel()}, val.options());
  pg._allgather_base(g.idxAll, idx, ag)->wait();
  at::Tensor valFlat = val.reshape({-1});
  pg._allgather_base(g.valAll, valFlat, ag)->wait();
  return g;
}

// Step 3, the sum: every rank's entries side by side, duplicates summed by coalesce(). Every
// index must lie in [0, size) of its dimension: sparse_coo_tensor does not check, and a later
// to_dense() would write where the index points.
at::Tensor sumEntries(
    const at::Tensor& input,
    const at::Tensor& metas,
    const Gathered& g,
    int size) {
  const int64_t sparseDim = input.sparse_dim();
  const int64_t maxNnz = g.valShape[0];
  const int64_t idxNumel = sparseDim * maxNnz;
  int64_t valNumel = 1;
  for (int64_t v : g.valShape) {
    valNumel *= v;
  }
  const int64_t* all = metas.data_ptr<int64_t>();
  const at::Tensor limits = at::tensor(input.sizes().slice(0, sparseDim).vec(),
                                       at::TensorOptions().dtype(at::kLong))
                                .view({sparseDim, 1});
  std::vector<at::Tensor> idxParts, valParts;
  for (int r = 0; r < size; ++r) {
    const int64_t nr = all[r * kMetaLen];
    at::Tensor part =
        g.idxAll.narrow(0, r * idxNumel, idxNumel).view({sparseDim, maxNnz}).narrow(1, 0, nr);
    TORCH_CHECK_VALUE(
        nr == 0 || sparseDim == 0 ||
            (part.ge(0).all().item<bool>() && part.lt(limits).all().item<bool>()),
        "ripples allreduce: rank ", r, "'s sparse tensor has indices outside its size ",
        input.sizes());
    idxParts.push_back(part);
    valParts.push_back(
        g.valAll.narrow(0, r * valNumel, valNumel).view(g.valShape).narrow(0, 0, nr));
  }
  return at::sparse_coo_tensor(at::cat(idxParts, 1), at::cat(valParts, 0), input.sizes())
      .coalesce();
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupRipples::sparseAllreduce(
    at::Tensor& tensor,
    const c10d::AllreduceOptions& opts) {
  checkSparseArgs(tensor, opts);
  const at::Tensor input = tensor.coalesce();
  c10d::AllgatherOptions ag;
  ag.timeout = opts.timeout;
  int64_t maxNnz = 0;
  const at::Tensor metas = gatherLayouts(*this, input, ag, &maxNnz);
  const Gathered g = gatherEntries(*this, input, maxNnz, ag);
  tensor.copy_(sumEntries(input, metas, g, size_));
  static const Entry e{c10d::OpType::ALLREDUCE, "ripples:all_reduce_sparse", "allreduce"};
  return submitter_->completedWork(e, {tensor}, opts.timeout);
}

}  // namespace ripples
