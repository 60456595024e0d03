"""The public import paths of modules that live in the folder of their layer.

``ripples_pg.averager``, ``ripples_pg.lightning`` and their siblings are the paths users import
(and ``python -m ripples_pg.report`` the commands they run); the code lives in ``backend/``,
``training/``, ``integrations/`` and ``tools/``. Each public path is a three-line file that
hands its name to the real module, so both names are one module object: one set of globals, one
class per class (``isinstance``, pickling and ``monkeypatch`` see the same thing).
"""
from __future__ import annotations

import importlib
import runpy
import sys


def alias(name: str, real: str) -> None:
    """Makes the module being imported as ``name`` the module ``real``; run as a script
    (``python -m ripples_pg.report``), runs ``real`` as the script instead."""
    if name == "__main__":
        runpy.run_module(real, run_name="__main__", alter_sys=True)
        return
    sys.modules[name] = importlib.import_module(real)
