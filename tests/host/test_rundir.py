"""Run folders: a new one per run, `runs/latest` pointing at it, a folder that holds a run refused
unless resumed or overwritten, overwrite removing flodl's files only, one launcher per folder."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from flodl.errors import ConfigError
from flodl.host.rundir import LOCK_NAME, claim_run_dir, fresh_run_dir, point_latest, run_files
from flodl.launch.config import LaunchConfig
from flodl.launch.summary import _read_json

FLODLS = [
    "summary.json",
    "session.key",
    "rank0.json",
    "rank0.log",
    "rank12.log",
    "flodl.rank1.death.json",
    ".rank0.json.4242.tmp",
    "checkpoints/coordinator.meta.json",
    "checkpoints/rank0/latest.json",
    "checkpoints/rank0/flodl-step000000007.model.safetensors",
    "checkpoints/rank0/flodl-step000000007.optim.safetensors",
    "checkpoints/rank0/flodl-step000000007.optim.json",
    "checkpoints/rank0/flodl-step000000007.config.json",
    "checkpoints/rank0/flodl-step000000007.meta.json",
    "checkpoints/rank0/flodl-step000000007.rank0.death.json",
    "checkpoints/rank0/.flodl-step000000008.meta.json.tmp-4242-0a1b2c3d",
    "checkpoints/rank1/flodl-step000000007.meta.json",
]
THEIRS = [
    "notes.txt",
    "rank0.json.bak",
    "data/rank0.json",
    "chaos/rank0.fault.json",
    "checkpoints/rank0/mine.pt",
    "checkpoints/other/latest.json",
    "checkpoints/summary.json",
]


def populate(root: Path, names: list[str]) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)


def test_a_fresh_run_dir_is_a_new_time_and_id_under_runs(tmp_path: Path) -> None:
    first, second = fresh_run_dir(tmp_path), fresh_run_dir(tmp_path)
    assert first != second and first.parent == tmp_path
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{6}", first.name)
    assert not first.exists()
    assert LaunchConfig(script="x.py").run_dir.parent == Path("runs")


def test_latest_is_a_relative_symlink_moved_to_each_new_run(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    point_latest(first)
    assert first.is_dir() and os.readlink(tmp_path / "latest") == "a"
    point_latest(second)
    assert os.readlink(tmp_path / "latest") == "b" and first.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "latest"]


def test_a_latest_that_is_a_folder_is_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    populate(tmp_path / "latest", ["summary.json"])
    point_latest(tmp_path / "new")
    assert (tmp_path / "latest" / "summary.json").read_text() == "summary.json"
    assert "is not a symlink" in capsys.readouterr().err
    assert (tmp_path / "new").is_dir()


def test_run_files_are_flodls_own_files_only(tmp_path: Path) -> None:
    populate(tmp_path, FLODLS + THEIRS)
    (tmp_path / LOCK_NAME).write_text("1\n")
    assert run_files(tmp_path) == sorted(tmp_path / name for name in FLODLS)


def test_a_folder_holding_a_run_is_refused_naming_resume_and_overwrite(tmp_path: Path) -> None:
    populate(tmp_path, FLODLS + THEIRS)
    with (
        pytest.raises(ConfigError, match=r"already holds a run .* --resume .* --overwrite"),
        claim_run_dir(tmp_path, resume=None, overwrite=False),
    ):
        pass
    assert run_files(tmp_path) == sorted(tmp_path / name for name in FLODLS)
    # Resuming another folder does not say what to do with this one.
    with (
        pytest.raises(ConfigError, match="already holds a run"),
        claim_run_dir(tmp_path, resume=tmp_path / "elsewhere", overwrite=False),
    ):
        pass


def test_an_empty_or_foreign_folder_is_taken_as_it_is(tmp_path: Path) -> None:
    populate(tmp_path, THEIRS)
    with claim_run_dir(tmp_path, resume=None, overwrite=False) as claimed:
        assert claimed == tmp_path
    assert all((tmp_path / name).exists() for name in THEIRS)


def test_resuming_a_folder_goes_on_in_it_with_its_files(tmp_path: Path) -> None:
    populate(tmp_path, FLODLS)
    for resume in (tmp_path, tmp_path / "checkpoints"):
        with claim_run_dir(tmp_path, resume=resume, overwrite=False):
            pass
    assert run_files(tmp_path) == sorted(tmp_path / name for name in FLODLS)


def test_overwrite_removes_flodls_files_and_nothing_else(tmp_path: Path) -> None:
    populate(tmp_path, FLODLS + THEIRS)
    with claim_run_dir(tmp_path, resume=None, overwrite=True):
        assert run_files(tmp_path) == []
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted([*THEIRS, LOCK_NAME])
    assert not (tmp_path / "checkpoints" / "rank1").exists()  # emptied, so removed
    assert (tmp_path / "checkpoints" / "rank0").is_dir()  # still holds mine.pt


def test_overwrite_of_the_run_being_resumed_is_refused(tmp_path: Path) -> None:
    populate(tmp_path, FLODLS)
    with pytest.raises(ConfigError, match="--overwrite would remove the checkpoints --resume"):
        LaunchConfig(script="x.py", run_dir=tmp_path, resume=tmp_path, overwrite=True)
    with (
        pytest.raises(ConfigError, match="--overwrite would remove"),
        claim_run_dir(tmp_path, resume=tmp_path / "checkpoints", overwrite=True),
    ):
        pass
    assert run_files(tmp_path) == sorted(tmp_path / name for name in FLODLS)


def test_a_claimed_folder_is_refused_to_a_second_claim(tmp_path: Path) -> None:
    with claim_run_dir(tmp_path, resume=None, overwrite=False):
        with (
            pytest.raises(ConfigError, match=rf"in use by another flodl run \(pid {os.getpid()}\)"),
            claim_run_dir(tmp_path, resume=None, overwrite=True),
        ):
            pass
    with claim_run_dir(tmp_path, resume=None, overwrite=False):  # released
        pass


def test_a_report_older_than_the_rank_is_not_read(tmp_path: Path) -> None:
    report = tmp_path / "rank0.json"
    report.write_text('{"batches": 999}')
    written = report.stat().st_mtime
    assert _read_json(report, since=written - 1) == {"batches": 999}
    os.utime(report, (written - 3600, written - 3600))
    assert _read_json(report, since=written - 1) == {}


def test_set_aside_takes_the_first_free_number(tmp_path: Path) -> None:
    from flodl.host.rundir import set_aside

    assert set_aside(tmp_path / "rank0.log") is None
    (tmp_path / "rank0.log").write_text("first run")
    assert set_aside(tmp_path / "rank0.log") == tmp_path / "rank0.1.log"
    (tmp_path / "rank0.log").write_text("second run")
    assert set_aside(tmp_path / "rank0.log") == tmp_path / "rank0.2.log"
    assert (tmp_path / "rank0.1.log").read_text() == "first run"
    assert (tmp_path / "rank0.2.log").read_text() == "second run"
    assert not (tmp_path / "rank0.log").exists()
    assert [p.name for p in run_files(tmp_path)] == ["rank0.1.log", "rank0.2.log"]
