"""The Group Generator's Python API: the static schedule, the policy state machine
(``GroupGenerator``), the coordinator service (``Coordinator``), its client (``Client``),
status queries and the ``ripples-coordinator`` command line (``cli_main``).

The binding is the submodule ``gg`` of the backend's extension (shim/GroupGenerator.cpp),
so the C Group Generator is loaded once per process; this module only re-exports it under its
long-standing name. Errors raise ValueError (bad arguments), TimeoutError, ConnectionError
(coordinator unreachable or gone), MemoryError or RuntimeError.
"""
from ._extension import load_extension

_gg = load_extension().gg  # checks the torch version and names the cause of a failed load

GroupGenerator = _gg.GroupGenerator
Coordinator = _gg.Coordinator
Client = _gg.Client
static_round = _gg.static_round
status = _gg.status
status_table = _gg.status_table
generate_token = _gg.generate_token
cli_main = _gg.cli_main
DEFAULT_GROUP_SIZE = _gg.DEFAULT_GROUP_SIZE
DEFAULT_C_THRES = _gg.DEFAULT_C_THRES
STATIC_PERIOD = _gg.STATIC_PERIOD
DEFAULT_PERIOD_MAX = _gg.DEFAULT_PERIOD_MAX
MAX_PERIOD = _gg.MAX_PERIOD
PROTOCOL_VERSION = _gg.PROTOCOL_VERSION
POLICIES = _gg.POLICIES
