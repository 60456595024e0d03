// TensorArgs: the arguments of an entry point, checked and translated for the core.
//
// Every check raises the exception torch users expect (ValueError for a wrong argument,
// TypeError for a dtype or reduce op the backend cannot handle) with a message that names the
// operation and the argument ("ripples allgather: output[2] has ..."). `opName` is the name in
// messages, `what` the argument as the user would call it. Also: torch dtypes and ReduceOps to
// the core's, and a contiguous host tensor to an rpl_buf (pointer, count, dtype).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/ArrayRef.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <initializer_list>
#include <string>
#include <vector>

#include "ripples.h"

namespace ripples __attribute__((visibility("hidden"))) {

// "torch.float32"-style names, the way users write them.
std::string pyDtypeName(at::ScalarType st);
// The core's dtype for a torch dtype; false if the core has none.
bool toRplDtype(at::ScalarType st, rpl_dtype* out);
// Maps a c10d ReduceOp to the core's operator and checks that it reduces `dtype`.
rpl_redop toRplRedop(const c10d::ReduceOp& op, rpl_dtype dtype, const char* opName);

// "[i]", to name an element of a list argument.
std::string ordinal(size_t i);

// Checks one user tensor: defined, CPU or CUDA, strided, supported dtype.
rpl_dtype checkTensor(const at::Tensor& t, const char* opName, const std::string& what);
// checkTensor, then the dtype and element count of `ref` (refWhat: "the input tensor").
void checkLike(
    const at::Tensor& t,
    const at::Tensor& ref,
    const char* opName,
    const std::string& what,
    const std::string& refWhat);
// checkLike for every tensor of a list, named list[i].
void checkAllLike(
    const std::vector<at::Tensor>& list,
    const at::Tensor& ref,
    const char* opName,
    const std::string& listName,
    const std::string& refWhat);
// The one device of every tensor of a call: the staging copies, the future's device set and the
// stream the caller waits on all follow from it. Tensors must have passed checkTensor.
c10::Device callDevice(
    const char* opName,
    std::initializer_list<c10::ArrayRef<at::Tensor>> lists);
void checkSameDtype(
    const at::Tensor& t,
    const at::Tensor& ref,
    const char* opName,
    const std::string& what,
    const std::string& refWhat);
void checkNumel(
    const at::Tensor& t,
    int64_t expected,
    const char* opName,
    const std::string& what,
    const std::string& why);
// A tensor results are written into must own its elements (no expand()ed strides).
void checkWritable(const at::Tensor& t, const char* opName, const std::string& what);
void checkListSize(
    size_t got,
    size_t expected,
    const char* opName,
    const std::string& what,
    const std::string& why);
void checkRank(int64_t r, int size, const char* opName, const char* what);

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
    const char* listName);   // the torch.distributed argument: "gather_list", "scatter_list"

// Element counts of each rank's slice of `t` along dim 0 (equal slices if `splits` is empty);
// all_to_all_single's split sizes, checked against the tensor and for overflow.
std::vector<size_t> splitCounts(
    const at::Tensor& t,
    const std::vector<int64_t>& splits,
    int size,
    const char* opName,
    const char* what);

// The core's view of a contiguous host tensor.
rpl_buf bufOf(const at::Tensor& contiguous, rpl_dtype d);

}  // namespace ripples
