"""Smoke run of bench/quality_bench.py (--quick: digits, 2 ranks, a 1 s budget, one repeat of
solo, DDP and flodl cadence with the Nesterov outer step) and checks of its helpers, so the
benchmark keeps working. The figures of a quick run mean nothing; what is checked is that every
variant trained and was evaluated, the JSON has its keys, torchft's LocalSGD and DiLoCo ran
(where torchft and network namespaces are available) or were skipped with their reason, and no
process the bench started is left. Nothing asserts a timing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import quality_bench
import quality_procs
import quality_task

from flodl.cli import build_parser

BENCH_DIR = Path(quality_bench.__file__).resolve().parent


def test_spec_round_trips_and_reaches_the_script_through_flodl_run() -> None:
    spec = quality_task.RunSpec(
        workload="gpt", budget_s=7.5, points=3, seed=2, slow_rank=1, result_dir="/tmp/x"
    )
    parsed, rest = quality_task.parse_spec([*spec.args(), "--rank=1"])
    assert parsed == spec
    assert rest == ["--rank=1"]
    assert spec.factor(1) == 2.5 and spec.factor(0) == 1.0
    # flodl run hands every argument after the script to it, none taken as its own option.
    variant = quality_bench.BY_NAME["async+nesterov"]
    command = quality_bench.flodl_command(variant, spec, 2, Path("/tmp/run"))
    args = build_parser().parse_args(command[1:])
    assert args.script == str(quality_bench.QUALITY_RANK)
    assert list(args.script_args) == spec.args()
    assert (args.policy, args.outer, args.outer_lr, args.outer_momentum) == (
        "async",
        "nesterov",
        0.7,
        0.9,
    )


def test_first_reach_interpolates_between_points() -> None:
    curve = [{"t": 0.0, "loss": 3.0}, {"t": 2.0, "loss": 2.0}, {"t": 4.0, "loss": 1.0}]
    assert quality_bench.first_reach(curve, 1.5) == 3.0
    assert quality_bench.first_reach(curve, 2.0) == 2.0
    assert quality_bench.first_reach(curve, 3.5) == 0.0
    assert quality_bench.first_reach(curve, 0.5) is None


def test_spread_counts_never_as_infinite_time() -> None:
    assert quality_bench.spread([3.0, 1.0, 2.0]) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "per_repeat": [3.0, 1.0, 2.0],
    }
    times = quality_bench.spread([3.0, None, 2.0])
    assert (times["median"], times["min"], times["max"]) == (3.0, 2.0, None)
    assert quality_bench.spread([None, None, 1.0])["median"] is None
    ratios = quality_bench.speedup(6.0, times)
    assert ratios == {"median": 2.0, "min": None, "max": 3.0, "per_repeat": [2.0, None, 3.0]}


def test_budget_clock_pauses_while_evaluating() -> None:
    now = [100.0]
    clock = quality_task.BudgetClock(budget_s=10.0, points=2, now=lambda: now[0])
    clock.evaluate(lambda: 1.0, step=0)  # before the first batch: t = 0
    clock.start()
    assert clock.curve == [{"t": 0.0, "loss": 1.0, "step": 0}]
    assert not clock.due()  # the next point is at 5 s

    def slow_loss() -> float:
        now[0] += 30.0  # the evaluation takes 30 s
        return 0.5

    now[0] += 6.0
    assert clock.due() and not clock.over()
    clock.evaluate(slow_loss)
    assert clock.elapsed() == 6.0  # off the clock
    assert not clock.due()  # the points are every 5 s and the last is the budget's end
    now[0] += 4.0
    assert clock.over()
    clock.evaluate(lambda: 0.25, final=True)
    assert [(p["t"], p["loss"]) for p in clock.curve] == [(0.0, 1.0), (6.0, 0.5), (10.0, 0.25)]
    assert clock.curve[-1]["final"] is True


def test_corpus_leaves_out_codec_tables_and_is_a_fixed_shuffle(tmp_path: Path) -> None:
    for name in ("a.py", "b/c.py", "encodings/cp1.py", "site-packages/x.py", "d/encodings/e.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("pass\n")
    files = quality_task.stdlib_files(tmp_path)
    assert sorted(files) == ["a.py", "b/c.py", "d/encodings/e.py"]
    assert files == sorted(files, key=quality_task.path_key)


def test_torchft_is_skipped_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # find_spec -> None: "not installed"
    reason = quality_bench.torchft_unavailable()
    assert reason is not None
    assert "torchft is not installed" in reason
    assert "bench/requirements-peers.txt" in reason


def curve_ok(run: dict[str, Any], budget_s: float) -> None:
    curve = run["curve"]
    assert curve[0]["t"] == 0.0 and curve[-1]["final"] is True
    assert curve[-1]["t"] >= budget_s
    assert [p["t"] for p in curve] == sorted(p["t"] for p in curve)
    assert run["loss_at_budget"] == curve[-1]["loss"] < curve[0]["loss"]  # it trained


@pytest.mark.long
@pytest.mark.slow
def test_quick_run_writes_the_results(tmp_path: Path) -> None:
    output = tmp_path / "quality.json"
    command = [
        sys.executable,
        str(BENCH_DIR / "quality_bench.py"),
        "--quick",
        "--output",
        str(output),
        "--keep",
        str(tmp_path / "runs"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(output.read_text())
    assert result["quick"] is True
    assert {"date", "command", "load_average", "table", "settings", "environment"} <= set(result)
    assert (tmp_path / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (cell,) = result["results"].values()
    assert (cell["workload"], cell["layout"]["ranks"], cell["repeats"]) == ("digits", 2, 1)
    variants = cell["variants"]
    assert list(variants) == list(quality_bench.QUICK)
    peers = ("torchft-localsgd", "torchft-diloco")
    skipped = quality_bench.torchft_unavailable()
    assert cell["torchft_skipped"] == skipped
    trained = ["solo", "ddp", "cadence+nesterov"] + ([] if skipped else list(peers))
    if skipped:
        for name in peers:
            assert variants[name] == {"skipped": skipped}
    else:
        assert cell["torchft_reference"] in peers
        assert cell["torchft_loss_at_budget"] == quality_bench.reference_loss(
            cell, cell["torchft_reference"]
        )
    pids: list[int] = []
    for name in trained:
        variant = variants[name]
        (run,) = variant["runs"]
        assert "error" not in run, run.get("error")
        curve_ok(run, cell["budget_s"])
        assert run["load_before"] >= 0 and run["load_after"] >= 0 and run["commands"]
        for key in ("loss_at_budget", "time_to_solo_loss", "time_to_ddp_loss"):
            assert set(variant[key]) == {"median", "min", "max", "per_repeat"}
        for key in ("speedup_to_quality_vs_solo", "speedup_to_quality_vs_ddp"):
            assert set(variant[key]) == {"median", "min", "max", "per_repeat"}
        if skipped:
            assert variant["speedup_to_quality_vs_torchft"]["median"] is None
        else:
            assert set(variant["speedup_to_quality_vs_torchft"]) == {
                "median",
                "min",
                "max",
                "per_repeat",
            }
        pids += run["pids"]
    assert cell["solo_loss_at_budget"] == variants["solo"]["runs"][0]["loss_at_budget"]
    assert variants["solo"]["time_to_solo_loss"]["median"] is not None  # its own end, at least
    flodl = variants["cadence+nesterov"]["runs"][0]["flodl"]
    assert (flodl["exit_code"], flodl["status"]) == (0, "completed")  # ended by rank.stop()
    assert len(flodl["per_rank"]) == 2 and flodl["rounds"] >= 1
    assert "--outer nesterov" in variants["cadence+nesterov"]["runs"][0]["commands"][0]
    assert [row["variant"] for row in result["table"]] == trained
    # Every process: the solo one, 2 DDP ranks, the launcher and its 2 ranks, and for each
    # torchft peer its runner, lighthouse and 2 replicas; none is left.
    assert len(set(pids)) == 6 + (0 if skipped else 8)
    assert result["leftover_processes"] == []
    assert not [pid for pid in pids if quality_procs.alive(pid)]
