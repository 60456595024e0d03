"""Which PyTorch Lightning the Lightning integration runs with, imported once.

Either ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning``; if both are installed,
the one already imported wins, else ``lightning``. Importing this module imports Lightning's
top package only: ``sub(name)`` imports one of its modules when asked, because the automatic
registration (``ripples_pg.integrations._pl_autoregister``) imports ``ripples_pg.lightning``
right after Lightning's strategies module has loaded, possibly while the rest of Lightning is
still being imported.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Tuple

__all__ = ["NAME", "pl", "sub", "FITTING", "FSDP_STRATEGY_NAME"]

FITTING = "fit"  # TrainerFn.FITTING (a str enum)
FSDP_STRATEGY_NAME = "ripples_fsdp"  # RipplesFSDPStrategy's name (lightning.py may lack it)


def _import_lightning() -> Tuple[str, ModuleType]:
    order = ["lightning.pytorch", "pytorch_lightning"]
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        order.reverse()
    errors = []
    for name in order:
        try:
            __import__(name)
            return name, sys.modules[name]
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError(
        "ripples_pg.lightning needs PyTorch Lightning 2.x, which is not installed ("
        + "; ".join(errors) + "). Install it with: pip install 'pytorch-lightning>=2.0' "
        "(or pip install 'lightning>=2.0'); the core ripples_pg package does not need it.")


NAME, pl = _import_lightning()


def sub(module: str) -> ModuleType:
    """Lightning's ``module`` (e.g. ``"callbacks"``), imported when first asked for."""
    return __import__(f"{NAME}.{module}", fromlist=["_"])
