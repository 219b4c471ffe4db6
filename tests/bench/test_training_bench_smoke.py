"""Smoke run of bench/training_bench.py (--quick: 2 ranks, tiny models, one epoch) and checks of
its helpers, so the benchmark keeps working. The figures of a quick run mean nothing; what is
checked is that every side trained (flodl and DDP the whole epoch, the ceiling for flodl's
window) and the JSON says what it should."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import averaging_overhead
import ddp_baseline
import training_bench
import training_task

BENCH_DIR = Path(training_bench.__file__).resolve().parent

pytestmark = pytest.mark.slow


def test_task_options_round_trip() -> None:
    task = training_task.TaskConfig(hidden=7, batch_size=3, epochs=2, lr=0.5, slow_factor=1.5)
    parsed, rest = training_task.parse_task([*task.args(), "--rank", "2"])
    assert parsed == task
    assert rest == ["--rank", "2"]


def test_collective_time_is_not_slowed_down() -> None:
    """The slow rank sleeps (factor - 1) x compute; time spent communicating is not compute."""
    task = training_task.TaskConfig(hidden=8)
    model = training_task.build_model(task)
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.zeros(4, 64), torch.zeros(4, dtype=torch.int64)
    started = time.perf_counter()
    loss = training_task.train_step(model, optimizer, x, y, 1000.0, lambda: 10.0)
    assert time.perf_counter() - started < 1.0  # all of it "communication": no sleep at all
    assert loss == pytest.approx(2.3, abs=0.5)  # about ln(10) for an untrained 10-way MLP


def test_comm_span_covers_first_start_to_last_end() -> None:
    span = ddp_baseline.CommSpan(first_start=1.0, last_end=1.25)
    assert span.take() == 0.25
    assert span.taken == 0.25
    assert span.take() == 0.0  # reset: no all-reduce since


def test_window_and_overhead_summary() -> None:
    reports = [
        {"first_batch_unix": 10.0, "loop_end_unix": 14.0},
        {"first_batch_unix": 10.5, "loop_end_unix": 15.0},
    ]
    assert training_bench.window(reports) == 5.0
    stages = dict.fromkeys(averaging_overhead.STAGES, 0.001)
    rows = [
        {
            "bare": 0.010,
            "copy_floor": 0.012,
            "flodl": 0.020,
            "flodl_no_verify": 0.015,
            "flodl_sampled": 0.013,
            "flodl_bf16": 0.010,
            **stages,
        },
        {
            "bare": 0.010,
            "copy_floor": 0.015,
            "flodl": 0.030,
            "flodl_no_verify": 0.012,
            "flodl_sampled": 0.015,
            "flodl_bf16": 0.015,
            **stages,
        },
        {
            "bare": 0.020,
            "copy_floor": 0.024,
            "flodl": 0.030,
            "flodl_no_verify": 0.020,
            "flodl_sampled": 0.024,
            "flodl_bf16": 0.015,
            **stages,
        },
    ]
    summary = averaging_overhead.summarize(rows)
    assert summary["overhead_ratio"] == 2.0  # per-repetition ratios 2, 3, 1.5
    assert summary["overhead_ratio_spread"] == [1.5, 3.0]
    assert summary["overhead_ratio_no_verify"] == 1.2  # 1.5, 1.2, 1.0
    assert summary["bare_allreduce_ms"] == 10.0
    assert summary["stages_sum_ms"] == pytest.approx(len(averaging_overhead.STAGES))  # 1 ms each
    assert summary["copy_floor_ratio"] == 1.2  # 1.2, 1.5, 1.2
    assert summary["overhead_ratio_over_floor"] == 1.667  # 1.667, 2, 1.25
    assert summary["overhead_ratio_over_floor_sampled"] == 1.0  # 1.083, 1, 1
    assert summary["bf16_round_ratio"] == 0.5  # 0.5, 0.5, 0.5


@pytest.mark.long
def test_quick_run_writes_the_results(tmp_path: Path) -> None:
    output = tmp_path / "training.json"
    command = [sys.executable, str(BENCH_DIR / "training_bench.py"), "--quick", "--output"]
    done = subprocess.run(
        [*command, str(output)], capture_output=True, text=True, timeout=420, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(output.read_text())
    assert result["quick"] is True
    overhead = result["averaging_overhead"]
    assert overhead["parameters"] == 2 * (256 * 256 + 256) + 2 * 256  # 2 linears + BN affine
    # Mass and mover, 14 zeros that align the first weight to 16 elements, the BN buffers.
    assert overhead["flat_elements"] == overhead["parameters"] + 2 + 14 + 2 * 256
    assert overhead["repetitions"] == 3
    assert 0 < overhead["bare_allreduce_ms"] and 0 < overhead["flodl_round_ms"]
    assert result["overhead_ratio"] == overhead["overhead_ratio"] > 0
    hetero = result["heterogeneous_throughput"]
    (pair,) = hetero["runs"]
    # One epoch of the 1438 digits training samples, 2 ranks x 32: flodl trains every one (its
    # last batch short), DDP's sampler drops the tail (1408); the pair compares samples/s.
    assert (pair["flodl"]["samples"], pair["ddp"]["samples"]) == (1438, 1408)
    per_rank = pair["flodl"]["per_rank"]
    assert sum(r["batches"] for r in per_rank) == -(-1438 // 32)  # 45, the last of 30 samples
    assert all(r["syncs"] >= 1 for r in per_rank)
    assert 0.0 <= result["fast_rank_idle_share"] <= 1.0
    assert result["speedup_vs_ddp"] == pytest.approx(
        pair["flodl"]["samples_per_s"] / pair["ddp"]["samples_per_s"], rel=1e-2
    )
    for side in ("flodl", "ddp"):
        assert 0.0 <= pair[side]["test_accuracy"] <= 1.0
    assert set(result["targets"]) >= {
        "overhead_ok",
        "speedup_ok",
        "idle_ok",
        "accuracy_ok",
        "goodput_ok",
    }
    # The ceiling: both ranks trained, no communication, a segment before flodl and one after.
    ceiling = pair["ceiling"]
    assert len(ceiling["per_rank_samples"]) == 2 and all(n > 0 for n in ceiling["per_rank_samples"])
    assert ceiling["samples"] == sum(ceiling["per_rank_samples"])
    assert len(ceiling["segment_samples_per_s"]) == len(ceiling["segment_window_s"]) == 2
    assert ceiling["window_s"] == pytest.approx(sum(ceiling["segment_window_s"]), abs=0.01)
    assert 0.0 <= ceiling["test_accuracy_mean"] <= 1.0
    assert result["goodput_vs_ceiling"] == pytest.approx(
        pair["flodl"]["samples_per_s"] / ceiling["samples_per_s"], rel=1e-2
    )
    assert 0.0 <= result["load_average_1m"]
    table = result["goodput_table"]
    assert [(row["nproc"], row["skew"]) for row in table] == [(2, 1.0), (2, 2.5)]
    for row in table:
        assert row["goodput_vs_ceiling"] == pytest.approx(
            row["flodl_samples_per_s"] / row["ceiling_samples_per_s"], rel=1e-2
        )
        assert 0.0 <= row["flodl_test_accuracy"] <= 1.0
    assert "ddp_samples_per_s" not in table[0]  # DDP runs in the throughput row only
    assert table[1]["ddp_samples_per_s"] == pair["ddp"]["samples_per_s"]
    assert table[1]["goodput_vs_ceiling"] == pair["goodput_vs_ceiling"]
