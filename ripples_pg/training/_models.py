"""What the training modules take as a model: whole replicas, one per worker (DDP).

A sharded model (FSDP2's ``fully_shard``, FSDP1's ``FullyShardedDataParallel``, tensor
parallelism's ``DTensor`` parameters) holds a slice of each parameter per worker: averaging
those slices as if they were whole parameters, or pointing them at the averager's flat buffer,
would silently corrupt the model (FSDP reads its shards from buffers of its own). Until Ripples
averages between replica groups of a sharded model (docs/limitations.md), such a model is
refused by name wherever one could come in.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

# Each where the running torch has it (its place moved between releases; torch>=2.4 accepted).
try:
    from torch.distributed.fsdp import FullyShardedDataParallel as _FSDP1
except ImportError:  # torch built without distributed
    _FSDP1 = ()
try:
    from torch.distributed.fsdp import FSDPModule as _FSDP2
except ImportError:
    try:
        from torch.distributed._composable.fsdp import FSDPModule as _FSDP2
    except ImportError:
        _FSDP2 = ()
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:
    try:
        from torch.distributed._tensor import DTensor as _DTensor
    except ImportError:
        _DTensor = ()

SHARDED_HELP = (
    "Ripples averages whole replicas of a model that every worker holds (DDP) and does not "
    "average sharded models yet (docs/limitations.md). Where the model fits in one worker, "
    "wrap it with DistributedDataParallel on a 'ripples' group instead; a sharded model "
    "trains with FSDP alone, without Ripples.")


def sharded_kind(module: Optional[torch.nn.Module] = None,
                 tensors: Iterable[torch.Tensor] = ()) -> Optional[str]:
    """What makes ``module`` (or any of ``tensors``) sharded, in words, or None."""
    if module is not None:
        for m in module.modules():
            if _FSDP2 and isinstance(m, _FSDP2):
                return "a model sharded with FSDP2 (fully_shard)"
            if _FSDP1 and isinstance(m, _FSDP1):
                return "a model wrapped in FSDP (FullyShardedDataParallel)"
        tensors = list(tensors) + list(module.parameters())
    if _DTensor and any(isinstance(t, _DTensor) for t in tensors):
        return "a model with DTensor parameters (FSDP2 or tensor parallelism)"
    return None


def refuse_sharded(who: str, module: Optional[torch.nn.Module] = None,
                   tensors: Iterable[torch.Tensor] = ()) -> None:
    """Raises TypeError naming the cause if the model (or tensors) is sharded."""
    kind = sharded_kind(module, tensors)
    if kind is not None:
        raise TypeError(f"{who}: {kind} is not supported. {SHARDED_HELP}")
