"""map_exceptions: one table per backend turns library errors into flodl's, and nothing else."""

from __future__ import annotations

import pytest
import trio

from flodl.errors import BrokenChannel, ConfigError, TransportError
from flodl.transports.errors import SOCKET_ERRORS, STREAM_ERRORS, map_exceptions


def test_a_mapped_error_is_replaced_with_the_context_and_the_cause_kept() -> None:
    original = trio.BrokenResourceError("peer reset")
    with pytest.raises(BrokenChannel, match=r"^cannot send SyncNow: peer reset$") as caught:
        with map_exceptions(STREAM_ERRORS, "cannot send SyncNow"):
            raise original
    assert caught.value.__cause__ is original


def test_an_error_without_text_is_named_by_its_repr() -> None:
    with pytest.raises(BrokenChannel, match=r"^receiving: ClosedResourceError\(\)$"):
        with map_exceptions(STREAM_ERRORS, "receiving"):
            raise trio.ClosedResourceError


def test_subclasses_match_their_table_entry() -> None:
    with pytest.raises(TransportError, match=r"^cannot connect to tcp://h:1: refused$"):
        with map_exceptions(SOCKET_ERRORS, "cannot connect to tcp://h:1"):
            raise ConnectionRefusedError("refused")


def test_other_errors_pass_through_unchanged() -> None:
    ours = ConfigError("not a stream error")
    with pytest.raises(ConfigError) as caught:
        with map_exceptions(STREAM_ERRORS, "anything"):
            raise ours
    assert caught.value is ours
    with pytest.raises(KeyboardInterrupt):
        with map_exceptions({BaseException: TransportError}, "anything"):  # type: ignore[dict-item]
            raise KeyboardInterrupt


def test_a_context_function_runs_only_when_an_error_is_mapped() -> None:
    calls: list[int] = []

    def context() -> str:
        calls.append(1)
        return "late"

    with map_exceptions(STREAM_ERRORS, context):
        pass
    assert calls == []
    with pytest.raises(BrokenChannel, match=r"^late: x$"):
        with map_exceptions(STREAM_ERRORS, context):
            raise trio.BrokenResourceError("x")
    assert calls == [1]


def test_one_instance_can_be_entered_again() -> None:
    mapping = map_exceptions(STREAM_ERRORS, "again")
    for _ in range(2):
        with pytest.raises(BrokenChannel):
            with mapping:
                raise trio.BrokenResourceError("x")
    with mapping:
        pass
