// TensorArgs: see TensorArgs.hpp.
#include "TensorArgs.hpp"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <optional>

namespace ripples {

std::string pyDtypeName(at::ScalarType st) {
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

}  // namespace

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

void checkLike(
    const at::Tensor& t,
    const at::Tensor& ref,
    const char* opName,
    const std::string& what,
    const std::string& refWhat) {
  checkTensor(t, opName, what);
  checkSameDtype(t, ref, opName, what, refWhat);
  checkNumel(t, ref.numel(), opName, what, "as " + refWhat);
}

void checkAllLike(
    const std::vector<at::Tensor>& list,
    const at::Tensor& ref,
    const char* opName,
    const std::string& listName,
    const std::string& refWhat) {
  for (size_t i = 0; i < list.size(); ++i) {
    checkLike(list[i], ref, opName, listName + ordinal(i), refWhat);
  }
}

rpl_buf bufOf(const at::Tensor& contiguous, rpl_dtype d) {
  rpl_buf b;
  b.count = static_cast<size_t>(contiguous.numel());
  b.ptr = b.count ? contiguous.data_ptr() : nullptr;
  b.dtype = d;
  return b;
}

RootedList checkRootedList(
    const char* opName,
    int64_t root,
    int rank,
    int size,
    const std::vector<at::Tensor>& mine,
    const char* mineSide,
    const std::vector<std::vector<at::Tensor>>& rooted,
    const char* rootedSide,
    const char* listName) {
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
    checkAllLike(r.tensors, t, opName, listName, mineWhat);
  } else {
    TORCH_CHECK_VALUE(
        rooted.empty() || (rooted.size() == 1 && rooted[0].empty()),
        "ripples ", opName, ": only the root (rank ", root, ") may pass a ", listName, "; rank ",
        rank, " passed one");
  }
  return r;
}

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

}  // namespace ripples
