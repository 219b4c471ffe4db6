"""Train a small MLP on scikit-learn's digits with flodl, on ranks of unequal speed.

Run 3 ranks, rank 2 three times slower than the others (emulated mixed hardware)::

    flodl run --nproc 3 --policy cadence examples/digits.py --epochs 8 --slow 2:3

The digits data ships with scikit-learn (no download). Every rank builds the same train/test
split and the same initial model; the coordinator hands out which samples each rank trains
on and when they average. ``--slow RANK:FACTOR`` makes a rank sleep ``(FACTOR - 1)`` times
each step's measured compute time after the step. At the end each rank evaluates its model
on the test split, prints the accuracy and reports it into the run summary.

Exit codes: 0 when the run completed or the coordinator asked to save and stop (the bundle
is in the run directory); 1 when the coordinator was lost or another flodl error occurred.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

import flodl.worker
from flodl.errors import FlodlError, ShutdownRequested


def parse_slow(values: Sequence[str]) -> dict[int, float]:
    """``["2:3", "0:1.5"]`` -> ``{2: 3.0, 0: 1.5}``; factors must be >= 1."""
    slow: dict[int, float] = {}
    for value in values:
        rank, sep, factor = value.partition(":")
        try:
            if not sep:
                raise ValueError
            slow[int(rank)] = float(factor)
        except ValueError:
            raise SystemExit(f"--slow expects RANK:FACTOR (e.g. 2:3), got {value!r}") from None
        if slow[int(rank)] < 1.0:
            raise SystemExit(f"--slow factor must be >= 1, got {value!r}")
    return slow


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="model init and data split seed")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where to train; cuda means GPU LOCAL_RANK (run with --backend nccl)",
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        metavar="A",
        help="rank 0 checks the test accuracy at each epoch's start and stops the run for "
        "every rank (rank.stop) once it reaches A",
    )
    parser.add_argument(
        "--slow",
        action="append",
        default=[],
        metavar="RANK:FACTOR",
        help="make RANK slower by FACTOR (repeatable)",
    )
    return parser


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: 1797 8x8 images (64 features, 0..16) and their labels.

    Read straight from the CSV that ships with scikit-learn (no download), which avoids
    importing scikit-learn and SciPy (about a second per rank); falls back to
    ``sklearn.datasets.load_digits`` if the file is not where it usually is.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
        if path.exists():
            table = np.loadtxt(path, delimiter=",", dtype=np.float32)
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data.astype(np.float32), digits.target.astype(np.int64)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits split 80/20 the same way on every rank; pixels scaled to [0, 1]."""
    features, labels = digits_arrays()
    x = torch.from_numpy(features / 16.0)
    y = torch.from_numpy(labels)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test = order[: len(y) // 5]
    train = order[len(y) // 5 :]
    return x[train], y[train], x[test], y[test]


def build_model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial parameters on every rank
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    predicted = model(x).argmax(dim=1)
    model.train()
    return float((predicted == y).float().mean().item())


def rank_device(name: str) -> torch.device:
    """``cpu``, or ``cuda`` as the GPU this rank's NCCL group averages on (``LOCAL_RANK``)."""
    if name == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    slow = parse_slow(args.slow)
    torch.set_num_threads(1)
    device = rank_device(args.device)
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_data(args.seed))
    model = build_model(args.hidden, args.seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()

    try:
        with flodl.worker.join(model, optimizer) as rank:
            factor = slow.get(rank.rank, 1.0)
            epoch = -1
            batches = rank.batches(
                dataset_size=len(x_train), batch_size=args.batch_size, epochs=args.epochs
            )
            for batch in batches:
                if batch.epoch != epoch:
                    epoch = batch.epoch
                    print(f"rank {rank.rank}: epoch {epoch} started", flush=True)
                    if args.target_accuracy is not None and rank.rank == 0:
                        reached = accuracy(model, x_test, y_test)
                        if reached >= args.target_accuracy:
                            rank.stop(f"test accuracy {reached:.4f} >= {args.target_accuracy}")
                started = time.perf_counter()
                optimizer.zero_grad()
                loss = loss_fn(model(x_train[batch.indices]), y_train[batch.indices])
                loss.backward()
                optimizer.step()
                if factor > 1.0:
                    time.sleep((factor - 1.0) * (time.perf_counter() - started))
                batch.done(loss.item())
            test_accuracy = accuracy(model, x_test, y_test)
            rank.report_final(test_accuracy=test_accuracy)
            print(f"rank {rank.rank}: test accuracy {test_accuracy:.4f}", flush=True)
    except ShutdownRequested as stop:  # saved, and said so: caught to leave by os._exit below
        return stop.exit_status
    except FlodlError as err:
        print(f"flodl: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    # The rank has closed its process groups and written its report (the `with` block above
    # guarantees both); skip torch's slow interpreter teardown (seconds on a loaded machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
