"""One flodl rank of the peers bench: ``examples/digits.py``'s task, with the bench's records.

Started by ``bench/peers_bench.py`` through :func:`flodl.launch.launcher.launch` (what ``flodl run
--nproc 3 --policy cadence --backend gloo`` runs). Same data, split, MLP (``64 -> hidden ->
10``), Adam, batch and slowdown as ``examples/digits.py --slow RANK:FACTOR`` (and as the torchft
worker, ``bench/peer_torchft_worker.py``), through the same sync API (``flodl.worker.join``).

Writes ``<marker-dir>/rank<R>.pid`` once joined (the bench SIGKILLs a rank by it) and reports
into the run summary (``final_metrics``): test accuracy, samples trained, the unix times of its
first batch and of the end of its loop, and the CPU seconds of this process (all its threads,
the worker's trio thread included) over that window.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits import accuracy, build_model, load_data, parse_slow  # the demo's task

import flodl.worker
from flodl.errors import FlodlError, ShutdownRequested


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one flodl rank (peers bench)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR")
    parser.add_argument("--marker-dir", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    slow = parse_slow(args.slow)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = build_model(args.hidden, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    samples = 0
    first_batch_unix = 0.0
    cpu_start = 0.0
    try:
        with flodl.worker.join(model, optimizer) as rank:
            args.marker_dir.mkdir(parents=True, exist_ok=True)
            (args.marker_dir / f"rank{rank.rank}.pid").write_text(str(os.getpid()))
            factor = slow.get(rank.rank, 1.0)
            batches = rank.batches(len(x_train), args.batch_size, args.epochs)
            for batch in batches:
                if not first_batch_unix:
                    first_batch_unix = time.time()
                    cpu_start = time.process_time()
                started = time.perf_counter()
                optimizer.zero_grad()
                loss = loss_fn(model(x_train[batch.indices]), y_train[batch.indices])
                loss.backward()
                optimizer.step()
                if factor > 1.0:
                    time.sleep((factor - 1.0) * (time.perf_counter() - started))
                samples += len(batch.indices)
                batch.done(loss.item())
            loop_end_unix = time.time()
            rank.report_final(
                test_accuracy=accuracy(model, x_test, y_test),
                samples=samples,
                first_batch_unix=first_batch_unix,
                loop_end_unix=loop_end_unix,
                cpu_s=time.process_time() - cpu_start,
            )
    except ShutdownRequested as stop:
        print(f"flodl: {stop}", file=sys.stderr, flush=True)
        return 1
    except FlodlError as err:
        print(f"flodl: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the rank has closed its groups and reported; skip torch's slow teardown
