"""Soak bench: one long ``flodl run`` under steady faults, as torchft's punisher does.

Writes bench/results/soak.json. One run of ``bench/soak_rank.py`` (the digits MLP, cadence, 4
ranks, ``--restarts`` enough to replace every loss) trains for ``--duration`` seconds
(``--max-time``) while this bench injects a fault every ``--every`` seconds (drawn uniformly
from the range), waiting first until every rank is back and training. The faults, in an
order shuffled once per cycle of five:

- ``sigkill``: SIGKILL a rank from outside;
- ``sigstop``: SIGSTOP a rank for the heartbeat timeout plus a second, then SIGCONT (where
  the launcher has not killed it already: it SIGKILLs a rank declared dead for silence);
- ``kill-during-regroup``: SIGKILL a rank with a trap armed so that the first survivor to
  join the re-formed group SIGKILLs itself inside ``join_group`` (two faults);
- ``kill-while-saving``: the next rank to write a bundle SIGKILLs itself once a file is staged;
- ``kill-restarted``: SIGKILL a rank, wait for its restarted process to rejoin, SIGKILL that
  one at once (two faults).

Every fault must be followed by the rank declared dead and a round that settles after it (or
the run's end); ``recovery_s`` is the time from the fault to that round; a fault with neither
within ``--hang-s`` is a hang. Before each fault, with every rank training, and once more after
the last one, the bench reads the coordinator's open file descriptors, trio tasks and memory
from its /metrics, and each rank's resident memory. ``fd_growth`` and ``tasks_growth`` are the
floor of the last third of the readings minus that of the first third (a connection or task
that comes and goes is not growth, one that stays is); the memory growths are the last reading
minus the first (per rank id, across its restarts). At the end it checks the run completed
with the accuracy target, and that no process it or the run started is left.

``--duration 600`` (the default) is the 10-minute soak; the test suite runs a short one. The
run's folder (``--run-dir``) has the launcher's log and pid beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import benchenv
import trio
from quality_procs import alive, kill_group
from soak_rank import soak_dir
from soak_watch import EventLog, RankProcesses, rss_mb, scrape

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "soak.json"
SOAK_RANK = HERE / "soak_rank.py"
KINDS = ("sigkill", "sigstop", "kill-during-regroup", "kill-while-saving", "kill-restarted")
ACCURACY_TARGET = 0.95
BATCH_SIZE = 16
TARGETS = {"faults": 20, "hangs": 0, "fd_growth": 0, "rss_growth_mb": 50.0, "recovery_s": 0.5}


@attrs.define
class Fault:
    kind: str
    rank: int
    pid: int
    unix: float
    samples_lost: int | None
    after_seq: int
    """The last event logged before the fault: its death is the rank's next ``RankDead``."""
    dead_unix: float | None = None
    resumed_unix: float | None = None

    @property
    def recovery_s(self) -> float | None:
        return None if self.resumed_unix is None else self.resumed_unix - self.unix


@attrs.define
class Reading:
    """The coordinator's and each rank's figures at one moment with every rank training."""

    unix: float
    coordinator: dict[str, float]
    rank_rss_mb: dict[int, float]


class Soak:
    """One soak run: the run's process, what it watches, the faults it injected."""

    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.random = random.Random(args.seed)
        self.events = EventLog(run_dir / "events.jsonl")
        self.ranks = RankProcesses(run_dir)
        self.faults: list[Fault] = []
        self.readings: list[Reading] = []
        self.not_steady: list[float] = []
        self.unclaimed: list[str] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        a = self.args
        return [
            *(sys.executable, "-m", "flodl.cli", "run", "--nproc", str(a.nproc)),
            *("--restarts", "1000", "--policy", "cadence", "--no-live"),
            *("--heartbeat-timeout", str(a.heartbeat_timeout), "--max-time", str(a.duration)),
            *("--checkpoint-every", str(a.checkpoint_every), "--run-dir", str(self.run_dir)),
            *("--dashboard", f"127.0.0.1:{self.port}", "--overwrite"),
            *(str(SOAK_RANK), "--step-ms", str(a.step_ms), "--batch-size", str(BATCH_SIZE)),
        ]

    # -- waiting -----------------------------------------------------------------------------

    def steady(self) -> bool:
        """Every rank has one live process, is a member, and a round settled since the last
        change of membership."""
        self.events.read()
        live = self.ranks.live()
        every = range(self.args.nproc)
        return (
            all(len(live.get(rank, [])) == 1 for rank in every)
            and self.events.members() == set(every)
            and self.events.trained_since_membership_changed()
        )

    async def until(self, condition: Any, limit: float) -> bool:
        """Check ``condition`` every 50 ms until it holds (True) or ``limit`` s pass (False)."""
        with trio.move_on_after(limit):
            while not condition():
                await trio.sleep(0.05)
            return True
        return False

    # -- faults ------------------------------------------------------------------------------

    def live_pid(self, rank: int) -> int:
        pids = self.ranks.live().get(rank, [])
        if len(pids) != 1:
            raise RuntimeError(f"rank {rank} has {len(pids)} live processes: {pids}")
        return pids[0]

    def signal_rank(self, kind: str, rank: int, signum: signal.Signals) -> Fault:
        pid = self.live_pid(rank)
        lost = self.ranks.samples_lost(rank, pid, BATCH_SIZE)
        self.events.read()
        fault = Fault(kind, rank, pid, time.time(), lost, self.events.last_seq)
        os.kill(pid, signum)
        self.faults.append(fault)
        return fault

    def arm(self, kind: str) -> tuple[Path, int]:
        """Arm the ``kind`` trap: (its file, the last event logged before it was armed)."""
        self.events.read()
        armed = soak_dir(self.run_dir) / f"arm-{kind}"
        armed.write_text("")
        return armed, self.events.last_seq

    async def claimed(self, kind: str, armed: Path, armed_after: int, limit: float) -> None:
        """Wait for a rank to claim ``armed`` and record its fault; disarm it if none does.
        ``armed_after``: the last event logged before it was armed."""
        folder = soak_dir(self.run_dir) / "faults"
        seen = {p.name for p in folder.glob("*.json")} if folder.exists() else set()

        def fresh() -> list[Path]:
            found = sorted(folder.glob("*.json")) if folder.exists() else []
            return [p for p in found if p.name not in seen and p.stat().st_size > 0]

        if not await self.until(lambda: bool(fresh()), limit):
            try:
                armed.rename(armed.with_name(f"unclaimed-{kind}.{time.time():.0f}"))
                self.unclaimed.append(kind)
                return
            except FileNotFoundError:  # claimed at the last moment
                await self.until(lambda: bool(fresh()), 5.0)
        for path in fresh():
            record = json.loads(path.read_text())
            lost = record["batches_since_round"] * BATCH_SIZE
            rank, pid, unix = record["rank"], record["pid"], record["unix"]
            self.faults.append(Fault(f"kill-{kind}", rank, pid, unix, lost, armed_after))

    async def inject(self, kind: str) -> None:
        rank = self.random.randrange(self.args.nproc)
        if kind == "sigkill":
            self.signal_rank("sigkill", rank, signal.SIGKILL)
        elif kind == "sigstop":
            fault = self.signal_rank("sigstop", rank, signal.SIGSTOP)
            await trio.sleep(self.args.heartbeat_timeout + 1.0)
            with contextlib.suppress(ProcessLookupError):  # the launcher killed it
                os.kill(fault.pid, signal.SIGCONT)
        elif kind == "kill-during-regroup":
            armed, armed_after = self.arm("regroup")
            self.signal_rank("sigkill", rank, signal.SIGKILL)
            await self.claimed("regroup", armed, armed_after, self.args.hang_s)
        elif kind == "kill-while-saving":
            await self.claimed("save", *self.arm("save"), self.args.hang_s)
        elif kind == "kill-restarted":
            first = self.signal_rank("sigkill", rank, signal.SIGKILL)

            def rejoined() -> bool:
                self.events.read()
                pids = self.ranks.live().get(rank, [])
                joined = self.events.first("RankJoined", first.after_seq, rank)
                return len(pids) == 1 and pids[0] != first.pid and joined is not None

            if await self.until(rejoined, self.args.hang_s):
                self.signal_rank("kill-restarted", rank, signal.SIGKILL)
            else:
                self.not_steady.append(time.time())

    def read_figures(self) -> Reading:
        ranks = {}
        for rank, pids in self.ranks.live().items():
            if (mb := rss_mb(pids[0])) is not None:
                ranks[rank] = mb
        return Reading(time.time(), scrape(self.url), ranks)

    async def fault_loop(self, training_ends: float) -> None:
        """Inject faults until ``--quiet-s`` before the training budget runs out."""
        low, high = self.args.every
        order: list[str] = []
        while True:
            pause = self.random.uniform(low, high)
            if time.time() + pause > training_ends - self.args.quiet_s:
                return
            await trio.sleep(pause)
            if not await self.until(self.steady, self.args.hang_s):
                self.not_steady.append(time.time())
                continue
            self.readings.append(await trio.to_thread.run_sync(self.read_figures))
            if not order:
                order = list(self.args.kinds)
                self.random.shuffle(order)
            await self.inject(order.pop())

    # -- the run -----------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        a = self.args
        log = self.run_dir.parent / "launcher.log"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        started = time.time()
        with log.open("wb") as sink:
            process = await trio.lowlevel.open_process(
                self.command(), stdout=sink, stderr=sink, start_new_session=True
            )
        (self.run_dir.parent / "launcher.pid").write_text(f"{process.pid}\n")
        exited_in_time = False
        try:
            if not await self.until(self.steady, a.startup_s):
                raise RuntimeError(f"the run never started training:\n{log.read_text()[-3000:]}")
            training_started = self.events.first("TrainingStarted", -1)
            assert training_started is not None
            self.readings.append(await trio.to_thread.run_sync(self.read_figures))
            await self.fault_loop(training_started["unix"] + a.duration)
            if await self.until(self.steady, a.quiet_s):  # after the last fault, all back
                self.readings.append(await trio.to_thread.run_sync(self.read_figures))
            with trio.move_on_after(a.quiet_s + a.hang_s + 60.0):
                await process.wait()
                exited_in_time = True
        finally:
            if process.returncode is None:
                kill_group(process.pid)
                await process.wait()
        self.events.read()
        leftovers = [pid for pid in [process.pid, *self.ranks.every_pid()] if alive(pid)]
        for pid in leftovers:
            kill_group(pid)
        return self.results(process.returncode, exited_in_time, leftovers, time.time() - started)

    # -- figures -----------------------------------------------------------------------------

    def settle(self) -> None:
        """Find each fault's death and the first round that settled after it (or the run's
        end, for a death in its last round)."""
        for fault in self.faults:
            dead = self.events.first("RankDead", fault.after_seq, fault.rank)
            if dead is None:
                continue
            fault.dead_unix = dead["unix"]
            ends = (self.events.first(k, dead["seq"]) for k in ("SyncEnd", "Shutdown"))
            resumed = min((e for e in ends if e is not None), key=lambda e: e["seq"], default=None)
            if resumed is not None and resumed["unix"] - fault.unix <= self.args.hang_s:
                fault.resumed_unix = resumed["unix"]

    def results(
        self, exit_code: int | None, exited_in_time: bool, leftovers: list[int], wall_s: float
    ) -> dict[str, Any]:
        self.settle()
        summary_path = self.run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        # One value when every rank ended with the same model, else each rank's.
        reported = (summary.get("final_metrics") or {}).get("test_accuracy")
        accuracies = reported if isinstance(reported, list) else [reported]
        accuracy = min((a for a in accuracies if a is not None), default=None)
        survived = [f for f in self.faults if f.recovery_s is not None]
        recoveries = [f.recovery_s for f in survived if f.recovery_s is not None]
        lost = [f.samples_lost for f in self.faults if f.samples_lost is not None]

        def growth(key: str, scale: float = 1.0) -> float | None:
            """The floor of the last third of the readings minus that of the first third: a
            task or socket that comes and goes is not growth, one that stays is."""
            values = [r.coordinator[key] for r in self.readings if key in r.coordinator]
            if not values:
                return None
            third = max(len(values) // 3, 1)
            return round((min(values[-third:]) - min(values[:third])) / scale, 3)

        rank_growth = {}
        for rank in range(self.args.nproc):
            seen = [r.rank_rss_mb[rank] for r in self.readings if rank in r.rank_rss_mb]
            if seen:
                rank_growth[rank] = round(seen[-1] - seen[0], 1)
        hangs = len(self.faults) - len(survived) + len(self.not_steady) + (not exited_in_time)
        by_kind: dict[str, list[float]] = {}
        for fault in survived:
            by_kind.setdefault(fault.kind, []).append(fault.recovery_s or 0.0)
        return {
            "faults_injected": len(self.faults),
            "faults_survived": len(survived),
            "faults_by_kind": {k: sum(f.kind == k for f in self.faults) for k in fault_kinds()},
            "recovery_s_median": _round(statistics.median(recoveries)) if recoveries else None,
            "recovery_s_max": _round(max(recoveries)) if recoveries else None,
            "recovery_s_median_by_kind": {
                k: _round(statistics.median(v)) for k, v in sorted(by_kind.items())
            },
            "samples_lost_per_fault": _round(statistics.mean(lost)) if lost else None,
            "hangs": hangs,
            "not_steady": len(self.not_steady),
            "not_steady_unix": [round(t, 3) for t in self.not_steady],
            "traps_unclaimed": self.unclaimed,
            "fd_growth": growth("open_fds"),
            "tasks_growth": growth("tasks"),
            "coordinator_rss_growth_mb": growth("rss_bytes", 1e6),
            "rss_growth_mb": max(rank_growth.values()) if rank_growth else None,
            "rss_growth_mb_by_rank": rank_growth,
            "readings": [attrs.asdict(r) for r in self.readings],
            "run": {
                "exit_code": exit_code,
                "exited_in_time": exited_in_time,
                "status": summary.get("status"),
                "test_accuracy": accuracy,
                "test_accuracies": accuracies,
                "one_model": len(set(accuracies)) == 1,
                "accuracy_target": ACCURACY_TARGET,
                "restarts": sum(r.get("restarts", 0) for r in summary.get("ranks", [])),
                "deaths": len(summary.get("deaths", [])),
                "rounds": summary.get("rounds"),
                "global_step": summary.get("global_step"),
                "wall_s": round(wall_s, 1),
            },
            "leftover_processes": leftovers,
            "faults": [
                {**attrs.asdict(f), "recovery_s": _round(f.recovery_s)} for f in self.faults
            ],
        }


def fault_kinds() -> list[str]:
    """The kinds a fault record can carry (a trap's victim is named after the trap)."""
    return ["sigkill", "sigstop", "kill-regroup", "kill-save", "kill-restarted"]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def targets_met(result: dict[str, Any]) -> dict[str, bool]:
    return {
        "faults": result["faults_injected"] >= TARGETS["faults"]
        and result["faults_survived"] == result["faults_injected"],
        "hangs": result["hangs"] == TARGETS["hangs"],
        "fd_growth": result["fd_growth"] is not None and result["fd_growth"] <= 0,
        "rss_growth_mb": result["rss_growth_mb"] is not None
        and result["rss_growth_mb"] < TARGETS["rss_growth_mb"],
        "recovery_s_median": result["recovery_s_median"] is not None
        and result["recovery_s_median"] < TARGETS["recovery_s"],
        "completed": result["run"]["status"] == "completed" and result["run"]["exit_code"] == 0,
        "accuracy": (result["run"]["test_accuracy"] or 0.0) >= ACCURACY_TARGET,
        "no_leftovers": not result["leftover_processes"],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="training seconds")
    parser.add_argument(
        "--every",
        type=float,
        nargs=2,
        default=(15.0, 30.0),
        metavar=("MIN", "MAX"),
        help="seconds between faults, drawn uniformly (after every rank is back)",
    )
    parser.add_argument(
        "--kinds",
        type=lambda text: [kind for kind in text.split(",") if kind],
        default=list(KINDS),
        help=f"the faults to inject, comma-separated (default all: {','.join(KINDS)})",
    )
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--heartbeat-timeout", type=float, default=2.0)
    parser.add_argument("--checkpoint-every", type=int, default=20, help="rounds between saves")
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--hang-s", type=float, default=60.0)
    parser.add_argument("--quiet-s", type=float, default=20.0, help="no faults in the last S s")
    parser.add_argument("--startup-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the run here")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.kinds or set(args.kinds) - set(KINDS):
        parser.error(f"--kinds takes some of {','.join(KINDS)}, got {','.join(args.kinds)}")
    load_before = benchenv.load()
    with tempfile.TemporaryDirectory(prefix="flodl-soak-") as scratch:
        run_dir = args.run_dir or Path(scratch) / "run"
        soak = Soak(args, run_dir)
        result = trio.run(soak.run)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "run_command": " ".join(soak.command()),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "targets": TARGETS,
        **result,
        "load_average": {"before": load_before, "after": benchenv.load()},
        "environment": benchenv.environment(["torch", "trio"]),
    }
    result["targets_met"] = targets_met(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    keys = [
        *("faults_injected", "faults_survived", "hangs", "recovery_s_median", "recovery_s_max"),
        *("samples_lost_per_fault", "fd_growth", "tasks_growth", "rss_growth_mb"),
    ]
    for key in keys:
        print(f"{key:>26}: {result[key]}")
    print(f"{'run':>26}: {result['run']}")
    print(f"{'targets_met':>26}: {result['targets_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
