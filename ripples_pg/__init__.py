"""ripples_pg: a PyTorch c10d process-group backend ("ripples") with a C core.

``import ripples_pg`` registers the backend, after which::

    import torch.distributed as dist
    dist.init_process_group("ripples")                       # e.g. under torchrun
    dist.init_process_group("ripples", pg_options=ripples_pg.Options(timeout=120))

When the package is installed, torch also loads it through its ``torch.backends`` entry point
(``ripples_pg:_autoload``), so ``init_process_group("ripples")`` works without the import
(unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
"""
from __future__ import annotations

import importlib
import sys
import warnings

from .backend._api import exact, host_of, partial, partial_all_reduce, stats, trace
from .backend._register import pick_bind_addr, register
from .backend._extension import load_extension as _load_extension
from .backend._extension import torch_version_error as _torch_version_error
from .backend.options import Options

__version__ = "0.1.0"

__all__ = [
    "DiLoCoAverager", "DistributedSampler", "JobClock", "JobLRScheduler", "Options",
    "RipplesAverager", "RipplesOptimizer", "__version__", "checkpoint", "exact", "follow_job",
    "has_ucx", "hooks", "host_of", "is_registered", "partial", "partial_all_reduce",
    "pick_bind_addr", "register", "stats", "trace", "wrap",
]

# The training integration imports torch's optimizers and averagers; load it on first use so
# that torch's backend autoload (which imports this package inside `import torch`) stays
# cycle-free and fast.
_LAZY = {
    "RipplesAverager": ("training.averager", "RipplesAverager"),
    "DiLoCoAverager": ("training.diloco", "DiLoCoAverager"),
    "RipplesOptimizer": ("training._wrap", "RipplesOptimizer"),
    "wrap": ("training._wrap", "wrap"),
    "DistributedSampler": ("training.sampler", "DistributedSampler"),
    "JobClock": ("training.progress", "JobClock"),
    "JobLRScheduler": ("training.lr", "JobLRScheduler"),
    "follow_job": ("training.lr", "follow_job"),
    "hooks": ("hooks", None),            # the public paths (ripples_pg/_public.py)
    "checkpoint": ("checkpoint", None),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(f".{module}", __name__)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ripples_pg' has no attribute {name!r}")


def has_ucx() -> bool:
    """Whether this build has the UCX transport (``Options(transport="ucx")``): it is built
    when UCX's development files (Debian: ``libucx-dev``) are present at build time."""
    return bool(_load_extension().has_ucx())


def is_registered() -> bool:
    """Whether ``"ripples"`` is registered with torch.distributed."""
    import torch.distributed as dist  # late: the backend autoload imports us inside `import torch`

    return dist.is_available() and hasattr(dist.Backend, "RIPPLES")


def _autoload() -> None:
    """Entry point of group ``torch.backends``, called near the end of ``import torch``.

    By then torch.distributed is already imported (torch imports it itself), so registering
    cannot create an import cycle; the C extension is not loaded here. This must never raise:
    torch turns an exception into a failure of ``import torch`` itself."""
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        warnings.warn(
            f"ripples_pg: could not register the 'ripples' backend automatically ({exc!r}); "
            f"'import ripples_pg' explicitly to see the error.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    version_error = globals().get("_version_error")
    if version_error is not None:
        warnings.warn(version_error + " (creating a 'ripples' process group raises this error)",
                      RuntimeWarning, stacklevel=2)
    if _register_error is not None:
        warnings.warn(
            f"ripples_pg: could not register the 'ripples' backend automatically "
            f"({_register_error!r}); 'import ripples_pg' explicitly to see the error.",
            RuntimeWarning,
            stacklevel=2,
        )


def _inside_torch_autoload() -> bool:
    """True while torch's entry-point loader (torch._import_device_backends) imports us."""

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_import_device_backends":
            return True
        frame = frame.f_back
    return False


_register_error = None
try:
    register()
except Exception as _exc:  # noqa: BLE001
    # An explicit import shows the error; torch's autoload must not fail `import torch`.
    if not _inside_torch_autoload():
        raise
    _register_error = _exc

# The extension is tied to the torch minor version it was built for: an explicit import says so
# at once, before anything loads it. Inside torch's autoload it only warns (_autoload), and
# loading the extension (_extension.load_extension) raises the same error.
_version_error = _torch_version_error()
if _version_error is not None and not _inside_torch_autoload():
    raise ImportError(_version_error)

# Trainer(strategy="ripples") once Lightning is imported (imports nothing of Lightning here).
from .integrations import _pl_autoregister  # noqa: E402

_pl_autoregister.install()
