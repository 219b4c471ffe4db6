"""The messages an agent carries its ranks' words in: their lists must agree, or the message
does not exist (a decoded one is as trustworthy as one built here)."""

from __future__ import annotations

import pytest

from flodl.errors import MessageValidationError
from flodl.wire.fields import MAX_BLOB, MAX_ITEMS
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


@pytest.mark.parametrize(
    ("tags", "payloads", "error"),
    [
        ((True,), (b"x",), "field 'tags': expected a list of integers in"),  # a bool is no int
        ((-1,), (b"x",), "field 'tags': expected a list of integers in"),
        ((2**64,), (b"x",), "field 'tags': expected a list of integers in"),
        ((1.0,), (b"x",), "field 'tags': expected a list of integers in"),
        ((1,), ("x",), "field 'payloads': expected a list of byte strings"),
        ((1,), (b"x" * (MAX_BLOB + 1),), "field 'payloads': expected a list of byte strings"),
        ((1,) * (MAX_ITEMS + 1), (b"",) * (MAX_ITEMS + 1), "a list of at most"),
    ],
    ids=["bool", "negative", "too-large", "float", "text", "oversized", "too-many"],
)
def test_a_list_with_one_bad_item_is_refused_whatever_the_others(
    tags: tuple[object, ...], payloads: tuple[object, ...], error: str
) -> None:
    good_tags, good_payloads = (64,) * 3, (b"ok",) * 3
    with pytest.raises(MessageValidationError, match=error):
        RanksUp((*good_tags, *tags), (*good_payloads, *payloads))  # type: ignore[arg-type]
