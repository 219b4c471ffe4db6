"""Dashboard benchmark: what 50 polling clients cost a real run's averaging rounds, and what the
event log costs the coordinator per round.

Writes bench/results/dashboard.json and prints a short summary.

* **Round time under load.** Trials are real ``flodl run --dashboard 127.0.0.1:0`` runs
  (3 ranks, gloo, the digits MLP of examples/digits.py, rank 2 made 2x slower, ``--policy
  sync``: a round after every batch, so a run has hundreds of short rounds, where any delay
  the coordinator adds shows most), in sets of three (8 sets by default: the baseline alone
  varies by more than the 5% looked for between runs on a small shared machine): no client,
  then 50 clients that each poll ``/api/state`` and ``/api/events?since=N`` every 100 ms over
  a keep-alive connection, as the page does (every 1 s) but ten times as often.
  The clients run in a process of their own at ``nice 19``: on this small machine they stand
  for browsers elsewhere, so what is measured is the serving work in the coordinator's
  process, not the clients' CPU taking the ranks' cores. Round time = ``duration_s`` of every
  ``SyncEnd`` in the run's events.jsonl but the first (it includes forming the first group).
  Key ``round_time_ratio``: median round time with clients / without (target <= 1.05).
  A third run of each set has the 50 clients poll once a second, as the page does
  (``round_time_ratio_page_rate``: fifty open pages).
  The CPU time of the process that hosts the coordinator and the dashboard is read from
  /proc as the run completes: its growth with clients over the requests served is the
  serving cost per request (``serving_cpu_us_per_request``).
* **The event log's cost per round.** A scripted cluster (flodl.testing, 3 ranks, in-process,
  MockClock: only CPU time counts) runs many rounds while ``Observer._take`` (which includes
  ``EventLog.offer``) and ``EventLog.offer`` are timed with ``time.thread_time`` (CPU time:
  being descheduled on a shared machine is not counted); once with the observer alone, once
  with the dashboard's listeners (metrics) attached. Keys ``observer_take_us_per_round`` and
  ``event_log_offer_us_per_round``.

``--quick``: one set of short runs and a short scripted run (figures mean little).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchenv
import trio
from benchenv import load

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "dashboard.json"
DIGITS = ROOT / "examples" / "digits.py"
NPROC = 3
CLIENTS = 50
POLL_S = 0.1
PAGE_POLL_S = 1.0
"""How often the dashboard's page itself asks (a third condition: 50 open pages)."""
TARGET_RATIO = 1.05


# --- the clients ------------------------------------------------------------------------------


async def _exchange(stream: trio.SocketStream, buffer: bytearray, target: str) -> bytes:
    """One keep-alive GET on ``stream``; the body (``buffer`` keeps bytes read past it)."""
    await stream.send_all(f"GET {target} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    while b"\r\n\r\n" not in buffer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("closed")
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise ConnectionError("closed")
        rest += chunk
    buffer[:] = rest[length:]
    if status != 200:
        raise ConnectionError(f"{target}: {status}")
    return rest[:length]


async def _client(port: int, every: float, stats: dict[str, Any]) -> None:
    """Poll like the page, every ``every`` seconds, reconnecting when the server closes."""
    since = 0
    while True:
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            stats["errors"] += 1
            await trio.sleep(every)
            continue
        buffer = bytearray()
        try:
            async with stream:
                while True:
                    began = trio.current_time()
                    await _exchange(stream, buffer, "/api/state")
                    body = await _exchange(stream, buffer, f"/api/events?since={since}")
                    since = json.loads(body)["next"]
                    stats["latency_s"].append(trio.current_time() - began)
                    stats["polls"] += 1
                    await trio.sleep_until(began + every)
        except (OSError, ConnectionError, trio.BrokenResourceError, ValueError):
            stats["errors"] += 1


async def poll(port: int, clients: int, every: float) -> dict[str, Any]:
    """Run ``clients`` pollers until stdin closes; what they saw."""
    stats: dict[str, Any] = {"polls": 0, "errors": 0, "latency_s": []}
    began = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            # Spread over the interval, as pages opened at different moments are.
            nursery.start_soon(_client, port, every, stats)
            await trio.sleep(every / clients)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()
    latency = sorted(stats["latency_s"]) or [0.0]
    return {
        "clients": clients,
        "polls": stats["polls"],
        "requests": 2 * stats["polls"],
        "poll_s": round(trio.current_time() - began, 3),
        "errors": stats["errors"],
        "poll_latency_ms_median": round(1000 * statistics.median(latency), 2),
        "poll_latency_ms_p99": round(1000 * latency[int(0.99 * (len(latency) - 1))], 2),
    }


# --- a real run -------------------------------------------------------------------------------


def round_times(run_dir: Path) -> list[float]:
    """``duration_s`` of the run's rounds, the first (which forms the first group) left out."""
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ends = [r for r in records if r.get("kind") == "SyncEnd" and not r.get("redo")]
    return [float(r["duration_s"]) for r in ends[1:]]


def trial(run_dir: Path, clients: int, every: float, epochs: int) -> dict[str, Any]:
    """One ``flodl run`` of digits, with ``clients`` pollers on its dashboard from the moment
    it prints its URL until it ends. Every process it starts has ended when it returns."""
    argv = [sys.executable, "-m", "flodl.cli", "run", "--nproc", str(NPROC), "--no-live"]
    argv += ["--policy", "sync", "--dashboard", "127.0.0.1:0", "--run-dir", str(run_dir)]
    argv += [str(DIGITS), "--epochs", str(epochs), "--slow", "2:2"]
    load_before = load()
    run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert run.stdout is not None
    pollers: subprocess.Popen[str] | None = None
    output: list[str] = []
    cpu_s: float | None = None
    try:
        for line in run.stdout:
            output.append(line)
            if line.startswith("flodl: run completed"):
                cpu_s = process_cpu_s(run.pid)
            if "flodl: dashboard at " in line and clients:
                port = int(line.rsplit(":", 1)[1].strip(" /\n"))
                command = ["nice", "-n", "19", sys.executable, __file__, "--poll", str(port)]
                command += ["--clients", str(clients), "--every", str(every)]
                pollers = subprocess.Popen(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                )
        run.wait(300)
        seen: dict[str, Any] = {}
        if pollers is not None:
            out, _ = pollers.communicate("", timeout=30)
            seen = json.loads(out)
    finally:
        for process in (run, pollers):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        run.stdout.close()
    if run.returncode != 0:
        raise RuntimeError(f"flodl run failed ({run.returncode}):\n{''.join(output)}")
    times = round_times(run_dir)
    return {
        "clients": clients,
        "poll_interval_s": every,
        "rounds": len(times),
        "round_s_median": statistics.median(times),
        "round_s_mean": statistics.fmean(times),
        "round_s": [round(t, 6) for t in times],
        "polling": seen,
        "host_process_cpu_s": cpu_s,
        "load_before": load_before,
        "load_after": load(),
    }


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` itself (not its children), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the event log's cost, in-process ---------------------------------------------------------


def timed(totals: dict[str, float], key: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.thread_time()
        try:
            return method(*args, **kwargs)
        finally:
            totals[key] += time.thread_time() - began

    return wrapper


async def _scripted(folder: Path, dataset_size: int, with_dashboard: bool) -> dict[str, Any]:
    from flodl.observe.events import EventLog
    from flodl.observe.hub import Observer, open_observer
    from flodl.testing import RankScript, open_cluster

    totals = {"take": 0.0, "offer": 0.0}
    original_take, original_offer = Observer._take, EventLog.offer
    Observer._take = timed(totals, "take", original_take)  # type: ignore[method-assign]
    EventLog.offer = timed(totals, "offer", original_offer)  # type: ignore[method-assign]
    try:
        scripts = [RankScript(ms_per_batch=ms) for ms in (10.0, 15.0, 20.0)]
        async with open_cluster(scripts, dataset_size=dataset_size, batch_size=10) as cluster:
            async with open_observer(cluster.coordinator, folder) as observer:
                if with_dashboard:
                    from flodl.observe.dashboard_app import DashboardApp
                    from flodl.observe.metrics import RunMetrics

                    DashboardApp(observer, None, RunMetrics(observer))
                await cluster.coordinator.wait_finished()
                records = len(observer.history)
                rounds = sum(1 for r in observer.history if r["kind"] == "SyncEnd")
    finally:
        Observer._take = original_take  # type: ignore[method-assign]
        EventLog.offer = original_offer  # type: ignore[method-assign]
    return {
        "dashboard_listeners": with_dashboard,
        "rounds": rounds,
        "records": records,
        "observer_take_us_per_round": round(1e6 * totals["take"] / rounds, 2),
        "event_log_offer_us_per_round": round(1e6 * totals["offer"] / rounds, 2),
        "observer_take_us_per_record": round(1e6 * totals["take"] / records, 2),
    }


def event_log_cost(dataset_size: int) -> list[dict[str, Any]]:
    from trio.testing import MockClock

    results = []
    with tempfile.TemporaryDirectory(prefix="flodl-dashboard-bench-") as scratch:
        for i, with_dashboard in enumerate((False, True)):
            folder = Path(scratch) / str(i)
            folder.mkdir()
            results.append(
                trio.run(
                    _scripted,
                    folder,
                    dataset_size,
                    with_dashboard,
                    clock=MockClock(autojump_threshold=0),
                )
            )
    return results


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flodl dashboard benchmark")
    parser.add_argument("--quick", action="store_true", help="one short pair; figures mean little")
    parser.add_argument("--sets", type=int, default=8, help="sets of runs (one per condition)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--poll", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--every", type=float, default=POLL_S, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.poll is not None:  # the client process of a trial
        print(json.dumps(trio.run(poll, args.poll, args.clients, args.every)))
        return 0
    pairs, epochs, dataset = (1, 2, 20_000) if args.quick else (args.sets, args.epochs, 300_000)

    started = time.perf_counter()
    load_start = load()
    conditions: list[tuple[str, int, float]] = [("no_clients", 0, 0.0)]
    conditions += [
        ("clients", args.clients, POLL_S),
        ("clients_page_rate", args.clients, PAGE_POLL_S),
    ]
    trials: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in conditions}
    with tempfile.TemporaryDirectory(prefix="flodl-dashboard-bench-") as scratch:
        for i in range(pairs):
            for name, clients, every in conditions:
                outcome = trial(Path(scratch) / f"{name}-{i}", clients, every, epochs)
                trials[name].append(outcome)
                print(
                    f"  pair {i + 1}/{pairs} {name}: {outcome['rounds']} rounds, median "
                    f"{1000 * outcome['round_s_median']:.2f} ms, load {outcome['load_before']}"
                    + (f", {outcome['polling']['requests']} requests" if clients else ""),
                    flush=True,
                )
    pooled = {name: [t for run in runs for t in run["round_s"]] for name, runs in trials.items()}
    median = {name: statistics.median(times) for name, times in pooled.items()}
    ratio = median["clients"] / median["no_clients"]
    pair_ratios = [
        c["round_s_median"] / n["round_s_median"]
        for n, c in zip(trials["no_clients"], trials["clients"], strict=True)
    ]
    cost = event_log_cost(dataset)
    served = sum(t["polling"]["requests"] for t in trials["clients"])
    cpu = {name: [t["host_process_cpu_s"] for t in runs] for name, runs in trials.items()}
    serving_us = None
    if served and all(v is not None for vs in cpu.values() for v in vs):
        extra = sum(cpu["clients"]) - sum(cpu["no_clients"])
        serving_us = round(1e6 * extra / served, 1)
    result: dict[str, Any] = {
        "round_time_ratio": round(ratio, 4),
        "round_time_ratio_of_means": round(
            statistics.fmean(pooled["clients"]) / statistics.fmean(pooled["no_clients"]), 4
        ),
        "round_time_ratio_per_pair": [round(r, 4) for r in pair_ratios],
        "round_s_median_no_clients": round(median["no_clients"], 6),
        "round_s_median_clients": round(median["clients"], 6),
        "round_time_ratio_page_rate": round(median["clients_page_rate"] / median["no_clients"], 4),
        "round_s_median_clients_page_rate": round(median["clients_page_rate"], 6),
        "rounds_no_clients": len(pooled["no_clients"]),
        "rounds_clients": len(pooled["clients"]),
        "requests_served": served,
        "requests_per_s": round(served / sum(t["polling"]["poll_s"] for t in trials["clients"]), 1),
        "serving_cpu_us_per_request": serving_us,
        "observer_take_us_per_round": cost[0]["observer_take_us_per_round"],
        "observer_take_us_per_round_with_dashboard": cost[1]["observer_take_us_per_round"],
        "event_log_offer_us_per_round": cost[0]["event_log_offer_us_per_round"],
        "targets": {"round_time_ratio_max": TARGET_RATIO, "ok": ratio <= TARGET_RATIO},
        "quick": args.quick,
        "trials": trials,
        "event_log_cost": cost,
        "settings": {
            "processes": NPROC,
            "backend": "gloo",
            "task": f"examples/digits.py, {epochs} epochs, --slow 2:2, --policy sync",
            "clients": args.clients,
            "poll_interval_s": POLL_S,
            "client_process": "one process of its own, nice 19, keep-alive connections",
            "pairs": pairs,
            "round_time": "SyncEnd duration_s from events.jsonl, the first round left out",
            "event_log_cost_run": f"flodl.testing scripted cluster, 3 ranks, MockClock, "
            f"dataset {dataset}, batch 10",
        },
        "environment": benchenv.environment(
            ("torch", "trio", "hypercorn", "prometheus-client", "flodl"),
            load_average_1m_start=load_start,
            load_average_1m_end=load(),
            wall_s=round(time.perf_counter() - started, 1),
        ),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nround time: {1000 * median['no_clients']:.2f} ms without clients, "
        f"{1000 * median['clients']:.2f} ms with {args.clients} (ratio {ratio:.3f}, "
        f"target <= {TARGET_RATIO}: {'yes' if ratio <= TARGET_RATIO else 'NO'})"
    )
    print(
        f"event log per round: Observer._take {cost[0]['observer_take_us_per_round']} us "
        f"({cost[1]['observer_take_us_per_round']} us with the dashboard's listeners), "
        f"of which EventLog.offer {cost[0]['event_log_offer_us_per_round']} us"
    )
    print(f"50 clients at the page's rate (1 s): ratio {result['round_time_ratio_page_rate']:.3f}")
    print(f"serving: {served} requests, {serving_us} us of the host process's CPU each")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
