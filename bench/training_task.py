"""The training task both sides of the throughput bench run: same data, model, step and slowdown.

Data: scikit-learn's digits (1797 8x8 images, shipped with scikit-learn, no download), split
80/20 the same way on every rank (the split of ``examples/digits.py``). Model: an MLP
``64 -> hidden -> hidden -> 10`` (hidden 1024: 1.13M parameters, a batch of 32 takes about
10 ms on one thread). Optimizer: Adam. A rank made ``factor`` times slower sleeps
``(factor - 1)`` times its measured compute after each step, as ``examples/digits.py --slow``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits import load_data  # examples/digits.py: the shipped CSV, the same 80/20 split

__all__ = ["TaskConfig", "accuracy", "build_model", "load_data", "parse_task", "train_step"]


@attrs.frozen
class TaskConfig:
    """What is trained, identically by flodl and by DDP."""

    hidden: int = 1024
    batch_size: int = 32
    epochs: int = 12
    lr: float = 1e-3
    seed: int = 0
    slow_rank: int = 3
    slow_factor: float = 2.5

    def args(self) -> list[str]:
        """The command-line form read back by :func:`parse_task`."""
        return [
            f"--hidden={self.hidden}",
            f"--batch-size={self.batch_size}",
            f"--epochs={self.epochs}",
            f"--lr={self.lr}",
            f"--seed={self.seed}",
            f"--slow-rank={self.slow_rank}",
            f"--slow-factor={self.slow_factor}",
        ]


def parse_task(argv: Sequence[str]) -> tuple[TaskConfig, list[str]]:
    """Read ``--name=value`` options written by :meth:`TaskConfig.args`; return the rest."""
    fields = {f.name: f for f in attrs.fields(TaskConfig)}
    values: dict[str, object] = {}
    rest: list[str] = []
    for arg in argv:
        name, sep, raw = arg.removeprefix("--").partition("=")
        key = name.replace("-", "_")
        if arg.startswith("--") and sep and key in fields:
            kind = type(getattr(TaskConfig(), key))
            values[key] = kind(raw)
        else:
            rest.append(arg)
    return TaskConfig(**values), rest  # type: ignore[arg-type]


def build_model(config: TaskConfig) -> torch.nn.Module:
    """The same initial parameters on every rank and on both sides (seeded)."""
    torch.manual_seed(config.seed)
    h = config.hidden
    return torch.nn.Sequential(
        torch.nn.Linear(64, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, 10),
    )


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    factor: float,
    communication_s: Callable[[], float] | None = None,
) -> float:
    """One optimizer step on ``(x, y)``; then, if ``factor > 1``, sleep ``(factor - 1)`` x
    the step's compute time: its wall time less ``communication_s()`` (called after the step:
    seconds spent in collectives inside it, as DDP's gradient all-reduce). Returns the loss."""
    started = time.perf_counter()
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    spent = time.perf_counter() - started
    communicating = communication_s() if communication_s is not None else 0.0
    if factor > 1.0:
        time.sleep((factor - 1.0) * max(spent - communicating, 0.0))
    return float(loss.item())


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of ``x`` classified as ``y``."""
    model.eval()
    predicted = model(x).argmax(dim=1)
    model.train()
    return float((predicted == y).float().mean().item())
