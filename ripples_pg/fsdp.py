"""The public path of :mod:`ripples_pg.training.fsdp` (ripples_pg/_public.py)."""
from typing import TYPE_CHECKING

from ._public import alias

if TYPE_CHECKING:  # what editors and type checkers read
    from .training.fsdp import *  # noqa: F401,F403

alias(__name__, "ripples_pg.training.fsdp")
