"""One torchft replica group (one process) of the peers bench: the digits MLP under LocalSGD.

Started by ``bench/peers_bench.py`` (its in-namespace trial runner), never by hand. The task is
``examples/digits.py``'s: the same data and 80/20 split, the same MLP (``64 -> hidden -> 10``),
Adam, batch 16, the same seed (identical initial parameters on every replica), and the same
slowdown (the slow replica sleeps ``(factor - 1)`` x each step's compute after the step).

torchft as its README and examples use it: this replica hosts its own TCPStore on 127.0.0.1,
builds ``Manager(pg=ProcessGroupGloo(), min_replica_size, load_state_dict, state_dict,
replica_id, rank=0, world_size=1, lighthouse_addr)`` and trains under
``LocalSGD(manager, model, optimizer, sync_every)``: parameters averaged every ``sync_every``
local steps, the quorum computed at each sync. Before the first batch every replica waits at a
file barrier for the others' Managers (so the lighthouse sees all of them heartbeating) and then
takes one quorum, so the process group is formed before training, as flodl's is.

Data: each replica trains its own slice of a per-epoch permutation (``DistributedSampler``
style, every replica the same number of samples, ``len // nproc``), so all replicas take the
same number of steps and meet at every sync.

Records, in ``--out-dir``:

* ``replica<I>.ready`` (barrier), ``replica<I>.pid``, ``replica<I>.started`` (first batch);
* ``replica<I>.syncs.jsonl``: one line per sync (``unix`` when it returned, ``s`` its duration,
  ``participants`` of its quorum, ``committed``: the manager's step advanced, ``local_steps``);
* ``replica<I>.json`` at the end: samples, training window, test accuracy, CPU seconds of this
  process (all its threads) in the window, steps, syncs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits import accuracy, build_model, load_data  # the demo's data, split and model

BARRIER_TIMEOUT_S = 180.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="one torchft LocalSGD replica (peers bench)")
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--nproc", type=int, default=3)
    parser.add_argument("--lighthouse", default="http://127.0.0.1:29510")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--slow-factor", type=float, default=2.5)
    parser.add_argument("--sync-every", type=int, required=True)
    parser.add_argument("--min-replica-size", type=int, default=2)
    parser.add_argument(
        "--gloo-timeout-s", type=float, default=None, help="None: ProcessGroupGloo's default"
    )
    parser.add_argument(
        "--manager-timeout-s", type=float, default=None, help="None: Manager's default"
    )
    return parser


def write_line(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as sink:
        sink.write(json.dumps(record) + "\n")


def barrier(out_dir: Path, replica: int, nproc: int) -> None:
    """Mark this replica ready and wait until all ``nproc`` are (their Managers exist)."""
    (out_dir / f"replica{replica}.ready").touch()
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while sum((out_dir / f"replica{r}.ready").exists() for r in range(nproc)) < nproc:
        if time.monotonic() > deadline:
            raise SystemExit(f"replica {replica}: barrier timed out after {BARRIER_TIMEOUT_S} s")
        time.sleep(0.02)


def shard(n: int, nproc: int, replica: int, seed: int, epoch: int) -> torch.Tensor:
    """This replica's samples for ``epoch``: a strided slice of a seeded permutation."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1000 + epoch))
    per = n // nproc
    return order[replica::nproc][:per]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    from torchft import Manager, ProcessGroupGloo  # type: ignore[import-untyped, import-not-found, unused-ignore]
    from torchft.local_sgd import LocalSGD  # type: ignore[import-untyped, import-not-found, unused-ignore]

    out: Path = args.out_dir
    me = args.replica
    (out / f"replica{me}.pid").write_text(str(os.getpid()))
    syncs_path = out / f"replica{me}.syncs.jsonl"
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = build_model(args.hidden, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    factor = args.slow_factor if me == args.slow_rank else 1.0

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    store = TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False)
    pg = (
        ProcessGroupGloo()
        if args.gloo_timeout_s is None
        else ProcessGroupGloo(timeout=timedelta(seconds=args.gloo_timeout_s))
    )
    extra: dict[str, Any] = {}
    if args.manager_timeout_s is not None:
        extra["timeout"] = timedelta(seconds=args.manager_timeout_s)
    manager = Manager(
        pg=pg,
        min_replica_size=args.min_replica_size,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{me}",
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        **extra,
    )
    barrier(out, me, args.nproc)
    manager.start_quorum()
    initial_participants = manager.num_participants()  # waits for the quorum

    step_started = 0.0

    def slow_hook(*_: Any) -> None:
        """After the optimizer's arithmetic, before LocalSGD's sync hook: the slowdown."""
        if factor > 1.0:
            time.sleep((factor - 1.0) * (time.perf_counter() - step_started))

    optimizer.register_step_post_hook(slow_hook)  # runs before LocalSGD's (registered later)
    sync_count = 0
    committed_count = 0
    sync_s = 0.0
    samples = 0
    steps = 0
    steps_since_sync = 0
    with LocalSGD(manager, model, optimizer, sync_every=args.sync_every) as local_sgd:
        inner: Callable[[], None] = local_sgd.sync

        def timed_sync() -> None:
            nonlocal sync_count, committed_count, sync_s, steps_since_sync
            before = manager.current_step()
            started = time.perf_counter()
            inner()
            spent = time.perf_counter() - started
            committed = manager.current_step() > before
            sync_count += 1
            committed_count += committed
            sync_s += spent
            write_line(
                syncs_path,
                {
                    "unix": time.time(),
                    "s": round(spent, 6),
                    "participants": manager.num_participants(),
                    "committed": committed,
                    "local_steps": steps_since_sync,
                    "step": manager.current_step(),
                },
            )
            steps_since_sync = 0

        local_sgd.sync = timed_sync  # LocalSGD's post-step hook calls self.sync()
        first_batch_unix = time.time()
        cpu_start = time.process_time()
        (out / f"replica{me}.started").write_text(str(first_batch_unix))
        for epoch in range(args.epochs):
            indices = shard(len(x_train), args.nproc, me, args.seed, epoch)
            for start in range(0, len(indices), args.batch_size):
                batch = indices[start : start + args.batch_size]
                step_started = time.perf_counter()
                optimizer.zero_grad()
                loss = loss_fn(model(x_train[batch]), y_train[batch])
                loss.backward()
                steps += 1
                steps_since_sync += 1
                optimizer.step()  # the slowdown, then (every sync_every steps) the sync
                samples += len(batch)
        if steps_since_sync:
            timed_sync()  # the last partial window, as flodl's final round
        loop_end_unix = time.time()
        cpu_s = time.process_time() - cpu_start
    report = {
        "replica": me,
        "samples": samples,
        "steps": steps,
        "first_batch_unix": first_batch_unix,
        "loop_end_unix": loop_end_unix,
        "cpu_s": round(cpu_s, 4),
        "sync_s": round(sync_s, 4),
        "syncs": sync_count,
        "committed_syncs": committed_count,
        "initial_participants": initial_participants,
        "final_participants": manager.num_participants(),
        "test_accuracy": accuracy(model, x_test, y_test),
    }
    (out / f"replica{me}.json").write_text(json.dumps(report))
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's and torchft's slow teardown (threads, servers)
