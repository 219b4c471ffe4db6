"""flodl: data-parallel training for machines of unequal speed.

The names here are the ones most scripts need; the rest lives in its module:
``flodl.worker`` (the rank side, used from a training script), ``flodl.coordinator``,
``flodl.launch.launcher`` (``flodl run``), ``flodl.checkpoint``, ``flodl.testing``. Importing flodl
is light: torch is imported only by the modules that average parameters or save them.
"""

from flodl.config import CoordinatorConfig, GuardKind, MaxFailure, Policy
from flodl.errors import FlodlError, RunAborted, ShutdownRequested
from flodl.wire.messages import SaveReason

__all__ = [
    "CoordinatorConfig",
    "FlodlError",
    "GuardKind",
    "MaxFailure",
    "Policy",
    "RunAborted",
    "SaveReason",
    "ShutdownRequested",
    "__version__",
]

__version__ = "0.1.0"
