"""Field validators and converters shared by the message classes.

Each helper returns an attrs field whose validator rejects values a peer could forge: bools
posing as ints, ints outside ``u64``, non-finite timings, oversized strings or blobs. A bad value
raises :class:`~flodl.errors.MessageValidationError` naming the field.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from flodl.errors import MessageValidationError

U64_MAX = (1 << 64) - 1
MAX_TEXT = 4096
MAX_BLOB = 1 << 20
MAX_ITEMS = 1 << 16

E = TypeVar("E", bound=enum.IntEnum)


def _fail(attribute: attrs.Attribute[Any], expected: str, value: object) -> MessageValidationError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return MessageValidationError(
        f"field {attribute.name!r}: expected {expected}, got {type(value).__name__} {shown}"
    )


def _u64(value: Any, field: attrs.Attribute[Any]) -> int:
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise _fail(field, "an integer in [0, 2**64)", value)
    return value


def _i64(value: Any, field: attrs.Attribute[Any]) -> int:
    if type(value) is not int or not -(1 << 63) <= value < (1 << 63):
        raise _fail(field, "a 64-bit signed integer", value)
    return value


def _float(value: Any, field: attrs.Attribute[Any]) -> float:
    # CBOR peers may send a whole number as an int; bools are never numbers here.
    kind = type(value)
    if kind is float:
        return value  # type: ignore[no-any-return]
    if kind is int:
        return float(value)
    raise _fail(field, "a float", value)


def _duration(value: Any, field: attrs.Attribute[Any]) -> float:
    kind = type(value)
    if kind is int:
        value = float(value)
    elif kind is not float:
        raise _fail(field, "a finite float >= 0", value)
    if not (value >= 0.0 and math.isfinite(value)):
        raise _fail(field, "a finite float >= 0", value)
    return value  # type: ignore[no-any-return]


def _opt_float(value: Any, field: attrs.Attribute[Any]) -> float | None:
    if value is None:
        return None
    return _float(value, field)


def _text(value: Any, field: attrs.Attribute[Any]) -> str:
    if type(value) is not str or len(value) > MAX_TEXT:
        raise _fail(field, f"a string of at most {MAX_TEXT} characters", value)
    return value


def _opt_text(value: Any, field: attrs.Attribute[Any]) -> str | None:
    return None if value is None else _text(value, field)


def _blob(value: Any, field: attrs.Attribute[Any]) -> bytes:
    if type(value) is not bytes or len(value) > MAX_BLOB:
        raise _fail(field, f"bytes of at most {MAX_BLOB} bytes", value)
    return value


def _bool(value: Any, field: attrs.Attribute[Any]) -> bool:
    if type(value) is not bool:
        raise _fail(field, "true or false", value)
    return value


def _checked(fn: Callable[[Any, attrs.Attribute[Any]], Any]) -> Any:
    # One converter that both converts and validates: half the per-field calls of a
    # converter plus a validator, which matters on the decode hot path.
    return attrs.Converter(fn, takes_field=True)


def u64(default: int | None = None) -> Any:
    """A non-negative integer below 2**64 (bools rejected)."""
    if default is None:
        return attrs.field(converter=_checked(_u64))
    return attrs.field(default=default, converter=_checked(_u64))


def i64() -> Any:
    """A signed 64-bit integer (bools rejected)."""
    return attrs.field(converter=_checked(_i64))


def f64(default: float | None = None) -> Any:
    """Any float, NaN and infinities included (a loss may be NaN); ints are widened.
    ``default``: the value when absent (None: required)."""
    return attrs.field(
        default=attrs.NOTHING if default is None else default, converter=_checked(_float)
    )


def duration_ms() -> Any:
    """A finite, non-negative float (a measured time); ints are widened."""
    return attrs.field(converter=_checked(_duration))


def opt_f64() -> Any:
    """A float or None, defaulting to None."""
    return attrs.field(default=None, converter=_checked(_opt_float))


def text(default: str | None = None) -> Any:
    """A string of bounded length. ``default``: the value when absent (None: required)."""
    return attrs.field(
        default=attrs.NOTHING if default is None else default, converter=_checked(_text)
    )


def boolean() -> Any:
    """True or False (integers rejected)."""
    return attrs.field(converter=_checked(_bool))


def opt_text() -> Any:
    """A bounded string or None, defaulting to None."""
    return attrs.field(default=None, converter=_checked(_opt_text))


def blob(default: bytes | None = None) -> Any:
    """Bytes of bounded length."""
    if default is None:
        return attrs.field(converter=_checked(_blob))
    return attrs.field(default=default, converter=_checked(_blob))


def int_enum(kind: type[E]) -> Any:
    """An IntEnum member; on the wire its integer value. Unknown values are rejected."""

    def convert(value: object) -> object:
        if type(value) is int:
            try:
                return kind(value)
            except ValueError:
                return value
        return value

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind):
            names = ", ".join(f"{m.name}={m.value}" for m in kind)
            raise _fail(attribute, f"one of {kind.__name__} ({names})", value)

    return attrs.field(converter=convert, validator=check)


def _tuple_of(items_ok: Callable[[tuple[Any, ...]], bool], noun: str, each: str) -> Any:
    """A list of at most ``MAX_ITEMS`` items, all of which ``items_ok`` accepts, stored as a
    tuple; refused as "a list of at most N ``noun``" or "a list of ``noun`` ``each``"."""

    def convert(value: object) -> object:
        return tuple(value) if type(value) is list else value

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if type(value) is not tuple or len(value) > MAX_ITEMS:
            raise _fail(attribute, f"a list of at most {MAX_ITEMS} {noun}", value)
        if not items_ok(value):
            raise _fail(attribute, f"a list of {noun} {each}", value)

    return attrs.field(factory=tuple, converter=convert, validator=check)


# The list checks run on every agent frame (a host's messages): whole-list builtins rather
# than a Python call per item. type() is compared exactly, so bool is not an int here.


def _u64s(items: tuple[Any, ...]) -> bool:
    return not items or (
        set(map(type, items)) == {int} and min(items) >= 0 and max(items) <= U64_MAX
    )


def _blobs(items: tuple[Any, ...]) -> bool:
    return not items or (set(map(type, items)) == {bytes} and max(map(len, items)) <= MAX_BLOB)


def u64_list() -> Any:
    """A list of u64 values of bounded length, stored as a tuple."""
    return _tuple_of(_u64s, "integers", "in [0, 2**64)")


def blob_list() -> Any:
    """A list of byte strings, each of at most ``MAX_BLOB`` bytes, stored as a tuple."""
    return _tuple_of(_blobs, "byte strings", f"of at most {MAX_BLOB} bytes")


def _float_tuple(value: object) -> object:
    """A list or tuple as a tuple, its ints widened to floats; anything else as it is (the
    validator then says what is wrong with it)."""
    if type(value) is list or type(value) is tuple:
        return tuple(float(v) if type(v) is int else v for v in value)
    return value


def f64_list() -> Any:
    """A list of floats of bounded length, stored as a tuple; ints are widened."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if type(value) is not tuple or len(value) > MAX_ITEMS:
            raise _fail(attribute, f"a list of at most {MAX_ITEMS} floats", value)
        for item in value:
            if type(item) is not float:
                raise _fail(attribute, "a list of floats", value)

    return attrs.field(factory=tuple, converter=_float_tuple, validator=check)


def duration_list() -> Any:
    """A list of finite, non-negative floats (measured times) of bounded length, stored as a
    tuple; ints are widened."""

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if type(value) is not tuple or len(value) > MAX_ITEMS:
            raise _fail(attribute, f"a list of at most {MAX_ITEMS} durations", value)
        for item in value:
            if type(item) is not float or not (item >= 0.0 and math.isfinite(item)):
                raise _fail(attribute, "a list of finite floats >= 0", value)

    return attrs.field(converter=_float_tuple, validator=check)


def scalar_map() -> Any:
    """A bounded mapping of metric name to float; stored as a sorted tuple of pairs."""

    def convert(value: object) -> object:
        if isinstance(value, dict):
            items = []
            for key, val in value.items():
                items.append((key, float(val) if type(val) is int else val))
            return tuple(sorted(items, key=lambda kv: str(kv[0])))
        return value

    def check(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if type(value) is not tuple or len(value) > 1024:
            raise _fail(attribute, "a map of at most 1024 name -> float entries", value)
        for pair in value:
            if (
                type(pair) is not tuple
                or len(pair) != 2
                or type(pair[0]) is not str
                or len(pair[0]) > 256
                or type(pair[1]) is not float
            ):
                raise _fail(attribute, "a map of name (str) -> float", value)

    return attrs.field(
        factory=tuple, converter=convert, validator=check, metadata={"wire_map": True}
    )
