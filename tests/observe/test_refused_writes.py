"""A run folder whose writes fail (a full disk, a folder gone) never stops the run: the event
log drops what it cannot write, says so once, keeps whole lines only and writes again once it
can; a rank's log the same, and the rank's output goes on being read. Real files: the folder
is missing for a while, which fails every write as a full disk does."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from flodl.core.coordinator.timeline import EventKind, TimelineEvent
from flodl.host.appender import Appender
from flodl.observe.events import EventLog, read_events
from flodl.supervise.ranks import relay_output


async def test_the_event_log_drops_what_it_cannot_write_and_the_run_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = EventLog(tmp_path / "gone" / "events.jsonl", (0.0, 1000.0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.run)
        log.offer(0, TimelineEvent(1.0, EventKind.SYNC_START, {"round": 1}))
        log.offer(1, TimelineEvent(2.0, EventKind.SYNC_END, {"round": 1}))
        log.close()
    assert (log.written, log.dropped) == (0, 2) and log.finished.is_set()
    assert capsys.readouterr().out.count("cannot be written") == 1


def test_an_appender_writes_again_once_it_can(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "gone"
    appender = Appender(folder / "events.jsonl", "the event log")
    assert not appender.append(b'{"kind": "SyncStart", "seq": 0}\n')
    assert not appender.append(b'{"kind": "SyncEnd", "seq": 1}\n')
    folder.mkdir()  # the disk takes writes again
    assert appender.append(b'{"kind": "SyncStart", "seq": 2}\n')
    appender.close()
    assert read_events(folder / "events.jsonl") == [{"kind": "SyncStart", "seq": 2}]
    assert capsys.readouterr().out.count("cannot be written") == 1  # once, not per write


async def test_a_ranks_output_is_read_to_the_end_whatever_its_log_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "gone"
    send, receive = trio.testing.memory_stream_one_way_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay_output, 3, receive, True, folder / "rank3.log")
        await send.send_all(b"first line\n")
        await trio.testing.wait_all_tasks_blocked()
        folder.mkdir()
        await send.send_all(b"second line\n")
        await trio.testing.wait_all_tasks_blocked()
        await send.aclose()
    assert (folder / "rank3.log").read_bytes() == b"second line\n"
    said = capsys.readouterr().out
    assert "[rank 3] first line" in said and "[rank 3] second line" in said
    assert said.count("rank 3's log") == 1
