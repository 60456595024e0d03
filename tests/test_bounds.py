"""Bounds on what a caller or a peer controls (docs/design.md §8: every size a peer sends is
bounded), in real processes (2 ranks), cross-checked with gloo where gloo is defined.

* all_to_all_single split sizes: each entry in [0, rows], one entry per rank, a sum equal to
  the first dimension and no overflow. Violations raise ValueError naming the op, the argument
  and the entry, before anything moves, so the group keeps working.
* sparse all_reduce: each rank's description (sizes, dims, dtype, nnz) and indices are checked
  before they size a buffer or reach a tensor: a tensor whose nnz exceeds its sparse positions,
  or whose indices lie outside its sizes (torch builds such tensors without checking), makes
  every rank raise the same ValueError naming the rank; the group keeps working.
"""
import pytest
import torch
import torch.distributed as dist

from _dist import BACKEND, Checker, run_spawn

pytestmark = pytest.mark.skipif(BACKEND != "ripples", reason="ripples' own checks")

WS = 2
INT64_MAX = 2**63 - 1


def _group_works(ck, ctx, what):
    t = torch.full((8,), float(ctx.rank + 1))
    dist.all_reduce(t, group=ctx.pg)
    ck.equal(t, torch.full((8,), 3.0), what + ": all_reduce afterwards")
    inp = torch.arange(4, dtype=torch.float32) + 10 * ctx.rank
    # equal splits: rank r receives element block r of every rank
    out = torch.empty(4)
    dist.all_to_all_single(out, inp, group=ctx.pg)
    me = ctx.rank
    want = torch.tensor([2 * me, 2 * me + 1, 10 + 2 * me, 10 + 2 * me + 1], dtype=torch.float32)
    ck.equal(out, want, what + ": all_to_all_single afterwards")


# Each case: (name, output_split_sizes, input_split_sizes, message pattern). The tensors have
# 4 rows of 3 elements; a valid split is [1, 3] (or None).
A2A = r"all_to_all_single: "
SPLIT_CASES = [
    ("negative input split", None, [-1, 5], A2A + r"input split size \[0\] is negative \(-1\)"),
    ("input split larger than rows", None, [5, 0],
     A2A + r"input split size \[0\] \(5\) is larger than the tensor's first dimension \(4\)"),
    ("output split larger than rows", [0, 7], [1, 3],
     A2A + r"output split size \[1\] \(7\) is larger"),
    ("huge splits whose sum wraps", None, [INT64_MAX, INT64_MAX],
     A2A + r"input split size \[0\] \(9223372036854775807\) is larger"),
    ("sum too small", None, [1, 1],
     A2A + r"input split sizes add up to 2 but the tensor's first dimension is 4"),
    ("too few entries", None, [4],
     A2A + r"input split sizes have 1 entries but the group has 2 ranks"),
    ("too many entries", [1, 1, 2], None, A2A + r"output split sizes have 3 entries"),
]

# gloo defines these too (c10d's checkSplitSizes: count and sum); negative or oversized entries
# that still sum to the rows are not checked there, so gloo is not run on those.
GLOO_DEFINED = {"sum too small", "too few entries", "too many entries"}


def _t_alltoall_splits(ctx):
    ck = Checker(ctx)
    for name, out_splits, in_splits, pattern in SPLIT_CASES:
        inp = torch.arange(12, dtype=torch.float32).view(4, 3)
        out = torch.full((4, 3), -1.0)

        def call(group):
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)

        ck.raises(f"ripples all_to_all_single, {name}", lambda: call(ctx.pg), ValueError,
                  pattern)
        ck.true(torch.equal(out, torch.full((4, 3), -1.0)), f"{name}: output untouched")
        if name in GLOO_DEFINED:
            ck.raises(f"gloo all_to_all_single, {name}", lambda: call(ctx.ref),
                      (RuntimeError, ValueError), r"split|size")
    _group_works(ck, ctx, "after bad splits")
    return ck.finish()


def test_alltoall_splits():
    run_spawn(_t_alltoall_splits, WS)


def _bad_sparse(ctx, kind):
    """Rank 1's tensor for `kind`; rank 0's is a valid (4,) tensor."""
    if ctx.rank == 0:
        return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,))
    if kind == "sizes":
        return torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (5,))
    if kind == "dtype":
        return torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, dtype=torch.float64),
                                       (4,))
    if kind == "dense dims":
        return torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 1), (4, 1))
    if kind == "nnz":  # six distinct positions in a tensor that has four
        return torch.sparse_coo_tensor(torch.tensor([[0, 1, 2, 3, 4, 5]]), torch.ones(6), (4,))
    if kind == "index too large":
        return torch.sparse_coo_tensor(torch.tensor([[1, 9]]), torch.ones(2), (4,))
    if kind == "negative index":
        return torch.sparse_coo_tensor(torch.tensor([[-3, 1]]), torch.ones(2), (4,))
    raise AssertionError(kind)


SPARSE_CASES = [
    ("sizes",
     r"sparse tensors differ between ranks: rank 0 has size \[4\].*rank 1 has size \[5\]"),
    ("dtype", r"sparse tensors differ between ranks: .*rank 1 has .*float64"),
    ("dense dims", r"sparse tensors differ between ranks: .*rank 1 has size \[4, 1\]"),
    ("nnz", r"rank 1 sent a malformed sparse tensor description: nnz 6 is outside \[0, 4\]"),
    ("index too large", r"rank 1's sparse tensor has indices outside its size \[4\]"),
    ("negative index", r"rank 1's sparse tensor has indices outside its size \[4\]"),
]


def _t_sparse_bounds(ctx):
    ck = Checker(ctx)
    for kind, pattern in SPARSE_CASES:
        t = _bad_sparse(ctx, kind)
        ck.raises(f"sparse all_reduce, rank 1's {kind}",
                  lambda: dist.all_reduce(t, group=ctx.pg), ValueError, pattern)
        # the group is still in step: a valid sparse all_reduce gives the right sum
        good = torch.sparse_coo_tensor(torch.tensor([[ctx.rank, 3]]), torch.ones(2), (4,))
        dist.all_reduce(good, group=ctx.pg)
        ck.equal(good.to_dense(), torch.tensor([1.0, 1.0, 0.0, 2.0]),
                 f"sparse all_reduce after rank 1's {kind}")
    _group_works(ck, ctx, "after bad sparse tensors")
    return ck.finish()


def test_sparse_bounds():
    run_spawn(_t_sparse_bounds, WS)
