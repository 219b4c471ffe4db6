"""Averaging overhead: flodl's averaging round against a bare gloo all-reduce of the same bytes.

:func:`run_overhead` hosts two rendezvous stores and starts ``world`` rank processes (this
file). Each rank builds the same ~10.5M-parameter model (ten 1024x1024 linear layers and a
BatchNorm, so float and integer buffers too), joins a flodl :class:`GlooBackend` group
(``verify=True``, as a rank under ``flodl run`` uses) and a plain ``ProcessGroupGloo`` on the
other store, then repeats, in an order that rotates every repetition so load drift hits all
alike, with a 1-element all-reduce barrier before each:

* ``bare``: ``allreduce`` (SUM) of one flat float32 buffer of the size flodl reduces
  (parameters + mass + mover + float buffers), called directly;
* ``flodl``: ``await backend.average(params, buffers, batches)``, exactly what a rank does on
  SyncNow: the all-reduce of the two sums (mass, movers), the copy of this rank's share
  ``p * m / M`` into scratch (with ``||p||``), the SUM all-reduce in buckets (which yields the
  average), the checksum verify collective (``verify_every`` 10, as a rank: the first round of
  a group and every tenth), the norms ``||a||`` and ``||a - p||`` read as each bucket lands
  (exactly, gloo's default; ``flodl_sampled`` reads them from a fixed 1/16 sample),
  and the parameters made views of the averaged buffer, all in a worker thread;
* ``flodl_no_verify``: the same with ``backend.verify = False``;
* ``flodl_sampled``: ``flodl`` with ``backend.norm_sample = NormSample()`` (the divergence
  norms from a fixed 1/16 of each large parameter; opt-in, see docs/benchmarks.md (a));
* ``flodl_bf16``: ``await backend.average_moves(...)`` in bf16 (``--average-dtype bf16``):
  each rank's move from a reference every rank holds, reduced in 16 bits
  (:mod:`flodl.backends.compressed`); ``round_bytes`` gives the bytes each kind of round
  reduces;
* ``copy_floor``: only what any round that keeps the live tensors out of the collective must
  do: the mass-weighted copy into a scratch buffer, bucket by bucket, each bucket's SUM
  all-reduce started as soon as it is packed (the same buckets as flodl's), then the wait for
  them all; no norms, no divide, no checksum, no install. Its ratio to ``bare``
  (``copy_floor_ratio``) is the lowest ``overhead_ratio`` a scratch-copy round reaches here;
  ``overhead_ratio_over_floor`` is what flodl adds on top;
* ``stages``: the stages of that round run one by one on the calling thread (no trio thread
  hop), each timed, to say where the time goes.

A repetition's figure is the slowest rank's time (each rank's time, MAX-reduced). Figures are
medians over the repetitions after ``warmup`` untimed ones. The SyncNow/SyncAck messages
themselves (tens of microseconds each, see bench/results/wire.json) are not included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import benchenv
import torch
import torch.distributed as dist
import trio
from torch._C._distributed_c10d import ProcessGroupGloo

from flodl.averaging.kernels import NormSample, gap_piece, share_piece
from flodl.averaging.mass import HEADER, FlatLayout, bit_checksum, divisors, read_sums, scaled_copy
from flodl.backends.gloo import GlooBackend
from flodl.backends.group import GroupInfo, connect_store, host_store
from flodl.backends.pipeline import BucketPlan, ScratchPool, _source, install, members

HERE = Path(__file__).resolve()
VARIANTS = (
    "bare",
    "copy_floor",
    "flodl",
    "flodl_no_verify",
    "flodl_sampled",
    "flodl_bf16",
    "stages",
)
STAGES = ("sums", "share", "allreduce", "checksum", "verify_allreduce", "gap", "install")


def build_model(width: int = 1024, layers: int = 10) -> torch.nn.Module:
    """``layers`` linear layers ``width x width`` and one BatchNorm (10.5M parameters)."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = [torch.nn.Linear(width, width) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.BatchNorm1d(width))


class Bare:
    """A plain gloo group and the calls the bench makes on it."""

    def __init__(self, info: GroupInfo, rank: int, world: int) -> None:
        store = connect_store(info, timedelta(seconds=60))
        self.pg: Any = ProcessGroupGloo(store, rank, world, timedelta(seconds=60))

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        self.pg.allreduce([tensor], opts).wait()

    def start_allreduce(self, tensor: torch.Tensor) -> Any:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        return self.pg.allreduce([tensor], opts)

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1), dist.ReduceOp.SUM)


class CopyFloor:
    """The scratch copy and the bucketed all-reduce alone (see ``copy_floor`` above)."""

    def __init__(
        self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], buckets: int | None
    ) -> None:
        self.layout = FlatLayout.of(params, buffers)
        self.plan = BucketPlan.of(self.layout, buckets)
        self.scratch = ScratchPool().take(self.plan).flat

    @torch.no_grad()
    def round(
        self, bare: Bare, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]
    ) -> None:
        sources = members(params, buffers, self.layout)
        ops = []
        for bucket in self.plan.buckets:
            for piece in bucket.pieces:
                scaled_copy(_source(sources, piece), 2.0, self.scratch[piece.start : piece.end])
            ops.append(bare.start_allreduce(self.scratch[bucket.start : bucket.end]))
        for op in ops:
            op.wait()


class Staged:
    """flodl's round, stage by stage on this thread, with the functions the backend calls: one
    bucket, two scratch buffers that alternate (as the backend's after a swapping install)."""

    def __init__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        self.layout = FlatLayout.of(params, buffers)
        self.plan = BucketPlan.of(self.layout, None)
        self.scratch = [ScratchPool().take(self.plan) for _ in range(2)]
        self.turn = 0

    @torch.no_grad()
    def round(
        self,
        bare: Bare,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
    ) -> dict[str, float]:
        scratch = self.scratch[self.turn]
        self.turn = 1 - self.turn
        flat, layout = scratch.flat, self.layout
        times: dict[str, float] = {}
        clock = time.perf_counter
        t = clock()
        flat[0], flat[1] = float(batches), 1.0
        bare.allreduce(flat[:HEADER], dist.ReduceOp.SUM)
        by_mass, by_movers = divisors(read_sums(flat, layout))
        times["sums"], t = clock() - t, clock()
        sources = members(params, buffers, layout)
        pieces = self.plan.buckets[0].pieces
        for piece in pieces:
            share = (batches / by_mass) if piece.is_param else (1.0 / by_movers)
            share_piece(_source(sources, piece), flat[piece.start : piece.end], share)
        times["share"], t = clock() - t, clock()
        bare.allreduce(flat[HEADER:], dist.ReduceOp.SUM)
        times["allreduce"], t = clock() - t, clock()
        check = bit_checksum(flat)
        times["checksum"], t = clock() - t, clock()
        pair = torch.tensor([check, -check], dtype=torch.int64)
        bare.allreduce(pair, dist.ReduceOp.MAX)
        times["verify_allreduce"], t = clock() - t, clock()
        for piece in pieces:
            if piece.is_param:
                average = flat[piece.start : piece.end]
                source = _source(sources, piece)
                gap_piece(
                    average, source, scratch.spare, GlooBackend.default_norm_sample, piece.start
                )
        times["gap"], t = clock() - t, clock()
        install(flat, layout, params, buffers, swap=True)
        times["install"] = clock() - t
        return times


async def rank_main(
    rank: int,
    world: int,
    flodl_info: bytes,
    bare_info: GroupInfo,
    reps: int,
    warmup: int,
    width: int,
    layers: int,
) -> dict[str, Any]:
    """Run every variant ``warmup + reps`` times; the slowest rank's seconds per repetition."""
    torch.set_num_threads(1)
    model = build_model(width, layers)
    params, buffers = list(model.parameters()), list(model.buffers())
    backend = GlooBackend(op_timeout=120.0, join_timeout=60.0)
    await backend.join_group(flodl_info, rank, world, generation=0)
    bare = await trio.to_thread.run_sync(Bare, bare_info, rank, world)
    layout = FlatLayout.of(params, buffers)
    flat = torch.zeros(layout.total)
    staged = Staged(params, buffers)
    floor = CopyFloor(params, buffers, backend.bucket_elements)
    batches = 10 + rank  # unequal masses, as after a Cadence window

    def timed(fn: Callable[[], object]) -> float:
        bare.barrier()
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    reference = [p.detach().clone() for p in params]  # the same model on every rank

    async def bf16_round() -> float:
        bare.barrier()
        started = time.perf_counter()
        await backend.average_moves(params, buffers, reference, batches, torch.bfloat16)
        return time.perf_counter() - started

    async def flodl_round(verify: bool, sample: NormSample | None = None) -> float:
        backend.verify, backend.norm_sample = verify, sample
        bare.barrier()
        started = time.perf_counter()
        await backend.average(params, buffers, batches)
        return time.perf_counter() - started

    rows: list[dict[str, float]] = []
    try:
        for rep in range(warmup + reps):
            row: dict[str, float] = {}
            shift = rep % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                if variant == "bare":
                    row["bare"] = timed(lambda: bare.allreduce(flat, dist.ReduceOp.SUM))
                elif variant == "copy_floor":
                    row["copy_floor"] = timed(lambda: floor.round(bare, params, buffers))
                elif variant == "flodl":
                    row["flodl"] = await flodl_round(True)
                elif variant == "flodl_no_verify":
                    row["flodl_no_verify"] = await flodl_round(False)
                elif variant == "flodl_sampled":
                    row["flodl_sampled"] = await flodl_round(True, NormSample())
                elif variant == "flodl_bf16":
                    row["flodl_bf16"] = await bf16_round()
                else:
                    bare.barrier()
                    row.update(staged.round(bare, params, buffers, batches))
            keys = sorted(row)
            worst = torch.tensor([row[k] for k in keys], dtype=torch.float64)
            bare.allreduce(worst, dist.ReduceOp.MAX)
            if rep >= warmup:
                rows.append(dict(zip(keys, worst.tolist(), strict=True)))
    finally:
        await backend.close()
        bare.pg = None
    floats = sum(b.numel() for b in buffers if b.is_floating_point())
    return {
        "parameters": sum(p.numel() for p in params),
        "flat_elements": layout.total,
        # What each kind of round all-reduces: the flat float32 buffer; the moves in bf16
        # plus the float buffers in float64 and the two float64 sums.
        "round_bytes": {
            "fp32": 4 * layout.total,
            "bf16": 2 * sum(p.numel() for p in params) + 8 * floats + 16,
        },
        "rows": rows,
    }


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Medians in ms, the per-repetition ratio flodl / bare (median) and the stage shares."""

    def median_ms(key: str) -> float:
        return round(1000 * statistics.median(r[key] for r in rows), 3)

    ratios = [r["flodl"] / r["bare"] for r in rows]
    stages = {name: median_ms(name) for name in STAGES}
    return {
        "repetitions": len(rows),
        "bare_allreduce_ms": median_ms("bare"),
        "flodl_round_ms": median_ms("flodl"),
        "flodl_round_no_verify_ms": median_ms("flodl_no_verify"),
        "overhead_ratio": round(statistics.median(ratios), 3),
        "overhead_ratio_no_verify": round(
            statistics.median(r["flodl_no_verify"] / r["bare"] for r in rows), 3
        ),
        "overhead_ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
        "copy_floor_ms": median_ms("copy_floor"),
        "copy_floor_ratio": round(statistics.median(r["copy_floor"] / r["bare"] for r in rows), 3),
        "overhead_ratio_over_floor": round(
            statistics.median(r["flodl"] / r["copy_floor"] for r in rows), 3
        ),
        "flodl_round_sampled_ms": median_ms("flodl_sampled"),
        "flodl_round_bf16_ms": median_ms("flodl_bf16"),
        "bf16_round_ratio": round(statistics.median(r["flodl_bf16"] / r["flodl"] for r in rows), 3),
        "overhead_ratio_over_floor_sampled": round(
            statistics.median(r["flodl_sampled"] / r["copy_floor"] for r in rows), 3
        ),
        "stages_ms": stages,
        "stages_sum_ms": round(sum(stages.values()), 3),
    }


def run_overhead(
    world: int = 2,
    reps: int = 12,
    warmup: int = 2,
    width: int = 1024,
    layers: int = 10,
    timeout: float = 240.0,
) -> dict[str, Any]:
    """Start ``world`` rank processes, collect rank 0's rows, summarize them.

    Every process started here has exited when this returns or raises (killed on timeout).
    """
    flodl_store, flodl_info = host_store(0, "127.0.0.1")
    bare_store, bare_info = host_store(1, "127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="avg-bench-") as tmp:
        out = Path(tmp) / "rank0.json"
        command = [
            sys.executable,
            str(HERE),
            f"--world={world}",
            f"--flodl-info={flodl_info.encode().hex()}",
            f"--bare-info={bare_info.encode().hex()}",
            f"--reps={reps}",
            f"--warmup={warmup}",
            f"--out={out}",
            f"--width={width}",
            f"--layers={layers}",
        ]
        benchenv.run_ranks(
            [[*command, f"--rank={r}"] for r in range(world)], timeout, "averaging bench"
        )
        data = json.loads(out.read_text())
    del flodl_store, bare_store
    return {
        "world_size": world,
        "model": f"{layers} x Linear({width}, {width}) + BatchNorm1d({width})",
        "parameters": data["parameters"],
        "flat_elements": data["flat_elements"],
        "round_bytes": data["round_bytes"],
        "warmup": warmup,
        **summarize(data["rows"]),
    }


def standalone(argv: Sequence[str]) -> int:
    """The bench alone (part (a) of training_bench.py): run it, write the figures as JSON."""
    parser = argparse.ArgumentParser(description="averaging-overhead bench, standalone")
    parser.add_argument("--output", type=Path, default=HERE.parent / "results/averaging.json")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    before = benchenv.load()
    result = run_overhead(reps=args.reps)
    result["load_before"], result["load_after"] = before, benchenv.load()
    result["environment"] = benchenv.environment(["torch", "numba"])
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def main(argv: Sequence[str]) -> int:
    if not any(a.startswith("--rank") for a in argv):
        return standalone(argv)
    parser = argparse.ArgumentParser(description="one rank of the averaging-overhead bench")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--flodl-info", required=True)
    parser.add_argument("--bare-info", required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=10)
    args = parser.parse_args(argv)
    result = trio.run(
        rank_main,
        args.rank,
        args.world,
        bytes.fromhex(args.flodl_info),
        GroupInfo.decode(bytes.fromhex(args.bare_info)),
        args.reps,
        args.warmup,
        args.width,
        args.layers,
    )
    if args.rank == 0:
        args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # Groups are closed and the report written; skip torch's interpreter teardown, which can
    # still abort with gloo (Pitfall P4 in torch-gloo-trio-notes.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
