"""The messages an agent carries its ranks' words in: their lists must agree, or the message
does not exist (a decoded one is as trustworthy as one built here)."""

from __future__ import annotations

import pytest

from flodl.errors import MessageValidationError
from flodl.wire.messages import RanksDown, RanksUp


def test_ranks_up_needs_a_payload_for_every_tag() -> None:
    assert RanksUp((64, 66), (b"a", b"b")).tags == (64, 66)
    with pytest.raises(MessageValidationError, match="expected lists of equal length"):
        RanksUp((64, 66), (b"a",))


def test_ranks_down_hands_each_payload_to_its_own_ranks() -> None:
    down = RanksDown((1, 16), (b"sync", b"abort"), (3, 1), (0, 1, 2, 1))
    assert down.deliveries() == [(1, b"sync", (0, 1, 2)), (16, b"abort", (1,))]
    assert RanksDown((), (), (), ()).deliveries() == []


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        (((1,), (b"x",), (1, 1), (0, 1)), "expected lists of equal length"),
        (((1, 2), (b"x", b"y"), (1, 0), (0,)), "counts of at least 1"),
        (((1,), (b"x",), (2,), (0,)), "adding up to the 1 ranks"),
        (((1,), (b"x",), (1,), (0, 1)), "adding up to the 2 ranks"),
    ],
    ids=["lengths", "zero-fanout", "too-few-ranks", "too-many-ranks"],
)
def test_ranks_down_whose_lists_disagree_is_refused(
    fields: tuple[tuple[int, ...], tuple[bytes, ...], tuple[int, ...], tuple[int, ...]], error: str
) -> None:
    with pytest.raises(MessageValidationError, match=error):
        RanksDown(*fields)
