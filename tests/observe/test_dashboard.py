"""The dashboard over real sockets: a real coordinator with scripted ranks on 127.0.0.1, the
dashboard on port 0, and raw HTTP/1.1 requests written by hand (no client library that would
forgive a wrong answer). Real time throughout: the clients' sockets are real."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from flodl.errors import ConfigError
from flodl.observe.dashboard import IDLE_TIMEOUT_S, serve
from flodl.observe.hub import Observer, open_observer
from flodl.observe.view_config import ViewConfig
from flodl.testing import Cluster, RankScript, open_cluster

TOKEN = "s3cret-token-0123456789"
ROUTES = ("/", "/api/state", "/api/events?since=0", "/metrics")


@attrs.frozen
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.frozen
class Served:
    cluster: Cluster
    observer: Observer
    port: int

    async def get(self, target: str, **headers: str) -> Reply:
        return await request(self.port, "GET", target, headers)


async def read_all(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes (a reset counts as closing)."""
    data = bytearray()
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            break
        if not chunk:
            break
        data += chunk
    return bytes(data)


def parse(raw: bytes) -> Reply:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Reply(status, headers, body)


async def request(
    port: int, method: str, target: str, headers: dict[str, str] | None = None
) -> Reply:
    """One request on a fresh connection (``Connection: close``), the whole reply."""
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
            return parse(await read_all(stream))


async def wait_until(observer: Observer, done: Callable[[], bool], limit: float = 20.0) -> None:
    with trio.fail_after(limit):
        while not done():
            await observer.wait_for_news()


@asynccontextmanager
async def dashboard(
    tmp_path: Path, token: str | None = None, scripts: list[RankScript] | None = None
) -> AsyncIterator[Served]:
    """Three scripted ranks over tcp (long enough a run to outlast the test), observed, and the
    dashboard on 127.0.0.1:0; once every rank trained in a settled round."""
    scripts = scripts or [RankScript(ms_per_batch=ms) for ms in (4.0, 6.0, 9.0)]
    async with open_cluster(
        scripts, dataset_size=400_000, batch_size=10, url="tcp://127.0.0.1:0"
    ) as cluster:
        async with open_observer(cluster.coordinator, tmp_path) as observer:
            async with trio.open_nursery() as nursery:
                url = await nursery.start(serve, observer, "127.0.0.1", 0, token)
                parts = urlsplit(url)
                assert parts.hostname == "127.0.0.1" and url.endswith("/")
                assert parts.port is not None and parts.port > 0
                rows = observer.view.ranks.values()
                await wait_until(observer, lambda: all(row.batches for row in rows))
                await wait_until(observer, lambda: observer.view.round >= 3)
                yield Served(cluster, observer, parts.port)
                nursery.cancel_scope.cancel()


async def test_state_lists_every_rank(tmp_path: Path) -> None:
    async with dashboard(tmp_path) as served:
        reply = await served.get("/api/state")
        assert reply.status == 200
        assert reply.headers["content-type"] == "application/json"
        state = reply.json()
    assert state["status"] == "training"
    assert state["round"] >= 1
    assert [row["rank"] for row in state["ranks"]] == [0, 1, 2]
    for row in state["ranks"]:
        assert row["state"] == "training"
        assert row["batches"] > 0
        assert row["heartbeat_age_s"] is not None
        for key in ("samples_per_s", "window_batches", "idle_share", "averaging_share"):
            assert key in row


async def test_the_page_is_served_self_contained(tmp_path: Path) -> None:
    async with dashboard(tmp_path) as served:
        reply = await served.get("/")
        head = await request(served.port, "HEAD", "/")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/html")
    page = reply.body.decode()
    assert "/api/state" in page and "/api/events" in page
    # Nothing fetched from elsewhere: no external script, style or font.
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page
    policy = reply.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'sha256-" in policy
    assert head.status == 200 and head.body == b""
    assert head.headers["content-length"] == str(len(reply.body))


async def test_events_paginate(tmp_path: Path) -> None:
    async with dashboard(tmp_path) as served:
        first = (await served.get("/api/events?since=0&limit=5")).json()
        assert [e["seq"] for e in first["events"]] == [0, 1, 2, 3, 4]
        assert first["next"] == 5
        second = (await served.get(f"/api/events?since={first['next']}&limit=5")).json()
        assert [e["seq"] for e in second["events"]] == [5, 6, 7, 8, 9]
        everything = (await served.get("/api/events?since=0")).json()
        kinds = {e["kind"] for e in everything["events"]}
        assert {"RankJoined", "TrainingStarted", "SyncStart", "SyncEnd"} <= kinds
        assert everything["next"] == len(everything["events"])
        tail = (await served.get(f"/api/events?since={everything['next']}")).json()
        assert all(e["seq"] >= everything["next"] for e in tail["events"])
        assert tail["next"] == everything["next"] + len(tail["events"])
        bad = await served.get("/api/events?since=minus-one")
    assert bad.status == 400


def families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def by_rank(family: Any) -> dict[str, float]:
    return {s.labels["rank"]: s.value for s in family.samples if "rank" in s.labels}


async def test_metrics_parse_and_cover_the_run(tmp_path: Path) -> None:
    async with dashboard(tmp_path) as served:
        reply = await served.get("/metrics")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    found = families(reply.body.decode())
    gauges = (
        "flodl_rank_samples_per_second",
        "flodl_rank_idle_ratio",
        "flodl_rank_heartbeat_age_seconds",
        "flodl_rank_last_step_age_seconds",
    )
    for name in gauges:
        assert found[name].type == "gauge", name
        assert set(by_rank(found[name])) == {"0", "1", "2"}, name
    assert all(age < 5.0 for age in by_rank(found["flodl_rank_last_step_age_seconds"]).values())
    counters = ("rounds", "deaths", "regroups", "saves", "redo_rounds")
    for name in counters:
        assert found[f"flodl_{name}"].type == "counter", name
    rounds = [s.value for s in found["flodl_rounds"].samples if s.name == "flodl_rounds_total"]
    assert rounds[0] >= 1
    for name in ("flodl_averaging_round_seconds", "flodl_recovery_seconds"):
        assert found[name].type == "histogram", name
    count = [
        s.value for s in found["flodl_averaging_round_seconds"].samples if s.name.endswith("_count")
    ]
    assert count == rounds
    assert found["flodl_round"].samples[0].value >= 1
    # The coordinator's own process: its trio tasks (the dashboard's and the cluster's among
    # them) and what prometheus-client's process collector reads from /proc.
    assert found["flodl_coordinator_tasks"].samples[0].value >= 2
    assert found["process_open_fds"].samples[0].value >= 3
    assert found["process_resident_memory_bytes"].samples[0].value > 10e6


async def test_a_death_is_counted_with_its_recovery(tmp_path: Path) -> None:
    scripts = [RankScript(ms_per_batch=4.0), RankScript(ms_per_batch=6.0)]
    scripts.append(RankScript(ms_per_batch=9.0, die_after_batches=40))
    async with dashboard(tmp_path, scripts=scripts) as served:
        view = served.observer.view
        await wait_until(served.observer, lambda: view.ranks[2].state == "dead")
        await wait_until(
            served.observer,
            lambda: any(r["kind"] == "GroupReformed" for r in served.observer.history),
        )
        found = families((await served.get("/metrics")).body.decode())
        state = (await served.get("/api/state")).json()

    def total(name: str) -> float:
        return float(next(s.value for s in found[name].samples if s.name.endswith("_total")))

    assert total("flodl_deaths") == 1
    assert total("flodl_regroups") == 1
    recovery = next(s for s in found["flodl_recovery_seconds"].samples if s.name.endswith("_count"))
    assert recovery.value == 1
    assert by_rank(found["flodl_rank_up"]) == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert "2" not in by_rank(found["flodl_rank_heartbeat_age_seconds"])
    assert state["ranks"][2]["state"] == "dead"
    assert any("rank 2 dead" in line for line in state["recent"])


def test_beyond_loopback_needs_a_token_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token"):
        ViewConfig(dashboard=("0.0.0.0", 0))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert ViewConfig(dashboard=("0.0.0.0", 0), dashboard_token_file=token_file).token() == TOKEN


async def test_with_a_token_every_route_wants_it(tmp_path: Path) -> None:
    async with dashboard(tmp_path, token=TOKEN) as served:
        for route in ROUTES:
            bare = await served.get(route)
            assert bare.status == 401, route
            assert bare.headers["www-authenticate"] == "Bearer"
            assert b"round" not in bare.body
            wrong = await served.get(route, Authorization="Bearer " + TOKEN[:-1] + "x")
            assert wrong.status == 401, route
            header = await served.get(route, Authorization="Bearer " + TOKEN)
            assert header.status == 200, route
            joiner = "&" if "?" in route else "?"
            query = await served.get(f"{route}{joiner}token={TOKEN}")
            assert query.status == 200, route
        page = (await served.get(f"/?token={TOKEN}")).body.decode()
    # The page passes the token on to its own API calls.
    assert "Authorization" in page and "Bearer" in page


async def test_read_only(tmp_path: Path) -> None:
    async with dashboard(tmp_path) as served:
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            for route in ROUTES:
                reply = await request(served.port, method, route, {"Content-Length": "0"})
                assert reply.status == 405, (method, route)
                assert reply.headers["allow"] == "GET, HEAD"
        with_body = await request(served.port, "GET", "/api/state", {"Content-Length": "3"})
        assert with_body.status == 413
        missing = await served.get("/nothing-here")
    assert missing.status == 404


async def test_an_oversized_request_head_is_cut_off(tmp_path: Path) -> None:
    async with dashboard(tmp_path) as served:
        with trio.fail_after(10):
            stream = await trio.open_tcp_stream("127.0.0.1", served.port)
            async with stream:
                head = b"GET /api/state HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 64 * 1024
                try:
                    await stream.send_all(head + b"\r\n\r\n")
                except trio.BrokenResourceError:
                    pass  # closed on us while we were still sending: cut off too
                raw = await read_all(stream)
        # Still serving everyone else.
        assert (await served.get("/api/state")).status == 200
    if raw:
        assert parse(raw).status in (400, 431)


async def test_a_stalled_client_is_disconnected_while_the_run_goes_on(tmp_path: Path) -> None:
    async with dashboard(tmp_path) as served:
        stream = await trio.open_tcp_stream("127.0.0.1", served.port)
        async with stream:
            await stream.send_all(b"GET /api/state HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            round_before = served.observer.view.round
            opened = trio.current_time()
            with trio.fail_after(IDLE_TIMEOUT_S + 5):
                # Another client is answered at once meanwhile.
                assert (await served.get("/api/state")).status == 200
                raw = await read_all(stream)
            waited = trio.current_time() - opened
        assert raw == b""
        assert IDLE_TIMEOUT_S - 0.5 <= waited <= IDLE_TIMEOUT_S + 5
        assert served.observer.view.round > round_before


async def test_a_client_that_never_reads_cannot_hold_up_the_end(tmp_path: Path) -> None:
    async with open_cluster(
        [RankScript(ms_per_batch=3.0)] * 2, dataset_size=400_000, url="tcp://127.0.0.1:0"
    ) as cluster:
        async with open_observer(cluster.coordinator, tmp_path) as observer:
            await wait_until(observer, lambda: observer.view.round >= 3)
            async with trio.open_nursery() as nursery:
                url = await nursery.start(serve, observer, "127.0.0.1", 0, None)
                port = urlsplit(url).port
                assert port is not None
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                # Pipelined requests for answers it never reads: the server's sends block.
                ask = b"GET /api/events?since=0 HTTP/1.1\r\nHost: x\r\n\r\n" * 300
                with trio.move_on_after(2):
                    await stream.send_all(ask)
                await trio.sleep(0.5)
                stopped = trio.current_time()
                nursery.cancel_scope.cancel()
            assert trio.current_time() - stopped < 1.0
            await stream.aclose()


def test_importing_flodl_does_not_import_the_servers_libraries() -> None:
    code = (
        "import sys, flodl, flodl.launch.launcher, flodl.cli, flodl.observe.views; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('hypercorn', 'prometheus_client', 'h11', 'h2')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


async def test_an_address_in_use_is_a_config_error(tmp_path: Path) -> None:
    async with dashboard(tmp_path) as served:
        with pytest.raises(
            ConfigError, match=f"--dashboard 127.0.0.1:{served.port}: cannot listen"
        ):
            await serve(served.observer, "127.0.0.1", served.port, None)


async def test_the_request_budget_bounds_the_rate_over_all_clients(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from flodl.observe.budget import RequestBudget

    budget = RequestBudget(rate=20.0, burst=40)
    start = trio.current_time()
    served: list[float] = []

    async def client() -> None:
        for _ in range(10):
            await budget.take()
            served.append(trio.current_time() - start)

    async with trio.open_nursery() as nursery:
        for _ in range(10):  # 100 requests at once
            nursery.start_soon(client)
    assert len(served) == 100
    assert sum(1 for t in served if t == 0.0) == 40  # the burst
    assert max(served) == pytest.approx((100 - 40) / 20.0)  # then 20 a second
    # A cancelled wait gives its turn back: the next one waits 0.04 s (a turn less the
    # 0.01 s the cancelled one waited), not 0.09 s.
    with trio.move_on_after(0.01):
        await budget.take()
    before = trio.current_time()
    await budget.take()
    assert trio.current_time() - before == pytest.approx(0.04, abs=1e-6)
