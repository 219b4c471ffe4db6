"""How ranks average parameters: backends over torch.distributed, chosen by name.

``open_backend("auto")`` gives nccl where NCCL is usable and this host has a GPU for each of
its ranks, else gloo. Importing this package does not import torch; :func:`open_backend` does.
"""

from __future__ import annotations

from typing import Any

from flodl.backends.base import DEFAULT_ALPHA, AverageResult, Backend, PendingAverage
from flodl.errors import ConfigError

BACKEND_NAMES = ("auto", "gloo", "nccl")


def choose_backend(name: str, *, nccl: bool, gpus: int, local_world_size: int) -> str:
    """The concrete backend ``name`` stands for on a host with ``gpus`` visible GPUs running
    ``local_world_size`` ranks (``nccl``: NCCL is usable at all).

    ``auto`` is nccl only when every rank of the host gets a GPU of its own, else gloo: all
    ranks of a host decide alike, so a group never mixes the two.
    """
    if name not in BACKEND_NAMES:
        raise ConfigError(f"unknown backend {name!r}; expected one of {BACKEND_NAMES}")
    if name != "auto":
        return name
    return "nccl" if nccl and gpus >= max(local_world_size, 1) else "gloo"


BF16_NCCL_CAPABILITY = (8, 0)
"""The CUDA compute capability from which NCCL reduces bfloat16 (Ampere)."""


def resolve_backend_name(name: str = "auto", local_world_size: int = 1) -> str:
    """:func:`choose_backend` for this host (imports torch only for ``auto``)."""
    if name != "auto":
        return choose_backend(name, nccl=False, gpus=0, local_world_size=local_world_size)
    import torch

    from flodl.backends.nccl import nccl_usable

    usable = nccl_usable()
    gpus = torch.cuda.device_count() if usable else 0
    return choose_backend(name, nccl=usable, gpus=gpus, local_world_size=local_world_size)


def check_backend_on_host(name: str, local_world_size: int, average_dtype: str = "fp32") -> None:
    """Refuse (ConfigError naming ``--backend``) a backend this host cannot run for
    ``local_world_size`` ranks: nccl needs a torch build with NCCL and a CUDA GPU per rank.
    With ``average_dtype`` bf16, refuse (naming ``--average-dtype``) GPUs whose NCCL cannot
    reduce bf16 (compute capability below 8.0, before Ampere).

    Imports torch only for nccl (and for auto with bf16): gloo runs anywhere and reduces
    every dtype, and auto falls back to gloo.
    """
    if name == "auto" and average_dtype == "bf16":
        name = resolve_backend_name(name, local_world_size)
    if name != "nccl":
        choose_backend(name, nccl=False, gpus=0, local_world_size=local_world_size)
        return
    import torch
    import torch.distributed

    if not torch.distributed.is_nccl_available():
        raise ConfigError(
            f"--backend nccl: this torch build ({torch.__version__}) has no NCCL; "
            "use --backend gloo or auto"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < local_world_size:
        raise ConfigError(
            f"--backend nccl needs a CUDA GPU for each of the {local_world_size} rank(s) on "
            f"this host; torch sees {gpus}. Use --backend gloo, or auto (nccl only where "
            "every rank gets a GPU)"
        )
    if average_dtype == "bf16":
        for gpu in range(local_world_size):
            capability = torch.cuda.get_device_capability(gpu)
            if capability < BF16_NCCL_CAPABILITY:
                raise ConfigError(
                    f"--average-dtype bf16: GPU {gpu} ({torch.cuda.get_device_name(gpu)}, "
                    f"compute capability {capability[0]}.{capability[1]}) cannot reduce bf16 "
                    "over NCCL (8.0, Ampere, and later can); use --average-dtype fp16 or fp32"
                )


def open_backend(
    name: str = "auto", *, local_rank: int = 0, local_world_size: int = 1, **options: Any
) -> Backend:
    """A new backend by name; ``options`` go to its constructor (``op_timeout``, ...).

    nccl without a ``device`` option takes GPU ``local_rank``, the torchrun convention (the
    training script puts its model there too); ConfigError if this host has no such GPU.
    """
    resolved = resolve_backend_name(name, local_world_size)
    if resolved == "nccl":
        import torch

        from flodl.backends.devices import gpu_for
        from flodl.backends.nccl import NcclBackend

        if "device" not in options:
            options["device"] = gpu_for(local_rank, torch.cuda.device_count())
        return NcclBackend(**options)
    from flodl.backends.gloo import GlooBackend

    return GlooBackend(**options)


__all__ = [
    "BACKEND_NAMES",
    "DEFAULT_ALPHA",
    "AverageResult",
    "Backend",
    "PendingAverage",
    "check_backend_on_host",
    "choose_backend",
    "open_backend",
    "resolve_backend_name",
]
