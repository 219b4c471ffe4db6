"""Every message survives encode -> decode, however the bytes are split on the way."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.wire.codec import FrameDecoder, FrameEncoder
from flodl.wire.messages import (
    ALL_MESSAGES,
    FROM_AGENT,
    FROM_AGENT_TAGS,
    TO_AGENT,
    TO_AGENT_TAGS,
    TO_COORDINATOR,
    TO_COORDINATOR_TAGS,
    TO_RANK,
    TO_RANK_TAGS,
    Batch,
    Message,
)
from tests.wire.strategies import any_message, message_strategy, same_message, same_value

KEY = b"round-trip-test-key-0123456789ab"


def decode_in_pieces(
    data: bytes, cuts: list[int], allowed: frozenset[int] | None = None
) -> list[Message]:
    """Feed ``data`` to a fresh decoder cut at ``cuts``; every message it yields."""
    decoder = FrameDecoder(KEY, allowed_tags=allowed)
    out: list[Message] = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        decoder.feed(data[start:cut])
        start = cut
        out.extend(decoder)
        assert decoder.buffered <= len(data)
    decoder.end_of_stream()  # raises TruncatedFrame if anything were left over
    return out


DIRECTIONS = (
    (TO_RANK, TO_RANK_TAGS),
    (TO_COORDINATOR, TO_COORDINATOR_TAGS),
    (FROM_AGENT, FROM_AGENT_TAGS),
    (TO_AGENT, TO_AGENT_TAGS),
)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_every_class_round_trips_in_arbitrary_splits(
    cls: type[Message], data: st.DataObject
) -> None:
    messages = data.draw(st.lists(message_strategy(cls), min_size=1, max_size=4))
    encoder = FrameEncoder(KEY)
    wire = b"".join(encoder.encode(m) for m in messages)
    cuts = data.draw(st.lists(st.integers(0, len(wire)), max_size=12))
    allowed = next(tags for group, tags in DIRECTIONS if cls in group)
    decoded = decode_in_pieces(wire, cuts, allowed)
    assert len(decoded) == len(messages)
    for sent, got in zip(messages, decoded, strict=True):
        assert same_message(sent, got), (sent, got)


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(any_message, min_size=1, max_size=8), data=st.data())
def test_mixed_stream_round_trips_byte_by_byte_or_in_chunks(
    messages: list[Message], data: st.DataObject
) -> None:
    encoder = FrameEncoder(KEY)
    wire = b"".join(encoder.encode(m) for m in messages)
    step = data.draw(st.integers(1, 97))
    decoded = decode_in_pieces(wire, list(range(step, len(wire), step)))
    assert [type(m) for m in decoded] == [type(m) for m in messages]
    assert all(same_message(a, b) for a, b in zip(messages, decoded, strict=True))


def test_nan_and_signed_zero_losses_survive() -> None:
    sent = Batch(
        rank=2,
        batch_ms=1.5,
        data_ms=0.0,
        step_count=7,
        batch_loss=math.nan,
        param_norm=-0.0,
        sync_divergence=math.inf,
    )
    (got,) = decode_in_pieces(FrameEncoder(KEY).encode(sent), [3, 40])
    assert isinstance(got, Batch)
    assert math.isnan(got.batch_loss)
    assert got.param_norm == 0.0 and math.copysign(1.0, got.param_norm) == -1.0
    assert got.sync_divergence == math.inf
    assert got.rank == 2 and got.step_count == 7


def test_same_value_is_nan_aware_and_strict() -> None:
    assert same_value(math.nan, math.nan)
    assert not same_value(math.nan, 1.0)
    assert not same_value(0.0, -0.0)
    assert not same_value(1, 1.0)
    assert same_value((1.0, math.nan), (1.0, math.nan))
