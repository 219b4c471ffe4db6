"""Where a ``flodl worker`` sits in the job: from its flags, or from the scheduler that started it.

``srun flodl worker --coordinator tcp://HOST:PORT script.py`` takes its place from Slurm's
variables, and a worker started by ``torchrun`` from torchrun's; ``--rank``/``--world-size``
given on the command line win over both. Pure: reads a mapping, never the process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import attrs

from flodl.errors import ConfigError

__all__ = ["RankLayout", "layout_from", "nproc_of", "ranks_of"]


@attrs.frozen
class RankLayout:
    """One rank's place: ``node`` is the host's index (torchrun's GROUP_RANK)."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    source: str = "flags"
    """Where it came from: ``flags``, ``torchrun`` or ``slurm``."""

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"world size must be >= 1 ({self.source}), got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"rank {self.rank} is not below the world size {self.world_size} ({self.source})"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(
                f"local rank {self.local_rank} is not below the ranks of this host "
                f"{self.local_world_size} ({self.source})"
            )


def _int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "").strip()
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from None


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """This node's task count: SLURM_NTASKS_PER_NODE, else the entry of
    SLURM_TASKS_PER_NODE (``2(x3),1``: 2 tasks on each of 3 nodes, then 1) for SLURM_NODEID."""
    if env.get("SLURM_NTASKS_PER_NODE", "").strip():
        return _int(env, "SLURM_NTASKS_PER_NODE")
    text = env.get("SLURM_TASKS_PER_NODE", "").strip()
    if not text:
        return 1
    node = _int(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else 0
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ConfigError(f"SLURM_TASKS_PER_NODE: cannot read {text!r}")
        tasks, repeat = int(match.group(1)), int(match.group(2) or 1)
        if node < repeat:
            return tasks
        node -= repeat
    raise ConfigError(f"SLURM_TASKS_PER_NODE {text!r} has no entry for SLURM_NODEID")


def layout_from(
    env: Mapping[str, str],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> RankLayout:
    """The layout the flags give (both ``rank`` and ``world_size``), else torchrun's
    variables (a process torchrun started: ``TORCHELASTIC_RUN_ID`` is set), else Slurm's
    (``SLURM_PROCID``). ConfigError saying what is missing, or which variable is bad.

    With the flags, the place on the host comes from ``local_rank`` and ``local_world_size``
    (``--local-rank``, ``--local-world-size``), else from ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` where set, else 0 of 1 (one worker on the host): never every worker
    of a host on GPU 0 unless that is what was said."""
    if rank is not None and world_size is not None:
        if local_rank is None and env.get("LOCAL_RANK", "").strip():
            local_rank = _int(env, "LOCAL_RANK")
        if local_world_size is None and env.get("LOCAL_WORLD_SIZE", "").strip():
            local_world_size = _int(env, "LOCAL_WORLD_SIZE")
        local = 0 if local_rank is None else local_rank
        size = local + 1 if local_world_size is None else local_world_size
        return RankLayout(rank, world_size, local, size)
    if local_rank is not None or local_world_size is not None:
        raise ConfigError("--local-rank and --local-world-size go with --rank and --world-size")
    if rank is not None or world_size is not None:
        raise ConfigError("give both --rank and --world-size, or neither (scheduler's layout)")
    if env.get("TORCHELASTIC_RUN_ID"):
        return RankLayout(
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK"),
            _int(env, "LOCAL_WORLD_SIZE"),
            _int(env, "GROUP_RANK"),
            source="torchrun",
        )
    if env.get("SLURM_PROCID", "").strip():
        return RankLayout(
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID"),
            _tasks_on_this_node(env),
            _int(env, "SLURM_NODEID"),
            source="slurm",
        )
    raise ConfigError(
        "--rank and --world-size are needed: no scheduler's layout in the environment "
        "(neither torchrun's TORCHELASTIC_RUN_ID/RANK nor Slurm's SLURM_PROCID)"
    )


def ranks_of(flag: str, text: str | None) -> frozenset[int] | None:
    """``0,2,5`` (or ``0-3``) -> the set of ranks; None stays None. ConfigError if bad."""
    if text is None:
        return None
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            ranks.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ConfigError(f"{flag} must list ranks like 0,2 or 0-3, got {text!r}") from None
    return frozenset(ranks)


def nproc_of(text: str) -> int:
    """``--nproc``'s value as torchrun reads ``--nproc-per-node``: a number, ``gpu`` (the
    visible GPUs; ConfigError when there are none), ``cpu`` (the CPU cores) or ``auto``
    (``gpu`` where CUDA is usable, else ``cpu``). Imports torch only for ``gpu``/``auto``."""
    if text in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            return gpus
        if text == "gpu":
            raise ConfigError("--nproc gpu: torch sees no usable GPU on this host")
        text = "cpu"
    if text == "cpu":
        return os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--nproc must be a number, auto, gpu or cpu, got {text!r}") from None
