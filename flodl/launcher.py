"""Spawn and supervise local ranks around an in-process coordinator (``flodl run``).

:func:`launch` opens the coordinator, starts ``nproc`` copies of the training script with the
environment a rank needs (torchrun-style RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT plus flodl's own ``FLODL_*``), relays their output with a ``[rank N]`` prefix, feeds
each process exit into the coordinator's death detection, turns the first Ctrl-C (SIGINT or
SIGTERM) into a graceful save-and-shutdown and the second into a kill
(:mod:`flodl.launcher_signals`: ranks run in sessions of their own, out of reach of a terminal's
Ctrl-C), checks on disk what was saved (:mod:`flodl.launcher_saves`), and finally writes
``run-dir/summary.json``. Every process it started is gone when it returns, whatever happened.

The session key is generated here and handed to the ranks in a 0600 file named by
``FLODL_SESSION_KEY_FILE``; it never appears on a command line.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from flodl.backends import BACKEND_NAMES, check_backend_on_host
from flodl.checkpoint.resume import ResumePlan, plan_resume, save_coordinator_meta
from flodl.config import CoordinatorConfig, check_at_least, check_script
from flodl.coordinator import Coordinator, open_coordinator
from flodl.core.machine import Status
from flodl.core.timeline import EventKind
from flodl.environment import SESSION_KEY, RankEnv
from flodl.errors import ConfigError
from flodl.failure_report import (
    ExitLog,
    add_failure_report,
    exit_text,
    let_lost_ranks_exit,
    print_root_cause,
)
from flodl.launcher_saves import account_saves
from flodl.launcher_signals import StopSignals, kill_rank_groups, say, watch_signals
from flodl.observe.events import EVENTS_NAME
from flodl.observe.hub import open_observer
from flodl.observe.views import ViewConfig, run_views
from flodl.rundir import check_overwrite_and_resume, claim_run_dir, fresh_run_dir, set_aside
from flodl.torchrun_env import OMP_NOTE, TorchrunLayout, free_port

KEY_FILE_NAME = "session.key"
SUMMARY_NAME = "summary.json"


@attrs.frozen
class LaunchConfig:
    """What ``flodl run`` was asked to do."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc: int = 2
    transport: str = "tcp"
    backend: str = "auto"
    run_dir: Path = attrs.field(factory=fresh_run_dir)
    """Where the run writes; by default a new folder under ``runs/``. A folder that holds an
    earlier run is refused unless ``resume`` names it or ``overwrite`` is set."""
    seed: int = 0
    coordinator: CoordinatorConfig = attrs.field(factory=CoordinatorConfig)
    python: str = sys.executable
    resume: Path | None = None
    exit_grace: float = 30.0
    """Seconds ranks get to exit on their own after the run ended, before they are killed."""
    echo: bool = True
    """Relay the ranks' output to this process's stdout."""
    show_ranks: frozenset[int] | None = None
    """Relay only these ranks' output (None: every rank's); all of it is in the rank logs."""
    restarts: int = 0
    """How many times a rank whose process failed is started again (it rejoins the group)."""
    overwrite: bool = False
    """Remove the files of the run ``run_dir`` holds (flodl's own only) before starting."""
    keep_checkpoints: int = 2
    """Bundles each rank keeps in its checkpoint folder (it removes older ones after a save)."""
    views: ViewConfig = attrs.field(factory=ViewConfig)
    """What the run shows while it trains (live table, event lines, dashboard)."""

    def __attrs_post_init__(self) -> None:
        check_at_least("--nproc", self.nproc, 1)
        check_at_least("--keep-checkpoints", self.keep_checkpoints, 1)
        if self.transport not in ("tcp", "unix"):
            raise ConfigError(f"--transport must be tcp or unix, got {self.transport!r}")
        if self.backend not in BACKEND_NAMES:
            raise ConfigError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")
        check_at_least("--restarts", self.restarts, 0)
        check_at_least("--seed", self.seed, 0)
        if not self.exit_grace >= 0:
            raise ConfigError(f"exit_grace must be >= 0 seconds, got {self.exit_grace!r}")
        check_overwrite_and_resume(self.run_dir, self.resume, self.overwrite)

    def check_host(self) -> None:
        """Refuse what this host cannot run: a script that is not a file, ``--backend nccl``
        without a GPU per rank (imports torch for nccl only). ConfigError naming the flag."""
        check_script(self.script)
        check_backend_on_host(self.backend, self.nproc)


@attrs.define
class RankProcess:
    """One spawned rank and what became of it."""

    rank: int
    process: trio.Process
    started_unix: float
    exit_code: int | None = None
    exited_unix: float | None = None
    exits: list[tuple[int, float]] = attrs.field(factory=list)
    """Every exit of this rank's processes: (code, unix time); more than one after restarts."""
    restarts: int = 0
    exit_log: ExitLog = attrs.field(factory=ExitLog)
    """Each exit with its pid, and the processes the launcher killed (the failure report's)."""


def write_session_key(run_dir: Path, key: bytes) -> Path:
    """Write ``key`` (hex) to ``run_dir/session.key`` readable by this user only."""
    path = run_dir / KEY_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(key.hex())
    os.chmod(path, 0o600)
    return path


def rank_environment(
    config: LaunchConfig,
    rank: int,
    url: str,
    key_file: Path,
    master_port: int,
    resume: Path | None = None,
    restart_count: int = 0,
) -> dict[str, str]:
    """The environment of rank ``rank``: the parent's, plus what a flodl rank reads (the key
    by file only: a key inherited in the environment would be the wrong one) and torchrun's
    variables (:mod:`flodl.torchrun_env`; ``MASTER_PORT`` is ``master_port``, free for the
    script's own rendezvous)."""
    env = dict(os.environ)
    env.pop(SESSION_KEY, None)
    layout = TorchrunLayout(
        rank=rank,
        world_size=config.nproc,
        local_rank=rank,
        local_world_size=config.nproc,
        master_port=master_port,
        restart_count=restart_count,
        max_restarts=config.restarts,
        run_id=config.run_dir.name,
    )
    env.update(layout.variables(env))
    coordinator = config.coordinator
    rank_env = RankEnv(
        coordinator=url,
        rank=rank,
        world_size=config.nproc,
        local_rank=rank,
        local_world_size=config.nproc,
        session_key_file=key_file.resolve(),
        backend=config.backend,
        policy=coordinator.policy,
        heartbeat_timeout=coordinator.heartbeat_timeout,
        heartbeat_interval=coordinator.heartbeat_interval,
        run_dir=config.run_dir.resolve(),
        seed=config.seed,
        host="127.0.0.1",
        resume=None if resume is None else resume.resolve(),
        keep_checkpoints=config.keep_checkpoints,
    )
    env.update(rank_env.variables())
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def _relay_output(rank: int, stream: trio.abc.ReceiveStream, echo: bool, log: Path) -> None:
    """Copy a rank's output to its log file and, prefixed, to our stdout."""
    pending = b""
    with log.open("ab") as sink:
        async for chunk in stream:
            sink.write(chunk)
            sink.flush()
            if not echo:
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                echo = echo and say(f"[rank {rank}] {line.decode(errors='replace')}")
        if echo and pending:
            say(f"[rank {rank}] {pending.decode(errors='replace')}")


async def _supervise(
    spawned: RankProcess,
    coordinator: Coordinator,
    config: LaunchConfig,
    restart: Callable[[int], Awaitable[trio.Process]],
) -> None:
    """Relay output until the process exits; tell the coordinator; restart a failed rank.

    A rank whose process fails while the run goes on is started again (up to
    ``config.restarts`` times); the new process rejoins the group at the next round, or joins
    the world if it died before the run started (the coordinator waits for it then).
    """
    log = config.run_dir / f"rank{spawned.rank}.log"
    for _life in range(config.restarts + 1):
        process = spawned.process
        async with trio.open_nursery() as nursery:
            if process.stdout is not None:
                shown = config.show_ranks is None or spawned.rank in config.show_ranks
                echo = config.echo and shown
                nursery.start_soon(_relay_output, spawned.rank, process.stdout, echo, log)
            code = await process.wait()
        spawned.exit_code = code
        spawned.exited_unix = time.time()
        spawned.exits.append((code, spawned.exited_unix))
        spawned.exit_log.exited(spawned.rank, process.pid, code, spawned.exited_unix)
        restarting = code != 0 and spawned.restarts < config.restarts
        for notice in coordinator.report_exit(spawned.rank, code, restarting=restarting):
            if config.echo:
                say(f"flodl: {notice}")
        if not restarting or coordinator.machine.finished:
            return
        spawned.restarts += 1
        spawned.process = await restart(spawned.rank)
        spawned.exit_code = None


def _kill_declared_dead(coordinator: Coordinator, spawned: Sequence[RankProcess]) -> None:
    """Kill the processes of ranks the coordinator declared dead and did not rejoin.

    A rank declared dead for silence (stopped, or stuck) will not exit on its own; waiting
    the exit grace for it would only delay the end of the run.
    """
    machine = coordinator.machine
    for item in spawned:
        stats = machine.stats[item.rank]
        rejoined = stats.joined_at is not None and (
            stats.lost_at is None or stats.joined_at > stats.lost_at
        )
        if stats.lost_at is not None and not rejoined and item.process.returncode is None:
            item.exit_log.killing(item.process)
            item.process.kill()


async def launch(config: LaunchConfig, *, key: bytes | None = None) -> dict[str, Any]:
    """Run the job to its end and return the summary (also written to run-dir/summary.json).

    Guarantees: every rank process started here has exited (killed if need be) when this
    returns or raises, including on cancellation. Raises ConfigError, before any rank starts,
    for what this host cannot run and for a run dir that is in use or holds an earlier run
    (see :func:`flodl.rundir.claim_run_dir`).
    """
    config.check_host()
    plan = None if config.resume is None else plan_resume(config.resume)
    with claim_run_dir(config.run_dir, resume=config.resume, overwrite=config.overwrite):
        if config.echo:
            say(f"flodl: run folder {config.run_dir}")
        return await _launch(config, key, plan)


async def _launch(
    config: LaunchConfig, key: bytes | None, plan: ResumePlan | None
) -> dict[str, Any]:
    run_dir = config.run_dir
    if plan is not None:  # each rank log holds one run; a restart within it appends
        for log in sorted(run_dir.glob("rank*.log")):
            if log.name.removeprefix("rank").removesuffix(".log").isdigit():
                set_aside(log)
    key = key or secrets.token_bytes(32)
    key_file = write_session_key(run_dir, key)
    if config.transport == "unix":
        url = f"unix://{(run_dir / 'coordinator.sock').resolve()}"
    else:
        url = "tcp://127.0.0.1:0"
    started_unix = time.time()
    spawned: list[RankProcess] = []
    stops = StopSignals()
    async with open_coordinator(
        url,
        config.nproc,
        key,
        config.coordinator,
        seed=config.seed,
        linger=config.exit_grace,
        resume=None if plan is None else plan.state,
        freeze_heap=True,  # this process exists to coordinate (see flodl.coordinator)
    ) as coordinator:
        # The run's clock starts when the coordinator's did (its join timeout counts from
        # there); the unix time of that instant is read off both clocks read together.
        trio_start = coordinator.started_at
        clock_unix = time.time() - (trio.current_time() - trio_start)
        master_port = free_port()
        if config.nproc > 1 and "OMP_NUM_THREADS" not in os.environ and config.echo:
            say(OMP_NOTE.format(n=config.nproc))
        observing = open_observer(coordinator, run_dir, (trio_start, clock_unix))
        try:
            async with observing as observer, trio.open_nursery() as nursery:
                dashboard = await nursery.start(run_views, observer, config.views)
                if dashboard is not None and config.echo:
                    say(f"flodl: dashboard at {dashboard}")

                async def start_rank(rank: int) -> trio.Process:
                    earlier = [item.restarts for item in spawned if item.rank == rank]
                    env = rank_environment(
                        config,
                        rank,
                        coordinator.url,
                        key_file,
                        master_port,
                        resume=None if plan is None else plan.bundle,
                        restart_count=earlier[0] if earlier else 0,
                    )
                    return await trio.lowlevel.open_process(
                        [config.python, config.script, *config.script_args],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        # Out of the terminal's process group: Ctrl-C is the launcher's to handle.
                        start_new_session=True,
                    )

                kill = functools.partial(kill_rank_groups, spawned)
                says = ("kill them", "killing the ranks")
                await nursery.start(watch_signals, coordinator, stops, kill, says)
                for rank in range(config.nproc):
                    item = RankProcess(rank, await start_rank(rank), time.time())
                    spawned.append(item)
                    nursery.start_soon(_supervise, item, coordinator, config, start_rank)
                await coordinator.wait_finished()
                await let_lost_ranks_exit(coordinator.machine, spawned)
                _kill_declared_dead(coordinator, spawned)
                with trio.move_on_after(config.exit_grace):
                    for item in spawned:
                        await item.process.wait()
                kill_rank_groups(spawned)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                kill_rank_groups(spawned, exited_too=True)
                for item in spawned:
                    code = await item.process.wait()
                    if item.exit_code is None:
                        item.exit_code = code
                        item.exited_unix = time.time()
                        item.exit_log.exited(item.rank, item.process.pid, code, item.exited_unix)
        summary = build_summary(config, coordinator, spawned, (clock_unix, trio_start), stops)
        summary["wall_s"] = time.time() - started_unix
        summary["run_dir"] = str(run_dir)
        summary["events"] = str(run_dir / EVENTS_NAME)
        save_coordinator_meta(run_dir, coordinator.machine.checkpoint_meta())
        if plan is not None:
            summary["resumed_from"] = str(plan.bundle)
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def build_summary(
    config: LaunchConfig,
    coordinator: Coordinator,
    spawned: Sequence[RankProcess],
    clocks: tuple[float, float],
    stops: StopSignals | None = None,
) -> dict[str, Any]:
    """What happened, per rank and per death, in one JSON-able dict."""
    machine = coordinator.machine
    clock_unix, trio_start = clocks
    stops = stops or StopSignals()
    saves = account_saves(machine, spawned, config.run_dir, stops)

    def unix(t: float) -> float:
        return clock_unix + (t - trio_start)

    ranks = []
    final_metrics: dict[str, Any] = {}
    for item in spawned:
        # A report older than this rank's first start is an earlier run's (a run resumed in
        # its own folder); the second of slack covers file times lagging the clock.
        report = _read_json(config.run_dir / f"rank{item.rank}.json", since=item.started_unix - 1)
        stats = machine.stats[item.rank]
        ranks.append(
            {
                "rank": item.rank,
                "pid": item.process.pid,
                "exit_code": item.exit_code,
                "restarts": item.restarts,
                "steps": report.get("steps"),
                "batches": report.get("batches", stats.batches),
                "syncs": report.get("syncs", stats.syncs),
                "idle_s": report.get("idle_s"),
                "averaging_s": report.get("averaging_s"),
                "wall_s": report.get("wall_s"),
                "startup_s": report.get("startup_s"),
                "idle_share": _share(report.get("idle_s"), _training_s(report)),
                "averaging_share": _share(report.get("averaging_s"), _training_s(report)),
                "exit_reason": report.get("exit_reason"),
                "bundle": saves.bundles.get(item.rank),
                "final_metrics": report.get("final_metrics", {}),
            }
        )
        if report.get("syncs"):
            # A rank that never averaged (say, restarted after the run had ended) holds an
            # untrained model: its metrics say nothing about the run.
            for name, value in (report.get("final_metrics") or {}).items():
                final_metrics.setdefault(name, []).append(value)
    syncs_end = [e.time for e in machine.timeline if e.kind is EventKind.SYNC_END]
    deaths = []
    by_rank = {item.rank: item for item in spawned}
    for event in machine.timeline.of_kind(EventKind.RANK_DEAD):
        rank = int(event.detail["rank"])
        detected = unix(event.time)
        after = [t for t in syncs_end if t >= event.time]
        recovered = unix(after[0]) if after else None
        exits = by_rank[rank].exits if rank in by_rank else []
        # The exit that caused this death: the last one seen before it was declared.
        before = [t for _, t in exits if t <= detected + 1.0]
        exited = max(before) if before else None
        origin = min(exited, detected) if exited is not None else detected
        deaths.append(
            {
                "rank": rank,
                "cause": event.detail.get("cause"),
                "process_exit_unix": exited,
                "detected_unix": detected,
                "recovered_unix": recovered,
                "detection_s": None if exited is None else max(detected - exited, 0.0),
                "recovery_s": None if recovered is None else recovered - origin,
            }
        )
    outcome = machine.outcome
    summary = {
        "status": saves.status,
        "save_reason": None if outcome.save_reason is None else outcome.save_reason.name,
        "message": saves.message,
        "saved": saves.to_json(),
        "signals": list(stops.received),
        "policy": config.coordinator.policy.value,
        "nproc": config.nproc,
        "started_unix": clock_unix,
        "global_step": machine.cycle.global_step,
        "rounds": machine.cycle.round,
        "anchor": machine.elche.anchor,
        "batch_counts": machine.counts(),
        "ranks": ranks,
        "deaths": deaths,
        "epochs": machine.epoch_results,
        "final_metrics": {
            name: values[0] if len(set(values)) == 1 else values
            for name, values in final_metrics.items()
        },
        "timeline_events": len(machine.timeline),
    }
    logs = {item.rank: item.exit_log for item in spawned}
    add_failure_report(summary, logs, machine, unix, config.run_dir, stops)
    return summary


def _read_json(path: Path, since: float) -> dict[str, Any]:
    """The JSON object in ``path`` if it was written at or after unix time ``since``, else {}."""
    try:
        if path.stat().st_mtime < since:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _training_s(report: dict[str, Any]) -> float | None:
    """Seconds from the rank's first batch to its exit (its wall time less start-up)."""
    wall, startup = report.get("wall_s"), report.get("startup_s") or 0.0
    if not isinstance(wall, int | float) or not isinstance(startup, int | float):
        return None
    return float(wall) - float(startup)


def _share(idle: Any, wall: Any) -> float | None:
    if not isinstance(idle, int | float) or not isinstance(wall, int | float) or wall <= 0:
        return None
    return float(idle) / float(wall)


def _percent(share: Any) -> str:
    return "-" if share is None else f"{100 * share:5.1f}%"


def print_summary(summary: dict[str, Any], stream: Any = None) -> None:
    """A short human-readable account of a run."""
    out = stream or sys.stdout
    status = summary["status"]
    reason = summary.get("save_reason")
    asked = "saved" if status == Status.SAVED.value else "save asked for"
    print(f"\nflodl: run {status}" + (f" ({asked}: {reason})" if reason else ""), file=out)
    print(f"  {summary['message']}", file=out)
    print(
        f"  {'rank':>4} {'batches':>8} {'syncs':>6} {'idle':>7} {'averaging':>10} {'exit':>7}",
        file=out,
    )
    for rank in summary["ranks"]:
        idle, averaging = _percent(rank.get("idle_share")), _percent(rank.get("averaging_share"))
        print(
            f"  {rank['rank']:>4} {rank['batches'] or 0:>8} {rank['syncs'] or 0:>6} "
            f"{idle:>7} {averaging:>10} {exit_text(rank['exit_code']):>7}"
            + (f" (raised {rank['error'].split(':')[0]})" if rank.get("error") else "")
            + (" (killed by flodl)" if rank.get("killed_by_launcher") else ""),
            file=out,
        )
    for death in summary["deaths"]:
        rec = death.get("recovery_s")
        shown = "-" if rec is None or math.isnan(rec) else f"{rec:.3f}s"
        print(f"  rank {death['rank']} lost ({death['cause']}), recovered in {shown}", file=out)
    for name, value in summary.get("final_metrics", {}).items():
        print(f"  {name}: {value}", file=out)
    for rank in summary["ranks"]:
        if rank.get("bundle"):
            print(f"  rank {rank['rank']} saved {rank['bundle']}", file=out)
    for missing in (summary.get("saved") or {}).get("missing", []):
        print(f"  rank {missing['rank']} NOT saved: {missing['why']}", file=out)
    print_root_cause(summary, out)


def run_succeeded(summary: dict[str, Any]) -> bool:
    """Completed, or stopped on request with every bundle verified; every rank exited 0."""
    stopped = summary["status"] == Status.SAVED.value and summary.get("save_reason") == "GRACEFUL"
    return (summary["status"] == Status.COMPLETED.value or stopped) and all(
        r["exit_code"] == 0 for r in summary["ranks"]
    )
