"""Death records: file name, content, and how a bundle load reports them."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from flodl.checkpoint import read_death_records, write_death_record
from flodl.errors import CheckpointError


def test_record_content_and_name(tmp_path: Path) -> None:
    before = time.time()
    path = write_death_record(
        tmp_path, "flodl-step000000042", rank=2, world_size=4, error="heartbeat lost after 30 s"
    )
    after = time.time()
    assert path == tmp_path / "flodl-step000000042.rank2.death.json"
    record = json.loads(path.read_text())
    assert set(record) == {"rank", "world_size", "error", "unix_time_secs"}
    assert (record["rank"], record["world_size"]) == (2, 4)
    assert record["error"] == "heartbeat lost after 30 s"
    assert before <= record["unix_time_secs"] <= after


def test_records_are_read_back_by_rank(tmp_path: Path) -> None:
    write_death_record(tmp_path, "s", rank=3, world_size=4, error="exit code 137")
    write_death_record(tmp_path, "s", rank=1, world_size=4, error="connection reset")
    write_death_record(tmp_path, "other", rank=0, world_size=4, error="not this bundle")
    records = read_death_records(tmp_path, "s")
    assert [(r.rank, r.error) for r in records] == [(1, "connection reset"), (3, "exit code 137")]
    assert read_death_records(tmp_path, "none-here") == ()


def test_bad_records_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"rank must be in \[0, 2\)"):
        write_death_record(tmp_path, "s", rank=2, world_size=2, error="x")
    with pytest.raises(CheckpointError, match="stem"):
        write_death_record(tmp_path, "../escape", rank=0, world_size=2, error="x")
    (tmp_path / "s.rank1.death.json").write_text('{"rank": 0, "world_size": 2, "error": "x", ')
    with pytest.raises(CheckpointError, match="unreadable"):
        read_death_records(tmp_path, "s")
    (tmp_path / "s.rank1.death.json").write_text(
        '{"rank": 0, "world_size": 2, "error": "x", "unix_time_secs": 1.0}'
    )
    with pytest.raises(CheckpointError, match="names rank 0"):
        read_death_records(tmp_path, "s")
