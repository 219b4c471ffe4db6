"""Peers bench: torchft LocalSGD and flodl Cadence side by side, in one run.

Writes bench/results/peers.json and prints a short table. Both sides train the same task in
the same run: ``examples/digits.py``'s data, split and MLP (64 -> 64 -> 10, Adam lr 0.01,
batch 16, 8 epochs), 3 processes, replica/rank 2 made 2.5x slower (it sleeps 1.5x each
step's compute after the step), gloo on CPU, ``torch.set_num_threads(1)`` everywhere.

* **flodl:** :func:`flodl.launch.launcher.launch` (what ``flodl run --nproc 3 --policy cadence
  --backend gloo`` runs) of ``bench/peer_flodl_rank.py``, with the library's defaults
  (ElChe anchor 10, overhead target 0.05, idle fill, heartbeat 1 s / timeout 10 s).
* **torchft 0.2.0:** a lighthouse (``torchft_lighthouse --min_replicas 2``) and 3
  single-process replica groups (``bench/peer_torchft_worker.py``) under torchft's ``LocalSGD``
  with a fixed ``sync_every``: flodl's average window in the same run (its batches per rank per
  averaging round, from the first flodl run), so both sides average about as often.
  torchft's own listeners bind every interface (ManagerServer ``[::]``, the checkpoint HTTP
  server, the TCPStore), so every torchft trial runs in a fresh network namespace holding only
  loopback (``unshare -n`` + ``ip link set lo up``), started through this file's
  ``_torchft-trial`` mode. Where torchft or namespaces are unavailable the torchft side is
  skipped with a message saying why (``--check`` says only that).

Measured:

* **samples/s** (healthy, ``--repeats`` runs each side, interleaved): samples trained by all
  processes / training window (first batch on any process to the end of the last one's
  loop, the last average included; start-up excluded on both sides). Also test accuracy, and
  CPU-ms per step: the training processes' CPU time (all threads) over the window per step
  trained, plus the control plane's CPU for the whole run (the lighthouse process; flodl's
  coordinator and launcher, which run in this process).
* **recovery after SIGKILL** of a fast rank (rank/replica 1), ``--trials`` per setting: the
  bench waits for two averaging rounds with every rank, then for a trial-dependent share
  ((i + 0.5) / trials) of the last window's length, so the kill lands at different places in
  a window, and SIGKILLs the process (the moment is ``time.time()`` just before the signal).
  Recovery = fault moment -> the first average committed with the reduced membership (2):
  flodl, the first round a survivor's group completed on a newer generation (``SyncEnd`` in
  the coordinator's ``events.jsonl``, after every survivor's ack); torchft, the first LocalSGD
  sync on a survivor whose quorum had 2 participants and whose ``should_commit`` said yes
  (the manager's step advanced). torchft at its defaults (lighthouse heartbeat timeout 5 s,
  join timeout 60 s, Manager and gloo timeouts 60 s) and with ``--heartbeat_timeout_ms
  1000`` (nothing else changed); flodl at its defaults (a closed connection is a death at
  once; heartbeat timeout 10 s for a silent rank).

Targets: flodl's samples/s at least 1.3x torchft's; flodl's median recovery at most 1/10 of
torchft's at its defaults. ``--quick``: 4 epochs, 1 run and 1 trial of each (figures mean
little). Wrap measurement runs in ``flock /tmp/bench.lock``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchenv
import trio
from benchenv import load
from recovery_bench import read_jsonl

from flodl.config import CoordinatorConfig
from flodl.core.common.policy import Policy
from flodl.launch.config import LaunchConfig
from flodl.launch.launcher import launch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "peers.json"
FLODL_RANK = HERE / "peer_flodl_rank.py"
TORCHFT_WORKER = HERE / "peer_torchft_worker.py"
REQUIREMENTS = HERE / "requirements-peers.txt"

NPROC = 3
SLOW_RANK = 2
SLOW_FACTOR = 2.5
VICTIM = 1
EPOCHS = 8
BATCH_SIZE = 16
LR = 0.01
HIDDEN = 64
SEED = 0
LIGHTHOUSE_PORT = 29510  # a fresh namespace per trial: nothing else listens there
MIN_REPLICAS = 2
SPEEDUP_TARGET = 1.3
RECOVERY_RATIO_TARGET = 0.1
WARM_ROUNDS = 3
"""Averaging rounds with every rank (and batches) before the kill's delay starts."""
TORCHFT_SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {"lighthouse_args": []},
    "heartbeat_1s": {"lighthouse_args": ["--heartbeat_timeout_ms", "1000"]},
}
TORCHFT_DEFAULTS = {
    "lighthouse_heartbeat_timeout_ms": 5000,
    "lighthouse_join_timeout_ms": 60000,
    "lighthouse_quorum_tick_ms": 100,
    "lighthouse_min_replicas": MIN_REPLICAS,
    "manager_timeout_s": 60,
    "manager_quorum_timeout_s": 60,
    "manager_connect_timeout_s": 60,
    "manager_heartbeat_interval_ms": 100,
    "manager_min_replica_size": MIN_REPLICAS,
    "process_group_gloo_timeout_s": 60,
}
RECOVERY_CAP_S = 75.0
"""How long a torchft trial waits for recovery after the kill (past gloo's 60 s timeout)."""


def source_commit() -> str | None:
    """The commit of the code measured: ``git rev-parse HEAD`` here, else FLODL_SOURCE_COMMIT
    (set it when running from an exported snapshot, so edits in a shared checkout cannot
    change the code under test in the middle of a run)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except OSError:
        done = None
    if done is not None and done.returncode == 0:
        return done.stdout.strip()
    return os.environ.get("FLODL_SOURCE_COMMIT")


def environment() -> dict[str, object]:
    return benchenv.environment(
        ("torch", "trio", "flodl", "torchft"),
        source_commit=source_commit(),
        source_dir=str(HERE.parent),
    )


# --------------------------------------------------------------------------- availability


def peer_unavailable() -> str | None:
    """Why the torchft side cannot run here (None: it can)."""
    if importlib.util.find_spec("torchft") is None:
        return (
            "torchft is not installed (a bench extra, never a flodl dependency): "
            f"install it with `.venv/bin/pip install -r {REQUIREMENTS.relative_to(HERE.parent)}` "
            "after torch==2.13.0 is present"
        )
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return (
                f"`{tool}` is not on PATH: torchft's listeners bind every interface, so its "
                "processes run only in a loopback-only network namespace (util-linux unshare, "
                "iproute2 ip)"
            )
    try:
        probe = subprocess.run(
            ["unshare", "-n", "sh", "-c", "ip link set lo up"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"cannot create a loopback-only network namespace: {err}"
    if probe.returncode != 0:
        return (
            "cannot create a loopback-only network namespace (`unshare -n` + `ip link set lo "
            f"up` failed: {(probe.stderr or probe.stdout).strip()}); torchft's listeners bind "
            "every interface, so the bench does not run it outside one"
        )
    return None


def skip_message(reason: str) -> str:
    return f"peers bench: torchft side skipped: {reason}"


# --------------------------------------------------------------------------- shared helpers


def median(values: Sequence[float]) -> float | None:
    return round(float(statistics.median(values)), 4) if values else None


def window(reports: Sequence[dict[str, Any]]) -> float:
    return float(
        max(r["loop_end_unix"] for r in reports) - min(r["first_batch_unix"] for r in reports)
    )


def kill_share(index: int, trials: int) -> float:
    """Where in a window trial ``index`` kills: (i + 0.5) / trials of the window's length."""
    return (index + 0.5) / trials


def proc_cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` so far (None if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def task_settings(epochs: int) -> dict[str, Any]:
    return {
        "data": "scikit-learn digits, examples/digits.py's 80/20 split (1438 train, 359 test)",
        "model": f"MLP 64-{HIDDEN}-10 (examples/digits.py's build_model, seed {SEED})",
        "optimizer": f"Adam lr {LR}",
        "batch_size": BATCH_SIZE,
        "epochs": epochs,
        "processes": NPROC,
        "slow_rank": SLOW_RANK,
        "slow_factor": SLOW_FACTOR,
        "slowdown": "the slow process sleeps (factor - 1) x each step's compute after it",
        "threads_per_process": 1,
        "backend": "gloo (CPU)",
    }


# --------------------------------------------------------------------------- flodl side


def flodl_config(run_dir: Path, epochs: int, hidden: int) -> LaunchConfig:
    return LaunchConfig(
        script=str(FLODL_RANK),
        script_args=(
            f"--epochs={epochs}",
            f"--batch-size={BATCH_SIZE}",
            f"--lr={LR}",
            f"--hidden={hidden}",
            f"--seed={SEED}",
            f"--slow={SLOW_RANK}:{SLOW_FACTOR}",
            f"--marker-dir={run_dir / 'peer'}",
        ),
        nproc=NPROC,
        backend="gloo",
        run_dir=run_dir,
        coordinator=CoordinatorConfig(policy=Policy.CADENCE),
        echo=False,
        exit_grace=10.0,
    )


def sync_ends(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "SyncEnd"]


def full_rounds(ends: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rounds that closed a window with batches from every rank."""
    return [
        e
        for e in ends
        if len(e["ranks"]) == NPROC and all(r["batches"] > 0 for r in e["ranks"].values())
    ]


async def flodl_killer(run_dir: Path, share: float, out: dict[str, Any]) -> None:
    """SIGKILL rank VICTIM ``share`` of a window after the WARM_ROUNDS-th full round."""
    pid_file = run_dir / "peer" / f"rank{VICTIM}.pid"
    while True:
        ends = full_rounds(sync_ends(run_dir))
        if len(ends) >= WARM_ROUNDS and pid_file.exists():
            break
        await trio.sleep(0.01)
    last = ends[-1]
    window_s = float(last["window_s"])
    await trio.sleep(share * window_s)
    out["window_s_before"] = round(window_s, 4)
    out["generation_before"] = max(int(e["generation"]) for e in sync_ends(run_dir))
    out["fault_unix"] = time.time()
    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def flodl_recovery(run_dir: Path, fault: dict[str, Any]) -> float | None:
    """Fault -> the first round completed on a newer group generation (None: none)."""
    t0, generation = fault["fault_unix"], fault["generation_before"]
    later = [
        float(e["unix"])
        for e in sync_ends(run_dir)
        if e["unix"] > t0 and int(e["generation"]) > generation
    ]
    return round(min(later) - t0, 4) if later else None


async def flodl_run(
    run_dir: Path, epochs: int, kill_at: float | None, hidden: int = HIDDEN
) -> dict[str, Any]:
    """One ``flodl run``; with ``kill_at`` (a share of a window) rank VICTIM is SIGKILLed."""
    config = flodl_config(run_dir, epochs, hidden)
    fault: dict[str, Any] = {}
    load_before = load()
    cpu_before = time.process_time()
    async with trio.open_nursery() as nursery:
        if kill_at is not None:
            nursery.start_soon(flodl_killer, run_dir, kill_at, fault)
        with trio.fail_after(600):
            summary = await launch(config)
        nursery.cancel_scope.cancel()
    control_cpu_s = time.process_time() - cpu_before
    ranks = summary["ranks"]
    reported = [r for r in ranks if "samples" in (r.get("final_metrics") or {})]
    result: dict[str, Any] = {
        "status": summary["status"],
        "load_before": load_before,
        "load_after": load(),
        "wall_s": round(summary["wall_s"], 2),
        "rounds": summary["rounds"],
        "coordinator_and_launcher_cpu_s": round(control_cpu_s, 3),
    }
    if kill_at is None:
        if summary["status"] != "completed" or len(reported) != NPROC:
            logs = "\n".join(
                (run_dir / f"rank{r}.log").read_text()[-3000:]
                for r in range(NPROC)
                if (run_dir / f"rank{r}.log").exists()
            )
            raise RuntimeError(f"flodl run did not complete: {summary['message']}\n{logs}")
        reports = [r["final_metrics"] for r in ranks]
        samples = sum(int(r["samples"]) for r in reports)
        batches = sum(int(r["batches"]) for r in ranks)
        wall = window(reports)
        averaged = full_rounds(sync_ends(run_dir))
        with_batches = [
            e for e in sync_ends(run_dir) if any(r["batches"] > 0 for r in e["ranks"].values())
        ]
        rounds_with_batches = len(with_batches)
        cpu_s = sum(float(r["cpu_s"]) for r in reports)
        result.update(
            {
                "samples": samples,
                "steps": batches,
                "window_s": round(wall, 3),
                "samples_per_s": round(samples / wall, 1),
                "test_accuracy": round(statistics.mean(r["test_accuracy"] for r in reports), 4),
                "rounds_with_batches": rounds_with_batches,
                "rounds_with_every_rank": len(averaged),
                "batches_per_rank_per_round": round(batches / (NPROC * rounds_with_batches), 2),
                "batches_per_rank": [int(r["batches"]) for r in ranks],
                "round_ms_median": round(
                    1000 * statistics.median(float(e["duration_s"]) for e in with_batches), 2
                ),
                "rank_cpu_s": round(cpu_s, 3),
                "rank_cpu_ms_per_step": round(1000 * cpu_s / batches, 3),
                "fast_rank_idle_share": round(
                    max(r["idle_share"] for r in ranks if r["rank"] != SLOW_RANK), 4
                ),
            }
        )
        return result
    survivors = [r for r in ranks if r["rank"] != VICTIM]
    accuracy = [
        r["final_metrics"]["test_accuracy"]
        for r in survivors
        if "test_accuracy" in (r.get("final_metrics") or {})
    ]
    deaths = [d for d in summary["deaths"] if d["rank"] == VICTIM]
    death = deaths[0] if deaths else {}
    detected = death.get("detected_unix")
    result.update(
        {
            "kill_share_of_window": round(kill_at, 3),
            **fault,
            "recovery_s": flodl_recovery(run_dir, fault) if fault else None,
            "detection_s": None
            if detected is None or not fault
            else round(detected - fault["fault_unix"], 4),
            "cause": death.get("cause"),
            "survivor_test_accuracy": round(statistics.mean(accuracy), 4) if accuracy else None,
        }
    )
    return result


# --------------------------------------------------------------------------- torchft side


def torchft_spec(
    work_dir: Path,
    setting: str,
    epochs: int,
    sync_every: int,
    kill_at: float | None,
    hidden: int = HIDDEN,
) -> dict[str, Any]:
    return {
        "work_dir": str(work_dir),
        "setting": setting,
        "lighthouse_args": TORCHFT_SETTINGS[setting]["lighthouse_args"],
        "epochs": epochs,
        "sync_every": sync_every,
        "kill_at": kill_at,
        "hidden": hidden,
    }


def run_torchft(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one torchft trial in a fresh loopback-only namespace; its result."""
    work = Path(spec["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path = work / "result.json"
    command = [
        "unshare",
        "-n",
        "sh",
        "-c",
        'ip link set lo up && exec "$0" "$@"',
        sys.executable,
        str(Path(__file__).resolve()),
        "_torchft-trial",
        str(spec_path),
    ]
    with (work / "runner.log").open("w") as log:
        runner = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            runner.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if runner.poll() is None:
                os.killpg(runner.pid, signal.SIGTERM)  # the runner's group: lighthouse, replicas
                try:
                    runner.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(runner.pid, signal.SIGKILL)
                    runner.wait()
            try:
                os.killpg(runner.pid, signal.SIGKILL)  # anything left in its group
            except ProcessLookupError:
                pass
    if not result_path.exists():
        raise RuntimeError(
            f"torchft trial wrote no result (runner exit {runner.returncode}):\n"
            + (work / "runner.log").read_text()[-4000:]
        )
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


class TrialFailed(Exception):
    pass


def wait_port(port: int, timeout_s: float, lighthouse: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if lighthouse.poll() is not None:
            raise TrialFailed(f"lighthouse exited with {lighthouse.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TrialFailed(f"lighthouse not listening on {port} after {timeout_s} s")


def syncs(work: Path, replica: int) -> list[dict[str, Any]]:
    return read_jsonl(work / f"replica{replica}.syncs.jsonl")


def torchft_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """Inside the namespace: lighthouse + NPROC replicas, one throughput run or one kill."""
    work = Path(spec["work_dir"])
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    bin_dir = Path(sys.executable).parent
    children: list[subprocess.Popen[bytes]] = []

    def start(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        sink = (logs / f"{name}.log").open("wb")
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        sink.close()
        children.append(child)
        return child

    result: dict[str, Any] = {"setting": spec["setting"], "load_before": load()}
    try:
        lighthouse = start(
            "lighthouse",
            [
                str(bin_dir / "torchft_lighthouse"),
                "--bind",
                f"127.0.0.1:{LIGHTHOUSE_PORT}",
                "--min_replicas",
                str(MIN_REPLICAS),
                *spec["lighthouse_args"],
            ],
        )
        replicas = [
            start(
                f"replica{i}",
                [
                    sys.executable,
                    str(TORCHFT_WORKER),
                    f"--replica={i}",
                    f"--nproc={NPROC}",
                    f"--lighthouse=http://127.0.0.1:{LIGHTHOUSE_PORT}",
                    f"--out-dir={work}",
                    f"--epochs={spec['epochs']}",
                    f"--batch-size={BATCH_SIZE}",
                    f"--lr={LR}",
                    f"--hidden={spec['hidden']}",
                    f"--seed={SEED}",
                    f"--slow-rank={SLOW_RANK}",
                    f"--slow-factor={SLOW_FACTOR}",
                    f"--sync-every={spec['sync_every']}",
                    f"--min-replica-size={MIN_REPLICAS}",
                ],
            )
            for i in range(NPROC)
        ]  # started with the lighthouse: their imports take longer than its start
        wait_port(LIGHTHOUSE_PORT, 120.0, lighthouse)
        lighthouse_ready_cpu = proc_cpu_s(lighthouse.pid) or 0.0
        if spec["kill_at"] is None:
            deadline = time.monotonic() + 400.0
            for i, replica in enumerate(replicas):
                code = replica.wait(timeout=max(deadline - time.monotonic(), 1.0))
                if code != 0:
                    raise TrialFailed(f"replica {i} exited with {code}")
            reports = [json.loads((work / f"replica{i}.json").read_text()) for i in range(NPROC)]
            result["reports"] = reports
            slow = [s["s"] for s in syncs(work, SLOW_RANK) if s["committed"]]
            result["slow_replica_sync_ms_median"] = round(1000 * statistics.median(slow), 2)
        else:
            result.update(torchft_kill(work, replicas, float(spec["kill_at"])))
        # The console script imports torch before serving (about 2 s of CPU): counted apart.
        result["lighthouse_startup_cpu_s"] = lighthouse_ready_cpu
        result["lighthouse_cpu_s_after_start"] = round(
            (proc_cpu_s(lighthouse.pid) or lighthouse_ready_cpu) - lighthouse_ready_cpu, 3
        )
    except (TrialFailed, subprocess.TimeoutExpired, OSError, ValueError) as err:
        result["error"] = f"{type(err).__name__}: {err}"
        tails = {}
        for log in sorted(logs.glob("*.log")):
            tails[log.stem] = log.read_text(errors="replace")[-2000:]
        result["log_tails"] = tails
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
        for child in children:
            child.wait()
    result["load_after"] = load()
    return result


def torchft_kill(
    work: Path, replicas: list[subprocess.Popen[bytes]], share: float
) -> dict[str, Any]:
    """SIGKILL replica VICTIM ``share`` of a window after WARM_ROUNDS full syncs; recovery."""
    deadline = time.monotonic() + 300.0
    while True:
        done = [s for s in syncs(work, VICTIM) if s["committed"] and s["participants"] == NPROC]
        if len(done) >= WARM_ROUNDS:
            break
        for i, replica in enumerate(replicas):
            if replica.poll() is not None:
                raise TrialFailed(f"replica {i} exited with {replica.returncode} before the kill")
        if time.monotonic() > deadline:
            raise TrialFailed("no steady state within 300 s")
        time.sleep(0.005)
    window_s = float(done[-1]["unix"]) - float(done[-2]["unix"])
    time.sleep(share * window_s)
    out: dict[str, Any] = {"kill_share_of_window": round(share, 3), "window_s_before": window_s}
    out["fault_unix"] = t0 = time.time()
    replicas[VICTIM].send_signal(signal.SIGKILL)
    survivors = [i for i in range(NPROC) if i != VICTIM]
    cap = time.monotonic() + RECOVERY_CAP_S
    recovered: float | None = None
    discarded = 0
    while time.monotonic() < cap:
        after = [s for i in survivors for s in syncs(work, i) if s["unix"] > t0]
        good = [s["unix"] for s in after if s["committed"] and s["participants"] == NPROC - 1]
        if good:
            recovered = min(good)
            discarded = sum(1 for s in after if not s["committed"] and s["unix"] < recovered)
            break
        for i in survivors:
            if replicas[i].poll() is not None:
                out["survivor_exit"] = {str(i): replicas[i].returncode}
        if "survivor_exit" in out:
            break
        time.sleep(0.005)
    out["recovery_s"] = None if recovered is None else round(recovered - t0, 4)
    out["discarded_syncs_before_recovery"] = discarded
    out["recovery_cap_s"] = RECOVERY_CAP_S
    return out


def torchft_run(
    work_dir: Path,
    setting: str,
    epochs: int,
    sync_every: int,
    kill_at: float | None,
    hidden: int = HIDDEN,
) -> dict[str, Any]:
    spec = torchft_spec(work_dir, setting, epochs, sync_every, kill_at, hidden)
    raw = run_torchft(spec, timeout_s=RECOVERY_CAP_S + 400.0)
    if "error" in raw and kill_at is None:
        raise RuntimeError(f"torchft trial failed: {raw['error']}\n{json.dumps(raw['log_tails'])}")
    if "error" in raw:  # a kill trial that went wrong counts as not recovered, with its logs
        print(f"  torchft trial failed: {raw['error']}", flush=True)
        raw.setdefault("recovery_s", None)
    result: dict[str, Any] = {k: v for k, v in raw.items() if k != "reports"}
    if kill_at is not None:
        return result
    reports = raw["reports"]
    samples = sum(int(r["samples"]) for r in reports)
    steps = sum(int(r["steps"]) for r in reports)
    wall = window(reports)
    cpu_s = sum(float(r["cpu_s"]) for r in reports)
    result.update(
        {
            "samples": samples,
            "steps": steps,
            "window_s": round(wall, 3),
            "samples_per_s": round(samples / wall, 1),
            "test_accuracy": round(statistics.mean(r["test_accuracy"] for r in reports), 4),
            "syncs_per_replica": [r["syncs"] for r in reports],
            "committed_syncs_per_replica": [r["committed_syncs"] for r in reports],
            "initial_participants": [r["initial_participants"] for r in reports],
            "fast_replica_sync_share": round(
                max(r["sync_s"] / wall for r in reports if r["replica"] != SLOW_RANK), 4
            ),
            "rank_cpu_s": round(cpu_s, 3),
            "rank_cpu_ms_per_step": round(1000 * cpu_s / steps, 3),
        }
    )
    return result


# --------------------------------------------------------------------------- the bench


def throughput_phase(
    base: Path, epochs: int, repeats: int, sync_every: int | None, peer: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """flodl first (it sets sync_every), then the sides alternate (f t t f f t ...)."""
    flodl_runs: list[dict[str, Any]] = []
    torchft_runs: list[dict[str, Any]] = []
    order = ["flodl"]
    for i in range(repeats):
        pair = ["torchft", "flodl"] if i % 2 == 0 else ["flodl", "torchft"]
        order += pair
    order = order[: 2 * repeats]  # the first flodl run counts as one of its repeats
    if not peer:
        order = ["flodl"] * repeats
    k = sync_every
    for n, side in enumerate(order):
        if side == "flodl":
            run = trio.run(flodl_run, base / f"tp-flodl-{n}", epochs, None)
            flodl_runs.append(run)
            if k is None:
                k = max(1, round(run["batches_per_rank_per_round"]))
                print(f"  sync_every for torchft: {k} (flodl's batches per rank per round)")
        else:
            assert k is not None
            run = torchft_run(base / f"tp-torchft-{n}", "defaults", epochs, k, None)
            torchft_runs.append(run)
        print(
            f"  {side:<7} {run['samples_per_s']:>7.0f} samples/s, accuracy "
            f"{run['test_accuracy']:.4f}, window {run['window_s']} s, "
            f"{run['rank_cpu_ms_per_step']:.2f} CPU-ms/step (load {run['load_before']})",
            flush=True,
        )
    assert k is not None
    return flodl_runs, torchft_runs, k


def recovery_phase(
    base: Path, epochs: int, trials: int, sync_every: int, peer: bool
) -> dict[str, list[dict[str, Any]]]:
    """Trial i of every series in turn (flodl, torchft defaults, torchft heartbeat 1 s)."""
    series: dict[str, list[dict[str, Any]]] = {"flodl": []}
    if peer:
        series.update({f"torchft_{name}": [] for name in TORCHFT_SETTINGS})
    for i in range(trials):
        share = kill_share(i, trials)
        for name, runs in series.items():
            if name == "flodl":
                run = trio.run(flodl_run, base / f"kill-flodl-{i}", epochs, share)
            else:
                setting = name.removeprefix("torchft_")
                run = torchft_run(base / f"kill-{name}-{i}", setting, epochs, sync_every, share)
            runs.append(run)
            shown = run["recovery_s"]
            print(
                f"  {name:<20} trial {i + 1}/{trials} (kill at {share:.2f} of a window): "
                f"recovery {'-' if shown is None else f'{shown:.3f} s'} "
                f"(load {run['load_before']})",
                flush=True,
            )
    return series


def side_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "samples_per_s_median": median([r["samples_per_s"] for r in runs]),
        "samples_per_s_min": min(r["samples_per_s"] for r in runs),
        "samples_per_s_max": max(r["samples_per_s"] for r in runs),
        "test_accuracy_median": median([r["test_accuracy"] for r in runs]),
        "rank_cpu_ms_per_step_median": median([r["rank_cpu_ms_per_step"] for r in runs]),
        "window_s_median": median([r["window_s"] for r in runs]),
        "runs": runs,
    }


def recovery_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    values = [r["recovery_s"] for r in runs if r["recovery_s"] is not None]
    return {
        "recovery_s_median": median(values),
        "recovery_s_min": min(values) if values else None,
        "recovery_s_max": max(values) if values else None,
        "recovery_s_per_trial": [r["recovery_s"] for r in runs],
        "trials": len(runs),
        "recovered": len(values),
        "runs": runs,
    }


def build_result(
    args: argparse.Namespace,
    skipped: str | None,
    flodl_tp: list[dict[str, Any]],
    torchft_tp: list[dict[str, Any]],
    sync_every: int,
    recovery: dict[str, list[dict[str, Any]]],
    epochs: int,
    started: float,
    load_start: float,
) -> dict[str, Any]:
    flodl = side_summary(flodl_tp)
    flodl["recovery"] = recovery_summary(recovery["flodl"])
    result: dict[str, Any] = {"quick": args.quick}
    torchft: dict[str, Any]
    if skipped is None:
        torchft = side_summary(torchft_tp)
        torchft["recovery"] = {
            name: recovery_summary(recovery[f"torchft_{name}"]) for name in TORCHFT_SETTINGS
        }
        speedup = flodl["samples_per_s_median"] / torchft["samples_per_s_median"]
        # Per interleaved pair too: the ratio of the i-th runs of each side.
        pairs = [
            round(f["samples_per_s"] / t["samples_per_s"], 3)
            for f, t in zip(flodl_tp, torchft_tp, strict=False)
        ]
        ft_default = torchft["recovery"]["defaults"]["recovery_s_median"]
        ft_hb = torchft["recovery"]["heartbeat_1s"]["recovery_s_median"]
        fl = flodl["recovery"]["recovery_s_median"]
        ratio = None if fl is None or not ft_default else round(fl / ft_default, 4)
        result.update(
            {
                "speedup_vs_torchft": round(speedup, 3),
                "speedup_per_run_pair": pairs,
                "flodl_samples_per_s": flodl["samples_per_s_median"],
                "torchft_samples_per_s": torchft["samples_per_s_median"],
                "flodl_test_accuracy": flodl["test_accuracy_median"],
                "torchft_test_accuracy": torchft["test_accuracy_median"],
                "flodl_recovery_s_median": fl,
                "torchft_defaults_recovery_s_median": ft_default,
                "torchft_heartbeat_1s_recovery_s_median": ft_hb,
                "recovery_ratio_vs_torchft_defaults": ratio,
                "recovery_ratio_vs_torchft_heartbeat_1s": None
                if fl is None or not ft_hb
                else round(fl / ft_hb, 4),
                "targets": {
                    "speedup_min": SPEEDUP_TARGET,
                    "speedup_ok": speedup >= SPEEDUP_TARGET,
                    "recovery_ratio_max": RECOVERY_RATIO_TARGET,
                    "recovery_ok": ratio is not None and ratio <= RECOVERY_RATIO_TARGET,
                },
            }
        )
    else:
        torchft = {"skipped": skipped}
        result.update(
            {
                "flodl_samples_per_s": flodl["samples_per_s_median"],
                "flodl_recovery_s_median": flodl["recovery"]["recovery_s_median"],
                "targets": {"skipped": skipped},
            }
        )
    result["flodl"] = flodl
    result["torchft"] = torchft
    result["settings"] = {
        "task": task_settings(epochs),
        "throughput_runs_per_side": args.repeats,
        "recovery_trials_per_series": args.trials,
        "victim": f"rank/replica {VICTIM} (a fast one; the slow one, {SLOW_RANK}, survives)",
        "kill": "SIGKILL from the bench, (i + 0.5) / trials of the last window's length after "
        f"the {WARM_ROUNDS}rd averaging round with every rank",
        "recovery": "fault moment (time.time() just before the signal) -> the first average "
        "committed with the reduced membership: flodl, the first SyncEnd on a newer group "
        "generation (coordinator's events.jsonl, after every survivor's ack); torchft, the first "
        "survivor LocalSGD sync with 2 participants whose should_commit said yes",
        "samples_per_s": "samples trained by all processes / (first batch on any process -> "
        "end of the last one's loop, the last average included)",
        "flodl": {
            "launch": "flodl.launch.launcher.launch == flodl run --nproc 3 --policy cadence "
            "--backend gloo bench/peer_flodl_rank.py",
            "coordinator": "CoordinatorConfig() defaults: anchor 10, overhead_target 0.05, "
            "window_cap_epochs 1, idle fill on",
            "detection": {
                "heartbeat_interval_s": CoordinatorConfig().heartbeat_interval,
                "heartbeat_timeout_s": CoordinatorConfig().heartbeat_timeout,
                "sigkill": "a closed connection is a death at once (no timeout waited)",
            },
        },
        "torchft": {
            "version": "0.2.0",
            "mode": "LocalSGD(manager, model, Adam, sync_every), Manager(ProcessGroupGloo(), "
            f"min_replica_size={MIN_REPLICAS}, rank 0, world_size 1) per replica, "
            "own TCPStore; one quorum before the first batch",
            "sync_every": sync_every,
            "sync_every_from": "flodl's batches per rank per averaging round in its first "
            "throughput run (rounded)"
            if args.sync_every is None
            else "--sync-every",
            "lighthouse": f"torchft_lighthouse --bind 127.0.0.1:{LIGHTHOUSE_PORT} "
            f"--min_replicas {MIN_REPLICAS}",
            "defaults": TORCHFT_DEFAULTS,
            "heartbeat_1s": "as defaults, with --heartbeat_timeout_ms 1000",
            "throughput_setting": "defaults",
            "isolation": "each trial in a fresh network namespace with only lo (unshare -n)",
            "recovery_cap_s": RECOVERY_CAP_S,
        },
        "targets": {
            "speedup": f"flodl samples/s >= {SPEEDUP_TARGET} x torchft's (slow rank 2.5x)",
            "recovery": f"flodl median recovery <= {RECOVERY_RATIO_TARGET} x torchft's at its "
            "defaults",
        },
    }
    result["load_average"] = {"start": load_start, "end": load()}
    result["total_bench_s"] = round(time.perf_counter() - started, 1)
    result["environment"] = environment()
    return result


def print_summary(result: dict[str, Any]) -> None:
    flodl, torchft = result["flodl"], result["torchft"]
    print(
        f"\n{'side':<22} {'samples/s':>10} {'accuracy':>9} {'CPU-ms/step':>12} {'recovery s':>11}"
    )
    fr = flodl["recovery"]["recovery_s_median"]
    print(
        f"{'flodl cadence':<22} {flodl['samples_per_s_median']:>10.0f} "
        f"{flodl['test_accuracy_median']:>9.4f} {flodl['rank_cpu_ms_per_step_median']:>12.2f} "
        f"{'-' if fr is None else f'{fr:.3f}':>11}"
    )
    if "skipped" in torchft:
        print(skip_message(torchft["skipped"]))
        return
    for name in TORCHFT_SETTINGS:
        r = torchft["recovery"][name]["recovery_s_median"]
        label = f"torchft ({name})"
        if name == "defaults":
            print(
                f"{label:<22} {torchft['samples_per_s_median']:>10.0f} "
                f"{torchft['test_accuracy_median']:>9.4f} "
                f"{torchft['rank_cpu_ms_per_step_median']:>12.2f} "
                f"{'-' if r is None else f'{r:.3f}':>11}"
            )
        else:
            print(f"{label:<22} {'':>10} {'':>9} {'':>12} {'-' if r is None else f'{r:.3f}':>11}")
    targets = result["targets"]
    print(
        f"speedup {result['speedup_vs_torchft']:.2f}x (target >= {SPEEDUP_TARGET}: "
        f"{'met' if targets['speedup_ok'] else 'MISSED'}); recovery ratio "
        f"{result['recovery_ratio_vs_torchft_defaults']} (target <= {RECOVERY_RATIO_TARGET}: "
        f"{'met' if targets['recovery_ok'] else 'MISSED'})"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_torchft-trial"]:  # inside the namespace (run_torchft)
        spec = json.loads(Path(argv[1]).read_text())
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally: reap the children
        result = torchft_trial(spec)
        (Path(spec["work_dir"]) / "result.json").write_text(json.dumps(result))
        return 0
    parser = argparse.ArgumentParser(description="torchft LocalSGD vs flodl Cadence")
    parser.add_argument("--quick", action="store_true", help="4 epochs, 1 run/trial of each")
    parser.add_argument("--check", action="store_true", help="say whether torchft can run")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs per side")
    parser.add_argument("--trials", type=int, default=5, help="recovery trials per series")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--sync-every", type=int, default=None, help="default: flodl's window")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run dirs here")
    args = parser.parse_args(argv)
    skipped = peer_unavailable()
    if args.check:
        print(skip_message(skipped) if skipped else "peers bench: torchft side available")
        return 0
    if args.quick:
        args.repeats, args.trials, epochs = 1, 1, 4
    else:
        args.repeats, args.trials = max(args.repeats, 1), max(args.trials, 1)
        epochs = args.epochs
    if skipped:
        print(skip_message(skipped), flush=True)
    started = time.perf_counter()
    load_start = load()
    print(
        f"peers bench: {NPROC} processes, rank {SLOW_RANK} {SLOW_FACTOR}x slower, {epochs} "
        f"epochs; {args.repeats} throughput run(s) per side, {args.trials} recovery trial(s) "
        f"per series (load {load_start})",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="flodl-peers-") as scratch:
        base = args.keep or Path(scratch)
        base.mkdir(parents=True, exist_ok=True)
        flodl_tp, torchft_tp, k = throughput_phase(
            base, epochs, args.repeats, args.sync_every, skipped is None
        )
        recovery = recovery_phase(base, epochs, args.trials, k, skipped is None)
    result = build_result(
        args, skipped, flodl_tp, torchft_tp, k, recovery, epochs, started, load_start
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"load average {load()} on {os.cpu_count()} cpus; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
