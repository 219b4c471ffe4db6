"""bench/peers_bench.py without torchft: it says clearly why the torchft side is skipped, and
its pure helpers hold. Runs in well under a second; nothing here starts a process that
trains, and nothing asserts a timing."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import peers_bench


def test_skips_clearly_without_torchft(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)  # find_spec -> None: "not installed"
    reason = peers_bench.peer_unavailable()
    assert reason is not None
    assert "torchft is not installed" in reason
    assert "bench/requirements-peers.txt" in reason
    assert peers_bench.main(["--check"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("peers bench: torchft side skipped: torchft is not installed")


def test_skips_clearly_without_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    real_which = shutil.which
    monkeypatch.setattr(
        "shutil.which", lambda tool: None if tool == "unshare" else real_which(tool)
    )
    reason = peers_bench.peer_unavailable()
    assert reason is not None
    assert "`unshare` is not on PATH" in reason
    assert "loopback-only network namespace" in reason


def test_kill_shares_spread_over_the_window() -> None:
    shares = [peers_bench.kill_share(i, 5) for i in range(5)]
    assert shares == [0.1, 0.3, 0.5, 0.7, 0.9]


def test_flodl_recovery_is_the_first_round_on_a_newer_generation(tmp_path: Path) -> None:
    events = [
        {"kind": "SyncEnd", "unix": 10.0, "generation": 0},
        {"kind": "RankDead", "unix": 10.2},
        {"kind": "SyncEnd", "unix": 10.3, "generation": 0},  # a round of the old group
        {"kind": "SyncEnd", "unix": 10.9, "generation": 1},
        {"kind": "SyncEnd", "unix": 11.5, "generation": 1},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    fault = {"fault_unix": 10.1, "generation_before": 0}
    assert peers_bench.flodl_recovery(tmp_path, fault) == pytest.approx(0.8)
    assert (
        peers_bench.flodl_recovery(tmp_path, {"fault_unix": 12.0, "generation_before": 0}) is None
    )


def test_window_spans_first_batch_to_last_loop_end() -> None:
    reports = [
        {"first_batch_unix": 5.0, "loop_end_unix": 7.0},
        {"first_batch_unix": 4.5, "loop_end_unix": 6.0},
    ]
    assert peers_bench.window(reports) == 2.5
