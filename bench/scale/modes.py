"""The measurements: the in-process mode (coordinator and ranks share one trio run over
``memory://``), the split mode (the coordinator alone in this process, the ranks in generator
processes), the membership change after the split mode's window, and cProfile runs."""

from __future__ import annotations

import cProfile
import gc
import itertools
import os
import pstats
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import trio
import trio.lowlevel

from flodl.config import CoordinatorConfig
from flodl.coordinator.server import open_coordinator
from flodl.core.coordinator.machine import CoordinatorMachine
from flodl.core.coordinator.timeline import EventKind, TimelineEvent
from flodl.transports.memory_reader import MemoryReader

from .generator import (
    GENERATOR_EXIT_GRACE_S,
    GENERATOR_LAG_LIMIT_S,
    CpuPlan,
    GeneratorProcess,
    open_generators,
)
from .ranks import KEY, LeanRank, Metronome
from .record import CpuSplit, MachineTimer, Recorder, summarize_ms, timer_probe
from .report import base_row, share
from .stamps import trio_clock_offset

WARMUP_LIMIT_S = 120.0
WARMUP_PER_RANK_S = 0.02
"""Each rank adds this to the warm-up's limit (16,384 ranks: 448 s in all): the load generator
brings ranks in at a rate that falls as the ones already in send their heartbeats."""


async def warm_up(recorder: Recorder, machine: CoordinatorMachine, ranks: int) -> None:
    """Wait for the warm-up (round ``WARMUP_ROUNDS`` started); RuntimeError saying where it
    stood after ``WARMUP_LIMIT_S`` plus ``WARMUP_PER_RANK_S`` per rank."""
    limit = WARMUP_LIMIT_S + WARMUP_PER_RANK_S * ranks
    with trio.move_on_after(limit):
        await recorder.warm.wait()
        return
    raise RuntimeError(
        f"{ranks} ranks: no warm-up within {limit:g} s (phase {machine.phase.value}, "
        f"{len(machine.alive)} connected, {len(machine.members)} members, "
        f"round {machine.cycle.round})"
    )


_run_names = itertools.count()


async def measure(ranks: int, seconds: float, seed: int, split: CpuSplit) -> dict[str, Any]:
    """Serve ``ranks`` lean ranks with one real coordinator; measure ``seconds`` after warm-up."""
    recorder = Recorder(ranks)
    rng = random.Random(seed)
    url = f"memory://coordinator-scale-{os.getpid()}-{next(_run_names)}"
    load_before = os.getloadavg()[0]
    started = trio.current_time()
    with trio.CancelScope() as everything:
        async with open_coordinator(
            url, ranks, KEY, CoordinatorConfig(), linger=0.0, freeze_heap=True
        ) as coord:
            machine = coord.machine
            coord.set_probe(MachineTimer(recorder, machine))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(timer_probe, recorder)
                metronome = Metronome(recorder)
                nursery.start_soon(metronome.run)
                rank_reader = MemoryReader()  # one task reads every simulated rank
                nursery.start_soon(rank_reader.run, name="LeanRank.reader")
                for rank in range(ranks):
                    lean = LeanRank(rank, ranks, recorder, metronome, rng)
                    nursery.start_soon(lean.run, coord.url, KEY, rank_reader)
                await warm_up(recorder, coord.machine, ranks)
                warm_at = trio.current_time()
                cpu_before, wall_before = time.process_time(), time.perf_counter()
                split_before = split.snapshot()
                recorder.measuring = True
                await trio.sleep(seconds)
                recorder.measuring = False
                cpu = time.process_time() - cpu_before
                wall = time.perf_counter() - wall_before
                split_after = split.snapshot()
                rounds = machine.cycle.round
                anchor = machine.elche.anchor
                # End the run first (hang-ups after the end are not deaths), then cancel the
                # coordinator and the ranks together, so no connection ends in an error.
                coord.request_stop(save=True)
                everything.cancel()
    steps = {k: split_after[k] - split_before[k] for k in split.CATEGORIES}
    row = base_row(
        ranks, recorder, cpu, wall, recorder.sent, warm_at - started, rounds, anchor, load_before
    )
    received = row["messages"]
    coordinator_s = steps["coordinator"]
    row.update(
        {
            "unmatched_messages": recorder.unmatched,
            "rank_lag": summarize_ms(recorder.rank_lag),
            "late_rank_ticks": recorder.late_rank_ticks,
            "coordinator_cpu_us_per_message": round(coordinator_s / received * 1e6, 2)
            if received
            else None,
            "cpu_split_share": {
                "coordinator": share(coordinator_s, cpu),
                "coordinator_machine": share(recorder.machine_s, cpu),
                "ranks": share(steps["ranks"], cpu),
                "probe": share(steps["probe"], cpu),
                "other_tasks": share(steps["trio"], cpu),
                "scheduler_and_io": share(cpu - sum(steps.values()), cpu),
            },
        }
    )
    return row


def run_inprocess(ranks: int, seconds: float, seed: int) -> dict[str, Any]:
    """One rank count in a fresh trio run (with the CPU-split instrument installed)."""
    split = CpuSplit()
    gc.collect()
    row: dict[str, Any] = trio.run(measure, ranks, seconds, seed, split, instruments=[split])
    return row


async def measure_split(
    ranks: int,
    seconds: float,
    seed: int,
    transport: str,
    generators: int,
    plan: CpuPlan,
    per_host: int = 0,
) -> dict[str, Any]:
    """Serve ``ranks`` ranks run by generator processes; measure ``seconds`` after warm-up.
    ``per_host`` > 0: the ranks reach it through simulated node agents of that many ranks
    (:mod:`.hosts`), and a host loss is timed after the membership change."""
    recorder = Recorder(ranks, clock_offset=trio_clock_offset())
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flodl-scale-") as folder:
        url = f"unix://{folder}/coordinator.sock" if transport == "unix" else "tcp://127.0.0.1:0"
        started = trio.current_time()
        with trio.CancelScope() as everything:
            async with open_coordinator(
                url, ranks, KEY, CoordinatorConfig(), linger=0.0, freeze_heap=True
            ) as coord:
                machine = coord.machine
                coord.set_probe(MachineTimer(recorder, machine))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(timer_probe, recorder)
                    async with open_generators(
                        coord.url, ranks, seed, generators, plan.generators, per_host
                    ) as children:
                        await warm_up(recorder, machine, ranks)
                        warm_at = trio.current_time()
                        # The generators' windows open first (a pipe write each), so that the
                        # acks of the round whose start ended the warm-up fall in both windows.
                        for child in children:
                            await child.command("start")
                        cpu_before, wall_before = time.process_time(), time.perf_counter()
                        recorder.measuring = True
                        await trio.sleep(seconds)
                        recorder.measuring = False
                        cpu = time.process_time() - cpu_before
                        wall = time.perf_counter() - wall_before
                        reports = [await child.stop() for child in children]
                        rounds = machine.cycle.round
                        anchor = machine.elche.anchor
                        regroup = (
                            await membership_change(machine, children, ranks // 2)
                            if ranks >= MIN_RANKS_FOR_REGROUP
                            else None
                        )
                        lost_host = (
                            await host_loss(machine, children, ranks // per_host // 4, per_host)
                            if per_host and ranks >= 2 * per_host
                            else None
                        )
                        # The ranks leave on the shutdown (closing a socket with unread data
                        # would reset it: let them read it all); then their processes exit.
                        coord.request_stop(save=True)
                        with trio.move_on_after(GENERATOR_EXIT_GRACE_S):
                            await coord.wait_all_hung_up()
                    everything.cancel()
    sent = Counter[str]()
    for part in reports:
        sent.update(part["sent_by_kind"])
    row = base_row(ranks, recorder, cpu, wall, sent, warm_at - started, rounds, anchor, load_before)
    lag_p99 = max(part["lag"]["p99_ms"] for part in reports)
    kept_up = lag_p99 < GENERATOR_LAG_LIMIT_S * 1000.0
    if per_host:
        row["layout"] = f"{ranks // per_host} agents x {per_host} ranks"
        row["host_loss"] = lost_host
    row.update(
        {
            "membership_change": regroup,
            "transport": transport,
            "unstamped_messages": recorder.unstamped,
            "coordinator_machine_share": share(recorder.machine_s, cpu),
            "generator_lag_p99_ms": lag_p99,
            "generator_cpu_share_of_wall": max(part["cpu_share_of_wall"] for part in reports),
            "generator_kept_up": kept_up,
            "verdict": "meets"
            if row["meets_target"]
            else ("misses" if kept_up else "generator_limited"),
            "generators": reports,
        }
    )
    return row


MIN_RANKS_FOR_REGROUP = 4
REGROUP_LIMIT_S = 30.0
REGROUP_POLL_S = 0.002


async def membership_change(
    machine: CoordinatorMachine, children: Sequence[GeneratorProcess], victim: int
) -> dict[str, Any]:
    """Kill simulated rank ``victim`` (its generator closes its socket) and time the
    coordinator's decision: the death detected (``RANK_DEAD``) to the next generation of the
    group committed (``GROUP_REFORMED``: the survivors' generator answered and every survivor
    was sent its NewGroupSession), in trio time, as the machine's own ``took_s`` records it.
    Also the wall time from the kill command to the commit, and the coordinator's CPU time
    over it (timeline polled every 2 ms, so the wall figures are up to that late)."""
    seq = machine.timeline.added
    child = next(c for c in children if victim in c.ranks)
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    killed_at = trio.current_time()
    await child.command(f"kill {victim}")
    dead_at: float | None = None
    formed: TimelineEvent | None = None
    with trio.move_on_after(REGROUP_LIMIT_S):
        while formed is None:
            await trio.sleep(REGROUP_POLL_S)
            for _, event in machine.timeline.since(seq):
                if event.kind is EventKind.RANK_DEAD and event.detail.get("rank") == victim:
                    dead_at = event.time
                elif event.kind is EventKind.GROUP_REFORMED:
                    formed = event
                    break
    wall = time.perf_counter() - wall_before
    cpu = time.process_time() - cpu_before
    took = None if formed is None else formed.detail.get("took_s")
    return {
        "killed_rank": victim,
        "committed": formed is not None,
        "decision_s": None if took is None else round(took, 4),
        "decision_is": "RANK_DEAD to GROUP_REFORMED (trio time, the machine's took_s)",
        "kill_to_dead_s": None if dead_at is None else round(dead_at - killed_at, 4),
        "kill_to_commit_wall_s": round(wall, 4) if formed is not None else None,
        "coordinator_cpu_s": round(cpu, 4),
        "generation": None if formed is None else formed.detail.get("generation"),
        "members_after": None if formed is None else len(formed.detail.get("members", [])),
    }


async def host_loss(
    machine: CoordinatorMachine, children: Sequence[GeneratorProcess], node: int, per_host: int
) -> dict[str, Any]:
    """Kill simulated agent ``node`` (its generator closes its socket: every rank it carried
    is gone at once) and time the coordinator's decision: the kill to the first generation of
    the group committed without any of the host's ranks, in wall time (timeline polled every
    2 ms), with the machine's ``took_s`` for that regroup and the coordinator's CPU time."""
    lost = set(range(node * per_host, (node + 1) * per_host))
    seq = machine.timeline.added
    child = next(c for c in children if node * per_host in c.ranks)
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    killed_at = trio.current_time()
    await child.command(f"killhost {node}")
    dead: dict[int, float] = {}
    formed: TimelineEvent | None = None
    with trio.move_on_after(REGROUP_LIMIT_S):
        while formed is None:
            await trio.sleep(REGROUP_POLL_S)
            for _, event in machine.timeline.since(seq):
                if event.kind is EventKind.RANK_DEAD and event.detail.get("rank") in lost:
                    dead.setdefault(event.detail["rank"], event.time)
                elif event.kind is EventKind.GROUP_REFORMED and not lost & set(
                    event.detail.get("members", [])
                ):
                    formed = event
                    break
            seq = machine.timeline.added
    wall = time.perf_counter() - wall_before
    cpu = time.process_time() - cpu_before
    took = None if formed is None else formed.detail.get("took_s")
    return {
        "killed_node": node,
        "ranks_lost": len(lost),
        "committed": formed is not None,
        "decision_s": None if took is None else round(took, 4),
        "kill_to_all_dead_s": round(max(dead.values()) - killed_at, 4)
        if len(dead) == len(lost)
        else None,
        "kill_to_commit_wall_s": round(wall, 4) if formed is not None else None,
        "coordinator_cpu_s": round(cpu, 4),
        "generation": None if formed is None else formed.detail.get("generation"),
        "members_after": None if formed is None else len(formed.detail.get("members", [])),
    }


def run_split(
    ranks: int,
    seconds: float,
    seed: int,
    transport: str,
    generators: int,
    plan: CpuPlan,
    per_host: int = 0,
) -> dict[str, Any]:
    """One rank count in a fresh trio run, this process pinned to the coordinator's core."""
    before = os.sched_getaffinity(0) if plan.coordinator is not None else None
    if plan.coordinator is not None:
        os.sched_setaffinity(0, plan.coordinator)
    try:
        gc.collect()
        row: dict[str, Any] = trio.run(
            measure_split, ranks, seconds, seed, transport, generators, plan, per_host
        )
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
    return row


def profile(run: Callable[[], object], top: int) -> None:
    """Run one count under cProfile and print the hottest functions of this process (own time);
    in split mode that is the coordinator alone."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler)
    if dump := os.environ.get("FLODL_BENCH_PROFILE"):
        stats.dump_stats(dump)  # for pstats' callers and callees
    stats.sort_stats(pstats.SortKey.TIME).print_stats(top)
    stats.sort_stats(pstats.SortKey.CUMULATIVE).print_stats("flodl", top)
