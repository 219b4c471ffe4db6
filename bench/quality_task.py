"""The workloads of the time-to-quality bench, and the clock every run keeps (no downloads).

Three workloads, each built the same way by every process of every variant (seeded: the same
data, the same held-out set, the same initial parameters):

* ``gpt``: a byte-level GPT (2 pre-norm transformer blocks, d_model 128, 4 heads, context 64,
  vocabulary 256, untied embedding and head; 0.47M parameters), AdamW lr 1e-3, batch 32, on the
  text of Python's standard library: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]``
  (``site-packages``/``dist-packages`` left out, so the machine's installs do not change it, and
  ``encodings/``, whose codec tables are generated data rather than code), ordered by the
  sha256 of their relative paths (a fixed shuffle, so the text mixes the whole library instead
  of the modules whose names come first), concatenated as bytes and cut at the first 4 MiB.
  The first 90% by position is the training text, the last 10% the validation text (whole
  files the training text never saw, but the one the cut splits). A training sample is one of
  the non-overlapping 65-byte windows of the training text (64 inputs, the next 64 bytes as
  targets); the validation loss is the mean cross-entropy (nats per byte) over 64 windows at
  fixed, evenly spaced offsets of the validation text.
* ``gpt-b8``: the same at batch 8, where each step's gradient is noisier and more samples
  per step are worth more (not in the default ``--workloads``).
* ``digits``: the digits MLP of ``bench/training_task.py`` (64-1024-1024-10, batch 32) with
  Adam at lr :data:`DIGITS_LR` on ``examples/digits.py``'s 80/20 split; the validation loss is
  the cross-entropy over the 359 test samples.

:class:`BudgetClock` is the training clock of a process: it starts at its first training batch
(start-up is not on it), stops while the process evaluates (evaluation is not on it), and says
when an evaluation point (every ``budget / points`` seconds of training) is due and when the
budget is spent.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
import time
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F
from training_task import TaskConfig
from training_task import build_model as build_digits_mlp
from training_task import load_data as load_digits

__all__ = [
    "WORKLOADS",
    "BudgetClock",
    "DigitsTask",
    "GptTask",
    "RunSpec",
    "Task",
    "TinyGPT",
    "build_task",
    "corpus_info",
    "parse_spec",
    "sample_order",
    "stdlib_corpus",
    "train_step",
    "write_pid",
    "write_result",
]

CORPUS_BYTES = 4 * 2**20
DIGITS_LR = 1e-4
"""Adam's lr on digits: at 1e-3 the fast rank alone reaches its best validation loss within
6 s and then overfits, so every run ties; at 1e-4 it is still improving after 12 s."""
CONTEXT = 64
VALIDATION_SHARE = 0.1
VALIDATION_WINDOWS = 64
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
EXCLUDED_TOP = frozenset({"encodings"})
"""Top-level stdlib folders left out: ``encodings/`` is mostly generated codec tables."""


# --------------------------------------------------------------------------- the corpus


def path_key(name: str) -> str:
    """The order of the corpus's files: the sha256 of the relative path (a fixed shuffle)."""
    return hashlib.sha256(name.encode()).hexdigest()


def stdlib_files(root: Path) -> list[str]:
    """The ``.py`` files under ``root`` (but :data:`EXCLUDED_DIRS` and :data:`EXCLUDED_TOP`),
    as POSIX paths relative to it, in the order of :func:`path_key`."""
    found: list[str] = []
    for directory, subdirs, files in os.walk(root):
        base = Path(directory).relative_to(root)
        subdirs[:] = [
            d
            for d in subdirs
            if d not in EXCLUDED_DIRS and not (base == Path(".") and d in EXCLUDED_TOP)
        ]
        found += [(base / name).as_posix() for name in files if name.endswith(".py")]
    return sorted(found, key=path_key)


@cache
def stdlib_corpus(cap: int = CORPUS_BYTES) -> bytes:
    """The standard library's ``.py`` files in :func:`stdlib_files`' order, concatenated, first
    ``cap`` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    size = 0
    for name in stdlib_files(root):
        data = (root / name).read_bytes()
        parts.append(data)
        size += len(data)
        if size >= cap:
            break
    return b"".join(parts)[:cap]


def corpus_info() -> dict[str, Any]:
    """What the gpt workload trained on (the same Python version gives the same bytes)."""
    corpus = stdlib_corpus()
    return {
        "source": "the .py files under sysconfig.get_paths()['stdlib'] (site-packages, "
        "dist-packages and encodings/ left out), ordered by the sha256 of their relative path, "
        f"concatenated, first {CORPUS_BYTES} bytes",
        "stdlib": sysconfig.get_paths()["stdlib"],
        "bytes": len(corpus),
        "sha256": hashlib.sha256(corpus).hexdigest(),
        "validation": f"last {VALIDATION_SHARE:.0%} by position; {VALIDATION_WINDOWS} windows "
        f"of {CONTEXT} + 1 bytes at evenly spaced offsets",
        "training_samples": f"non-overlapping windows of {CONTEXT} + 1 bytes",
    }


# --------------------------------------------------------------------------- the gpt model


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d_model)
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.ln2 = torch.nn.LayerNorm(d_model)
        self.fc = torch.nn.Linear(d_model, 4 * d_model)
        self.out = torch.nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class TinyGPT(torch.nn.Module):
    """A byte-level GPT; ``forward(tokens)`` returns logits over the 256 byte values."""

    def __init__(
        self, layers: int = 2, d_model: int = 128, heads: int = 4, context: int = CONTEXT
    ) -> None:
        super().__init__()
        self.token = torch.nn.Embedding(256, d_model)
        self.position = torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))
        self.ln = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, 256, bias=False)  # untied: no shared tensors
        for module in self.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                torch.nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        logits: torch.Tensor = self.head(self.ln(self.blocks(x)))
        return logits


# --------------------------------------------------------------------------- the tasks


class Task(Protocol):
    """One workload as a process trains it: its model, optimizer and samples."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset_size: int
    batch_size: int

    def loss(self, indices: torch.Tensor, module: torch.nn.Module | None = None) -> torch.Tensor:
        """The training loss of samples ``indices`` through ``module`` (default: the model)."""
        ...

    def validation_loss(self) -> float:
        """The model's loss on the fixed validation set (eval mode, no gradients)."""
        ...


class GptTask:
    """The ``gpt`` workload (module docstring)."""

    name: str = "gpt"

    def __init__(self, seed: int = 0, batch_size: int = 32, lr: float = 1e-3) -> None:
        data = torch.frombuffer(bytearray(stdlib_corpus()), dtype=torch.uint8).long()
        split = int(len(data) * (1 - VALIDATION_SHARE))
        self.train_data, self.val_data = data[:split], data[split:]
        self.dataset_size: int = (len(self.train_data) - 1) // CONTEXT
        self.batch_size: int = batch_size
        self.span = torch.arange(CONTEXT + 1)
        stride = (len(self.val_data) - CONTEXT - 1) // VALIDATION_WINDOWS
        val_offsets = torch.arange(VALIDATION_WINDOWS) * stride
        self.val_windows = self.val_data[val_offsets[:, None] + self.span]
        torch.manual_seed(seed)
        self.model: torch.nn.Module = TinyGPT()
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def windows(self, indices: torch.Tensor) -> torch.Tensor:
        return self.train_data[indices[:, None] * CONTEXT + self.span]

    @staticmethod
    def window_loss(module: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = module(windows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))

    def loss(self, indices: torch.Tensor, module: torch.nn.Module | None = None) -> torch.Tensor:
        return self.window_loss(module or self.model, self.windows(indices))

    @torch.no_grad()
    def validation_loss(self) -> float:
        self.model.eval()
        try:
            return float(self.window_loss(self.model, self.val_windows).item())
        finally:
            self.model.train()


class DigitsTask:
    """The ``digits`` workload (module docstring)."""

    name: str = "digits"

    def __init__(self, seed: int = 0, batch_size: int = 32, lr: float = 1e-3) -> None:
        config = TaskConfig(seed=seed, batch_size=batch_size, lr=lr)
        self.x_train, self.y_train, self.x_test, self.y_test = load_digits(seed)
        self.dataset_size: int = len(self.x_train)
        self.batch_size: int = batch_size
        self.model: torch.nn.Module = build_digits_mlp(config)
        self.optimizer: torch.optim.Optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def loss(self, indices: torch.Tensor, module: torch.nn.Module | None = None) -> torch.Tensor:
        logits: torch.Tensor = (module or self.model)(self.x_train[indices])
        return F.cross_entropy(logits, self.y_train[indices])

    @torch.no_grad()
    def validation_loss(self) -> float:
        self.model.eval()
        try:
            return float(F.cross_entropy(self.model(self.x_test), self.y_test).item())
        finally:
            self.model.train()


@attrs.frozen
class Workload:
    """A workload's name, how a process builds its task (from a seed), and what it is."""

    name: str
    build: Callable[[int], Task]
    description: str
    budget_s: float
    """The default training budget: short enough that the fast rank alone is still improving
    at its end (a run that has converged cannot show which way gets there sooner)."""


WORKLOADS: dict[str, Workload] = {
    "gpt": Workload(
        "gpt",
        GptTask,
        "byte-level GPT, 2 layers, d_model 128, 4 heads, context 64, AdamW lr 1e-3, batch 32, "
        "on 4 MiB of the standard library's .py files",
        40.0,
    ),
    "gpt-b8": Workload(
        "gpt-b8",
        lambda seed: GptTask(seed, batch_size=8),
        "the gpt workload at batch 8: the same model, text and lr, four times the gradient "
        "noise per step",
        40.0,
    ),
    "digits": Workload(
        "digits",
        lambda seed: DigitsTask(seed, lr=DIGITS_LR),
        f"MLP 64-1024-1024-10, Adam lr {DIGITS_LR:g}, batch 32, on scikit-learn's digits "
        "(80/20 split)",
        12.0,
    ),
}


def build_task(name: str, seed: int = 0) -> Task:
    """The task of workload ``name`` (the same data and initial parameters in every process)."""
    return WORKLOADS[name].build(seed)


def sample_order(dataset_size: int, epoch: int, seed: int) -> torch.Tensor:
    """Epoch ``epoch``'s order of the samples for the runs that are not flodl's (solo, DDP):
    a permutation seeded ``seed + epoch``, the same in every process."""
    return torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + epoch))


def train_step(
    task: Task,
    indices: torch.Tensor,
    factor: float,
    module: torch.nn.Module | None = None,
    communication_s: Callable[[], float] | None = None,
) -> float:
    """One optimizer step on samples ``indices``; then, if ``factor > 1``, sleep ``factor - 1``
    times the step's compute: its wall time less ``communication_s()`` (seconds spent in
    collectives inside it, as DDP's gradient all-reduce). Returns the loss."""
    started = time.perf_counter()
    task.optimizer.zero_grad()
    loss = task.loss(indices, module)
    loss.backward()  # type: ignore[no-untyped-call]
    task.optimizer.step()
    spent = time.perf_counter() - started
    communicating = communication_s() if communication_s is not None else 0.0
    if factor > 1.0:
        time.sleep((factor - 1.0) * max(spent - communicating, 0.0))
    return float(loss.item())


# --------------------------------------------------------------------------- the clock


@attrs.define
class BudgetClock:
    """A process's training clock: from its first batch, evaluation time excluded.

    Evaluation points fall every ``budget_s / points`` seconds of training, the first at 0 (the
    initial model); the last is taken when the budget is spent (:meth:`over`).
    """

    budget_s: float
    points: int = 20
    started: float | None = None
    paused_s: float = 0.0
    next_point: int = 0
    curve: list[dict[str, Any]] = attrs.field(factory=list)
    started_unix: float = 0.0
    now: Callable[[], float] = time.perf_counter
    """The clock read (a test's own)."""

    @property
    def interval_s(self) -> float:
        return self.budget_s / self.points

    def start(self) -> None:
        if self.started is None:
            self.started = self.now()
            self.started_unix = time.time()

    def elapsed(self) -> float:
        """Seconds of training so far (0 before :meth:`start`)."""
        if self.started is None:
            return 0.0
        return self.now() - self.started - self.paused_s

    def due_at(self) -> float:
        """When the next evaluation point falls, in training seconds."""
        return self.next_point * self.interval_s

    def due(self) -> bool:
        """An evaluation point before the budget's end is due."""
        return self.next_point < self.points and self.elapsed() >= self.due_at()

    def over(self) -> bool:
        return self.elapsed() >= self.budget_s

    def evaluate(self, loss: Callable[[], float], **facts: Any) -> float:
        """Evaluate ``loss()`` off the clock and record the point (with ``facts``)."""
        at = self.elapsed()
        before = self.now()
        value = loss()
        self.paused_s += self.now() - before
        self.curve.append({"t": round(at, 4), "loss": round(value, 5), **facts})
        self.next_point = max(self.next_point, math.floor(at / self.interval_s) + 1)
        return value

    def tick(self, task: Task, **facts: Any) -> bool:
        """After a training step: take the evaluation point that is due, or the final one when
        the budget is spent (then True: stop training)."""
        if self.over():
            self.evaluate(task.validation_loss, final=True, **facts)
            return True
        if self.due():
            self.evaluate(task.validation_loss, **facts)
        return False


# --------------------------------------------------------------------------- what a run is told


@attrs.frozen
class RunSpec:
    """What every process of one run is told: the workload, the budget and the layout."""

    workload: str = "digits"
    budget_s: float = 20.0
    points: int = 20
    seed: int = 0
    slow_rank: int = -1
    """The rank made slower (-1: none)."""
    slow_factor: float = 2.5
    result_dir: str = "."
    """The folder rank 0 writes its result to (``result.json``), every process its pid file.
    (Not ``--out``: ``flodl run`` refuses a script argument that abbreviates several of its
    own options, as ``--out`` does ``--outer`` and ``--outer-lr``.)"""

    def args(self) -> list[str]:
        """The command-line form read back by :func:`parse_spec`."""
        return [
            f"--{f.name.replace('_', '-')}={getattr(self, f.name)}" for f in attrs.fields(RunSpec)
        ]

    def factor(self, rank: int) -> float:
        """How much slower ``rank`` runs (1: not slowed)."""
        return self.slow_factor if rank == self.slow_rank else 1.0

    @property
    def result_path(self) -> Path:
        return Path(self.result_dir) / "result.json"


def parse_spec(argv: Sequence[str]) -> tuple[RunSpec, list[str]]:
    """Read the ``--name=value`` options written by :meth:`RunSpec.args`; return the rest."""
    fields = {f.name: f for f in attrs.fields(RunSpec)}
    values: dict[str, Any] = {}
    rest: list[str] = []
    for arg in argv:
        name, sep, raw = arg.removeprefix("--").partition("=")
        key = name.replace("-", "_")
        if arg.startswith("--") and sep and key in fields:
            values[key] = type(getattr(RunSpec(), key))(raw)
        else:
            rest.append(arg)
    return RunSpec(**values), rest


def write_result(spec: RunSpec, clock: BudgetClock, **facts: Any) -> None:
    """Rank 0's result: its curve and ``facts``, written whole (renamed into place)."""
    path = spec.result_path
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "budget_s": spec.budget_s,
        "points": spec.points,
        "started_unix": clock.started_unix,
        "evaluation_s": round(clock.paused_s, 3),
        "curve": clock.curve,
        **facts,
    }
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def write_pid(spec: RunSpec, role: str) -> None:
    """Leave this process's pid in ``result_dir/<role>.pid`` (the bench kills every one it
    finds there when the run ends)."""
    Path(spec.result_dir).mkdir(parents=True, exist_ok=True)
    (Path(spec.result_dir) / f"{role}.pid").write_text(str(os.getpid()))
