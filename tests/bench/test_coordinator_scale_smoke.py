"""Smoke run of bench/coordinator_scale.py (8 ranks, 2 s) so the benchmark keeps working."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "coordinator_scale.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("coordinator_scale", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nearest_rank_quantiles() -> None:
    bench = load_bench()
    samples = [0.004, 0.001, 0.003, 0.002]  # sorted: 1, 2, 3, 4 ms
    assert bench.quantile(sorted(samples), 0.50) == 0.002  # ceil(0.5 * 4) = 2nd
    assert bench.quantile(sorted(samples), 0.99) == 0.004  # ceil(0.99 * 4) = 4th
    assert bench.summarize_ms(samples) == {
        "count": 4,
        "p50_ms": 2.0,
        "p99_ms": 4.0,
        "max_ms": 4.0,
    }


def test_ticks_stay_on_the_rank_grid() -> None:
    bench = load_bench()
    assert bench._next_grid_tick(1.0, 0.03, 0.1) == pytest.approx(1.03)
    assert bench._next_grid_tick(1.03, 0.03, 0.1) == pytest.approx(1.13)  # strictly after
    assert bench._next_grid_tick(0.0, 0.05, 0.1) == pytest.approx(0.05)


def test_eight_ranks_for_two_seconds(tmp_path: Path) -> None:
    output = tmp_path / "coordinator.json"
    command = [sys.executable, str(BENCH), "--ranks", "8", "--seconds", "2", "--output"]
    done = subprocess.run(
        [*command, str(output)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(output.read_text())
    assert result["environment"]["cpu_count"] >= 1
    assert "on_message" in result["latency_definition"]
    (row,) = result["counts"]
    assert row["ranks"] == 8
    # Every message the machine processed was matched to its send time.
    assert row["unmatched_messages"] == 0
    assert row["latency"]["count"] == row["messages"] == sum(row["messages_by_kind"].values())
    lat = row["latency"]
    assert 0.0 <= lat["p50_ms"] <= lat["p99_ms"] <= lat["max_ms"]
    # 8 ranks x 2 s: at most 10 Batch/s each (one grid tick may straddle the window's ends)
    # and at least 70% of that (barrier waits); about one heartbeat per rank per second.
    kinds = row["messages_by_kind"]
    assert 112 <= kinds["Batch"] <= 168
    assert 8 <= kinds["Heartbeat"] <= 24
    assert 8 <= row["sent_to_ranks_by_kind"]["CoordHeartbeat"] <= 24
    assert row["rounds_started"] >= 2  # warm-up waits for round 2
    assert row["cpu_us_per_message"] > 0
    assert result["cpu_us_per_message"] == row["cpu_us_per_message"]
    assert result["max_ranks_meeting_target"] == (8 if row["meets_target"] else 0)
