"""How ranks average parameters: backends over torch.distributed, chosen by name.

``open_backend("auto")`` gives nccl where CUDA and NCCL are usable, else gloo. Importing this
package does not import torch; :func:`open_backend` does.
"""

from __future__ import annotations

from typing import Any

from flodl.backends.base import DEFAULT_ALPHA, AverageResult, Backend, PendingAverage
from flodl.errors import ConfigError

BACKEND_NAMES = ("auto", "gloo", "nccl")


def resolve_backend_name(name: str = "auto") -> str:
    """The concrete backend ``name`` stands for (``auto``: nccl if usable, else gloo)."""
    if name not in BACKEND_NAMES:
        raise ConfigError(f"unknown backend {name!r}; expected one of {BACKEND_NAMES}")
    if name != "auto":
        return name
    from flodl.backends.nccl import nccl_usable

    return "nccl" if nccl_usable() else "gloo"


def open_backend(name: str = "auto", **options: Any) -> Backend:
    """A new backend by name; ``options`` go to its constructor (``op_timeout``, ...)."""
    resolved = resolve_backend_name(name)
    if resolved == "nccl":
        from flodl.backends.nccl import NcclBackend

        return NcclBackend(**options)
    from flodl.backends.gloo import GlooBackend

    return GlooBackend(**options)


__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_ALPHA",
    "AverageResult",
    "Backend",
    "PendingAverage",
    "open_backend",
    "resolve_backend_name",
]
