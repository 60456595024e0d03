"""``Trainer(strategy="ripples")`` without ``import ripples_pg.lightning``.

Lightning has no entry-point discovery for external strategies: a name is known once something
calls ``StrategyRegistry.register``. ``import ripples_pg.lightning`` does; this module makes it
happen by itself when ``ripples_pg`` is imported before Lightning's strategies module -- which
torch's backend autoload arranges (it imports ``ripples_pg`` inside ``import torch``, and
Lightning imports torch before its strategies).

How: one entry at the front of ``sys.meta_path`` whose ``find_spec`` returns None for every name
but Lightning's two strategies modules (one set lookup per import), and for those asks the
other finders and wraps the real loader so that, once the module has executed, ``ripples_pg.lightning`` is imported (it
needs nothing else of Lightning at import time). The module's ``__loader__`` and
``__spec__.loader`` are set back to the real loader. Anything that goes wrong is a warning,
never a failure of Lightning's import; the entry removes itself after the first registration.
``RIPPLES_LIGHTNING_AUTOREGISTER=0`` turns it off.
"""
from __future__ import annotations

import os
import sys
import warnings

_TARGETS = frozenset({"pytorch_lightning.strategies", "lightning.pytorch.strategies"})


def _register() -> None:
    try:
        from . import lightning  # noqa: F401  (registers on import)
    except Exception as exc:  # noqa: BLE001 - must never break importing Lightning
        warnings.warn(f"ripples_pg: could not register the Lightning strategy 'ripples' "
                      f"({exc!r}); 'import ripples_pg.lightning' to see the error",
                      RuntimeWarning, stacklevel=2)


class _Loader:
    def __init__(self, finder: "_Finder", real):
        self._finder, self._real = finder, real

    def create_module(self, spec):
        create = getattr(self._real, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module) -> None:
        try:
            self._real.exec_module(module)
        finally:
            module.__loader__ = self._real
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._real
        self._finder.uninstall()
        _register()

    def __getattr__(self, name):  # anything else a loader is asked: the real one answers
        return getattr(self._real, name)


class _Finder:
    def __init__(self):
        self._busy = False

    def find_spec(self, name, path=None, target=None):
        if name not in _TARGETS or self._busy:
            return None
        spec = None
        self._busy = True
        try:  # the finders after this one, as the import system would ask them
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        except Exception:  # noqa: BLE001 - let the normal machinery find (or fail) it
            return None
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(self, spec.loader)
        return spec

    def uninstall(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install() -> None:
    """Called by ``import ripples_pg``; cheap, and never raises."""
    try:
        if os.environ.get("RIPPLES_LIGHTNING_AUTOREGISTER", "1").strip() == "0":
            return
        loaded = [sys.modules.get(t) for t in _TARGETS]
        if any(m is not None for m in loaded):
            # Lightning's strategies were imported before ripples_pg (no torch autoload):
            # register now if that import is complete; mid-import is left to an explicit
            # `import ripples_pg.lightning`.
            if any(m is not None and not getattr(getattr(m, "__spec__", None),
                                                 "_initializing", False) for m in loaded):
                _register()
            return
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())  # before PathFinder, which would answer
    except Exception:  # noqa: BLE001 - an optional convenience
        pass
