"""Hypothesis strategies that build valid instances of every message class.

Built from each class's attrs fields: the field's converter says what range a value may take
(a duration is finite and >= 0, a u64 is below 2**64), the type hint says which enum or
container. A field kind this module does not know fails loudly, so a new message type cannot
slip past the round-trip tests.
"""

from __future__ import annotations

import enum
import math
import typing
from typing import Any

import attrs
from hypothesis import strategies as st

from flodl.wire import fields
from flodl.wire.messages import ALL_MESSAGES, Batches, Message, RanksDown, RanksUp

any_float = st.floats(allow_nan=True, allow_infinity=True)
durations = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False)
texts = st.text(max_size=40)

_BY_CONVERTER: dict[Any, st.SearchStrategy[Any]] = {
    fields._u64: st.integers(0, fields.U64_MAX),
    fields._i64: st.integers(-(1 << 63), (1 << 63) - 1),
    fields._float: any_float,
    fields._duration: durations,
    fields._opt_float: st.none() | any_float,
    fields._text: texts,
    fields._opt_text: st.none() | texts,
    fields._blob: st.binary(max_size=200),
    fields._bool: st.booleans(),
}


def field_strategy(cls: type[Message], field: attrs.Attribute[Any]) -> st.SearchStrategy[Any]:
    """Values a sender may legitimately put in ``cls.field``."""
    hint = typing.get_type_hints(cls)[field.name]
    if field.metadata.get("wire_map"):
        return st.dictionaries(st.text(max_size=20), any_float, max_size=6)
    if isinstance(hint, type) and issubclass(hint, enum.IntEnum):
        return st.sampled_from(list(hint))
    if hint == tuple[float, ...]:
        return st.lists(any_float, max_size=8).map(tuple)
    if hint == tuple[bytes, ...]:
        return st.lists(st.binary(max_size=60), max_size=6).map(tuple)
    if hint == tuple[int, ...]:
        return st.lists(st.integers(0, fields.U64_MAX), max_size=8).map(tuple)
    converter = getattr(field.converter, "converter", field.converter)
    if converter in _BY_CONVERTER:
        return _BY_CONVERTER[converter]
    raise NotImplementedError(f"no strategy for {cls.__name__}.{field.name} ({hint})")


@st.composite
def _batches(draw: st.DrawFn) -> Batches:
    """Valid Batches: 1..8 entries, the three lists of one length, a step count that covers
    them (its fields depend on each other, so the per-field strategies do not fit)."""
    n = draw(st.integers(1, 8))
    return Batches(
        rank=draw(st.integers(0, fields.U64_MAX)),
        step_count=draw(st.integers(n, fields.U64_MAX)),
        batch_ms=tuple(draw(st.lists(durations, min_size=n, max_size=n))),
        data_ms=tuple(draw(st.lists(durations, min_size=n, max_size=n))),
        batch_loss=tuple(draw(st.lists(any_float, min_size=n, max_size=n))),
    )


@st.composite
def _ranks_up(draw: st.DrawFn) -> RanksUp:
    """Valid RanksUp: as many tags as payloads."""
    n = draw(st.integers(0, 6))
    return RanksUp(
        tags=tuple(draw(st.lists(st.integers(0, fields.U64_MAX), min_size=n, max_size=n))),
        payloads=tuple(draw(st.lists(st.binary(max_size=60), min_size=n, max_size=n))),
    )


@st.composite
def _ranks_down(draw: st.DrawFn) -> RanksDown:
    """Valid RanksDown: a tag, a payload and a count of at least one rank per message, the
    counts adding up to the ranks."""
    fanout = tuple(draw(st.lists(st.integers(1, 4), max_size=6)))
    n = len(fanout)
    return RanksDown(
        tags=tuple(draw(st.lists(st.integers(0, fields.U64_MAX), min_size=n, max_size=n))),
        payloads=tuple(draw(st.lists(st.binary(max_size=60), min_size=n, max_size=n))),
        fanout=fanout,
        ranks=tuple(
            draw(
                st.lists(st.integers(0, fields.U64_MAX), min_size=sum(fanout), max_size=sum(fanout))
            )
        ),
    )


def message_strategy(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Valid instances of ``cls``."""
    if cls is Batches:
        return _batches()
    if cls is RanksUp:
        return _ranks_up()
    if cls is RanksDown:
        return _ranks_down()
    kwargs = {f.name: field_strategy(cls, f) for f in attrs.fields(cls)}
    return st.builds(cls, **kwargs)


any_message: st.SearchStrategy[Message] = st.one_of(*(message_strategy(c) for c in ALL_MESSAGES))


def same_value(a: object, b: object) -> bool:
    """Equality where NaN equals NaN (and a float's sign of zero counts)."""
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def same_message(a: Message, b: Message) -> bool:
    """Messages of the same class whose fields are equal, NaN-aware."""
    if type(a) is not type(b):
        return False
    return all(same_value(getattr(a, f.name), getattr(b, f.name)) for f in attrs.fields(type(a)))
