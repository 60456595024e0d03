"""What the training modules take as a model: whole replicas, one per worker (DDP).

A sharded model (FSDP2's ``fully_shard``, FSDP1's ``FullyShardedDataParallel``, tensor
parallelism's ``DTensor`` parameters) holds a slice of each parameter per worker: averaging
those slices as if they were whole parameters, or pointing them at the averager's flat buffer,
would silently corrupt the model (FSDP reads its shards from buffers of its own). Such a model
is refused by name wherever one could come in; an FSDP2 model's replica groups are averaged by
``ripples_pg.fsdp`` (docs/fsdp.md), which uses ``sharded_kind`` to recognise one.

The classes are looked up in ``sys.modules``, never imported: a model cannot be sharded
unless its sharding module is loaded, and importing FSDP costs every worker over half a second.
Their places moved between torch releases (torch>=2.4 is accepted), so each is looked up in
every place it has had.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional, Tuple

import torch

SHARDED_HELP = (
    "Ripples averages whole replicas of a model that every worker holds (DDP) here; a model "
    "sharded with FSDP2 averages between its replica groups with ripples_pg.fsdp.wrap() "
    "(docs/fsdp.md), and FSDP1 and tensor parallelism are not supported "
    "(docs/limitations.md). Where the model fits in one worker, wrap it with "
    "DistributedDataParallel on a 'ripples' group instead.")


def _classes(places: Tuple[Tuple[str, str], ...]) -> tuple:
    """The classes named by (module, attribute) pairs whose module is loaded."""
    found = []
    for module, name in places:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def sharded_kind(module: Optional[torch.nn.Module] = None,
                 tensors: Iterable[torch.Tensor] = ()) -> Optional[str]:
    """What makes ``module`` (or any of ``tensors``) sharded, in words, or None."""
    fsdp2 = _classes((("torch.distributed.fsdp", "FSDPModule"),
                      ("torch.distributed._composable.fsdp", "FSDPModule")))
    fsdp1 = _classes((("torch.distributed.fsdp", "FullyShardedDataParallel"),))
    dtensor = _classes((("torch.distributed.tensor", "DTensor"),
                        ("torch.distributed._tensor", "DTensor")))
    tensors = list(tensors)
    if module is not None:
        for m in module.modules():
            if fsdp2 and isinstance(m, fsdp2):
                return "a model sharded with FSDP2 (fully_shard)"
            if fsdp1 and isinstance(m, fsdp1):
                return "a model wrapped in FSDP (FullyShardedDataParallel)"
        tensors += list(module.parameters())
    for t in tensors:
        if dtensor and isinstance(t, dtensor):
            return "a model with DTensor parameters (FSDP2 or tensor parallelism)"
        if getattr(t, "_fsdp_flattened", False):  # FSDP1's flat shards, and its parameters
            return "a model wrapped in FSDP (FullyShardedDataParallel)"
    return None


def refuse_sharded(who: str, module: Optional[torch.nn.Module] = None,
                   tensors: Iterable[torch.Tensor] = ()) -> None:
    """Raises TypeError naming the cause if the model (or tensors) is sharded."""
    kind = sharded_kind(module, tensors)
    if kind is not None:
        raise TypeError(f"{who}: {kind} is not supported. {SHARDED_HELP}")


def check_int8_extras(who: str, mode: str, module: torch.nn.Module,
                      average_optimizer_state: bool) -> None:
    """int8 rounds quantise with an absolute error per block (docs/compression.md): averaged
    with the parameters, a BatchNorm running variance or an Adam second moment near zero could
    come back negative -- NaN later, silently. Refused until such tensors can travel exactly in
    a compressed round; bf16/fp16 errors are relative to each value and keep them positive."""
    if mode != "int8":
        return
    bufs = [n for n, b in module.named_buffers() if b.is_floating_point()]
    if bufs or average_optimizer_state:
        more = ", ..." if len(bufs) > 3 else ""
        what = f"floating-point buffers ({', '.join(bufs[:3])}{more})" if bufs else \
            "optimizer state (average_optimizer_state)"
        raise ValueError(f"{who}: compression='int8' would quantise the model's {what} "
                         f"together with the parameters, with an absolute error that can turn "
                         f"a variance near zero negative; use compression='bf16' (or 'fp16'), "
                         f"whose error is relative to each value (docs/compression.md)")
