"""Checks of bench/dashboard_bench.py's parts, so the benchmark keeps working: its polling
client against a real dashboard, the event log's cost measurement on a short scripted run, and
reading round times from an event log. The figures mean nothing here."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from flodl.observe.dashboard import serve
from flodl.observe.hub import open_observer
from flodl.testing import RankScript, open_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import dashboard_bench


async def test_the_client_polls_a_dashboard_like_the_page(tmp_path: Path) -> None:
    scripts = [RankScript(ms_per_batch=3.0)] * 2
    async with open_cluster(scripts, dataset_size=200_000, url="tcp://127.0.0.1:0") as cluster:
        async with open_observer(cluster.coordinator, tmp_path) as observer:
            async with trio.open_nursery() as nursery:
                url = await nursery.start(serve, observer, "127.0.0.1", 0, None)
                port = urlsplit(url).port
                assert port is not None
                stats: dict[str, Any] = {"polls": 0, "errors": 0, "latency_s": []}
                with trio.move_on_after(1.0):
                    await dashboard_bench._client(port, 0.05, stats)
                nursery.cancel_scope.cancel()
    assert stats["errors"] == 0
    assert stats["polls"] >= 5
    assert len(stats["latency_s"]) == stats["polls"]


def test_the_event_log_cost_is_measured_per_round() -> None:
    alone, with_dashboard = dashboard_bench.event_log_cost(3000)
    for cost in (alone, with_dashboard):
        assert cost["rounds"] > 0 and cost["records"] > cost["rounds"]
        assert cost["observer_take_us_per_round"] >= cost["event_log_offer_us_per_round"] > 0
    assert not alone["dashboard_listeners"] and with_dashboard["dashboard_listeners"]


def test_round_times_leave_out_the_first_round_and_redos(tmp_path: Path) -> None:
    records = [
        {"kind": "SyncEnd", "round": 1, "duration_s": 2.0},
        {"kind": "SyncStart", "round": 2},
        {"kind": "SyncEnd", "round": 2, "duration_s": 0.01},
        {"kind": "SyncEnd", "round": 3, "duration_s": 0.5, "redo": True},
        {"kind": "SyncEnd", "round": 4, "duration_s": 0.02},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert dashboard_bench.round_times(tmp_path) == [0.01, 0.02]


def test_process_cpu_is_read_from_proc() -> None:
    cpu = dashboard_bench.process_cpu_s(os.getpid())
    assert cpu is not None and cpu > 0
    assert dashboard_bench.process_cpu_s(2**22 + 12345) is None
