"""Batches: several Batch reports in one frame (a rank that coalesces its reports)."""

from __future__ import annotations

import math

import cbor2
import pytest

from flodl.errors import MessageValidationError
from flodl.wire.codec import EncodedMessage, FrameDecoder, FrameEncoder
from flodl.wire.messages import TO_COORDINATOR_TAGS, TO_RANK_TAGS, Batch, Batches, from_payload

KEY = b"batches-test-key-0123456789abcdef"


def good() -> dict[str, object]:
    return {
        "rank": 3,
        "step_count": 12,
        "batch_ms": [10.5, 11],
        "data_ms": [0.0, 0.25],
        "batch_loss": [0.5, math.nan],
    }


def test_round_trips_through_a_frame() -> None:
    sent = Batches(3, 12, (10.5, 11.0), (0.0, 0.25), (0.5, -0.0))
    decoder = FrameDecoder(KEY, allowed_tags=TO_COORDINATOR_TAGS)
    decoder.feed(FrameEncoder(KEY).encode(sent))
    assert list(decoder) == [sent]


def test_reports_are_the_batch_reports_in_order_with_their_step_counts() -> None:
    batches = from_payload(Batches.TAG, good(), TO_COORDINATOR_TAGS)
    assert isinstance(batches, Batches)
    first, second = batches.reports()
    assert first == Batch(rank=3, batch_ms=10.5, data_ms=0.0, step_count=11, batch_loss=0.5)
    assert (second.rank, second.batch_ms, second.data_ms, second.step_count) == (3, 11.0, 0.25, 12)
    assert math.isnan(second.batch_loss)


def test_goes_from_rank_to_coordinator_only() -> None:
    assert Batches.TAG in TO_COORDINATOR_TAGS and Batches.TAG not in TO_RANK_TAGS


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"batch_ms": [], "data_ms": [], "batch_loss": []}, "at least one batch"),
        ({"data_ms": [0.0]}, "equal length"),
        ({"batch_loss": [0.5, 0.5, 0.5]}, "equal length"),
        ({"step_count": 1}, "at least the 2 batches"),
        ({"batch_ms": [10.5, -1.0]}, "finite floats >= 0"),
        ({"data_ms": [0.0, math.inf]}, "finite floats >= 0"),
        ({"batch_ms": [10.5, True]}, "finite floats >= 0"),
        ({"batch_loss": [0.5, "x"]}, "a list of floats"),
        ({"batch_ms": {"a": 1.0}}, "durations"),
        ({"step_count": -1}, "an integer"),
    ],
)
def test_bad_payloads_raise_a_typed_error_naming_the_field(
    change: dict[str, object], says: str
) -> None:
    with pytest.raises(MessageValidationError, match=says):
        from_payload(Batches.TAG, {**good(), **change}, TO_COORDINATOR_TAGS)


def test_a_forged_frame_is_rejected_by_the_decoder_with_the_same_error() -> None:
    # A valid message's tag around a forged payload: lists of different lengths.
    tagged = Batches(3, 12, (10.5, 11.0), (0.0, 0.25), (0.5, 0.5))
    forged = EncodedMessage(tagged, cbor2.dumps({**good(), "data_ms": [0.0]}))
    decoder = FrameDecoder(KEY, allowed_tags=TO_COORDINATOR_TAGS)
    decoder.feed(FrameEncoder(KEY).encode(forged))
    with pytest.raises(MessageValidationError, match="equal length"):
        list(decoder)
