"""Checks of bench/recovery_bench.py's helpers (fast) and one smoke run (--quick at 3 ranks), so
the benchmark keeps working. Figures are never asserted: a quick run's mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import recovery_bench


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_fault_points_scale_with_the_ranks() -> None:
    assert [recovery_bench.fault_batch(3, i) for i in range(3)] == [20, 27, 34]
    assert [recovery_bench.fault_batch(16, i) for i in range(3)] == [4, 5, 6]
    assert recovery_bench.fault_batch(100, 0) == 2
    assert recovery_bench.faulty_rank(8) == 7
    assert recovery_bench.sigstop_timeout(3) == recovery_bench.SIGSTOP_HEARTBEAT_TIMEOUT_S
    assert recovery_bench.epochs_at(3, 3) == 3
    assert recovery_bench.epochs_at(16, 3) == 3 + recovery_bench.EXTRA_EPOCHS
    assert recovery_bench.sigstop_timeout(16) == recovery_bench.SIGSTOP_HEARTBEAT_TIMEOUT_LARGE_S


def test_recovery_and_reformation_read_the_chaos_records(tmp_path: Path) -> None:
    fault = {"generation": 0, "unix": 100.0}
    chaos = tmp_path / "chaos"
    write_jsonl(
        chaos / "rank0.rounds.jsonl",
        [{"generation": 0, "unix": 99.0}, {"generation": 1, "unix": 100.4}],
    )
    write_jsonl(
        chaos / "rank1.rounds.jsonl",
        [{"generation": 0, "unix": 100.1}, {"generation": 1, "unix": 100.3}],
    )
    write_jsonl(
        chaos / "rank0.events.jsonl",
        [
            {"event": "join", "generation": 1, "unix": 100.1},
            {"event": "joined", "generation": 1, "unix": 100.2},
            {"event": "average", "generation": 1, "unix": 100.2},
        ],
    )
    write_jsonl(
        chaos / "rank1.events.jsonl",
        [
            {"event": "join", "generation": 1, "unix": 100.15},
            {"event": "joined", "generation": 1, "unix": 100.25},
        ],
    )
    assert recovery_bench.recovery_after(tmp_path, [0, 1], fault) == pytest.approx(0.3)
    assert recovery_bench.recovery_after(tmp_path, [2], fault) is None
    breakdown = recovery_bench.reformation(tmp_path, [0, 1], fault)
    assert breakdown["generation"] == 1
    assert breakdown["join_started_s"] == pytest.approx([0.1, 0.15])
    assert breakdown["joined_s"] == pytest.approx([0.2, 0.25])
    assert breakdown["average_started_s"] == pytest.approx([0.2, 0.2])
    assert breakdown["first_average_done_s"] == pytest.approx([0.3, 0.4])
    assert breakdown["survivors_joined"] == 2
    assert recovery_bench.reformation(tmp_path, [2], fault) == {"generation": None}


def test_summary_per_n_keeps_medians_ranges_and_targets() -> None:
    trials: dict[str, list[dict[str, Any]]] = {
        "sigkill": [{"recovery_s": 0.1}, {"recovery_s": 0.3}, {"recovery_s": None}],
        "sigstop": [{"recovery_s": 2.1}],
    }
    out = recovery_bench.summarize(3, trials)
    assert out["sigkill_recovery_s_median"] == pytest.approx(0.2)
    assert (out["sigkill_recovery_s_min"], out["sigkill_recovery_s_max"]) == (0.1, 0.3)
    assert (out["sigkill_trials"], out["sigkill_recovered"]) == (3, 2)
    assert out["targets"]["sigkill_ok"] and out["targets"]["sigstop_ok"]
    assert out["targets"]["sigstop_recovery_s_max"] == pytest.approx(2.5)


@pytest.mark.long
@pytest.mark.slow
def test_quick_run_writes_every_n(tmp_path: Path) -> None:
    output = tmp_path / "recovery.json"
    bench = Path(recovery_bench.__file__)
    subprocess.run(
        [sys.executable, str(bench), "--quick", "--nproc", "3", "--output", str(output)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    result = json.loads(output.read_text())
    assert result["quick"] is True
    assert result["nprocs"] == [3]
    assert set(result["by_nproc"]) == {"3"}
    for name in ("sigkill", "sigstop"):
        [trial] = result["by_nproc"]["3"]["trials"][name]
        assert trial["fault_happened"] is True, trial
        assert trial["status"] == "completed", trial
        assert trial["load_before"] is not None and trial["load_after"] is not None
        assert f"{name}_recovery_s_median" in result  # the keys docs/benchmarks.md quotes
