"""``flodl report --tensorboard DIR``: the scalars read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flodl.cli import main
from flodl.errors import ConfigError
from flodl.observe.tensorboard import export_tensorboard
from tests.observe.sample_log import UNIX0, records, write_log


def read_back(out: Path) -> dict[str, list[tuple[int, float, float]]]:
    """tag -> [(step, value, wall time)] of every scalar in ``out``."""
    accumulator = EventAccumulator(str(out))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value, e.wall_time) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_every_round_rank_and_epoch_becomes_a_scalar(tmp_path: Path) -> None:
    write_log(tmp_path / "run", records(death=True))
    written = export_tensorboard(tmp_path / "run", tmp_path / "tb")
    scalars = read_back(tmp_path / "tb")
    assert sum(len(points) for points in scalars.values()) == written
    per_rank = ("samples_per_s", "idle_share", "averaging_ms", "divergence", "batches")
    expected = {f"{key}/rank{r}" for key in per_rank for r in (0, 1, 2)}
    assert set(scalars) == expected | {"round/duration_ms", "epoch/avg_loss"}
    # Rounds 1, 2, 4 (redone after rank 2 died in round 3) and 5; the step is the round.
    durations = scalars["round/duration_ms"]
    assert [step for step, _, _ in durations] == [1, 2, 4, 5]
    assert [value for _, value, _ in durations] == pytest.approx([500.0, 40.0, 60.0, 10.0])
    wall = [UNIX0 + t for t in (1.5, 2.04, 2.86, 3.31)]
    assert [unix for _, _, unix in durations] == pytest.approx(wall)
    # Rank 2 was in rounds 1 and 2 only; round 1 trained nothing (no rate, no idle share).
    assert [(s, v) for s, v, _ in scalars["batches/rank2"]] == [(1, 0.0), (2, 5.0)]
    assert [(s, v) for s, v, _ in scalars["samples_per_s/rank2"]] == [(2, 2000.0)]
    assert [s for s, _, _ in scalars["samples_per_s/rank0"]] == [2, 4, 5]
    # Idle over the window: rank 0 idled 100 ms of round 2's 500 ms window.
    step, share, _ = scalars["idle_share/rank0"][0]
    assert step == 2 and share == pytest.approx(0.2)
    divergences = scalars["divergence/rank1"]
    assert [s for s, _, _ in divergences] == [1, 2, 4, 5]
    assert [v for _, v, _ in divergences] == pytest.approx([0.0, 0.25, 0.1, 0.05])
    assert [(s, v) for s, v, _ in scalars["epoch/avg_loss"]] == [(0, 1.5), (1, 0.5)]


def test_values_a_record_lacks_are_left_out(tmp_path: Path) -> None:
    write_log(tmp_path / "run", records(death=False, divergence=False))
    export_tensorboard(tmp_path / "run", tmp_path / "tb")
    scalars = read_back(tmp_path / "tb")
    assert not [tag for tag in scalars if tag.startswith("divergence/")]
    assert [s for s, _, _ in scalars["round/duration_ms"]] == [1, 2, 3]


def test_a_missing_event_log_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no event log at"):
        export_tensorboard(tmp_path, tmp_path / "tb")
    assert not (tmp_path / "tb").exists()


def test_flodl_report_writes_both(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(tmp_path / "run", records(death=False))
    assert main(["report", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")]) == 0
    out = capsys.readouterr().out
    written = sum(len(points) for points in read_back(tmp_path / "tb").values())
    assert f"tensorboard: {written} scalars in {tmp_path / 'tb'}" in out
    assert f"report: {tmp_path / 'run' / 'report' / 'index.html'}" in out
