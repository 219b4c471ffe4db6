"""A message's payload: the CBOR-ready map of its fields, and the message built back from one.

:class:`Payloads` is built once from a catalogue of frozen attrs classes, each with a distinct
``TAG`` (:mod:`flodl.wire.messages` builds the one flodl uses). Building a message back goes
through its constructor, so a decoded message is validated exactly like one built locally;
every way a payload can be wrong raises a typed error naming the message.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import attrs

from flodl.errors import MessageValidationError, UnknownMessage


class Tagged(attrs.AttrsInstance, Protocol):
    """An attrs message class with a stable wire tag."""

    TAG: ClassVar[int]


M = TypeVar("M", bound=Tagged)


class Payloads(Generic[M]):
    """Payloads of the messages of ``catalogue``, found by their tags in :attr:`by_tag`.

    A field whose metadata has ``wire_map`` holds pairs and travels as a map.
    """

    def __init__(self, catalogue: Iterable[type[M]]) -> None:
        classes = tuple(catalogue)
        self.by_tag: dict[int, type[M]] = {cls.TAG: cls for cls in classes}
        if len(self.by_tag) != len(classes):
            raise ValueError("duplicate message tag")
        self._field_names: dict[type[M], tuple[str, ...]] = {
            cls: tuple(f.name for f in attrs.fields(cls)) for cls in classes
        }
        self._getters: dict[type[M], Callable[[M], Any]] = {
            cls: operator.attrgetter(*names) if names else _no_fields
            for cls, names in self._field_names.items()
        }
        self._map_fields: dict[type[M], frozenset[str]] = {
            cls: frozenset(f.name for f in attrs.fields(cls) if f.metadata.get("wire_map"))
            for cls in classes
        }
        self._required: dict[type[M], frozenset[str]] = {
            cls: frozenset(f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING)
            for cls in classes
        }

    def to_payload(self, message: M) -> dict[str, Any]:
        """The CBOR-ready map of a message's fields (enums as ints, maps as dicts).

        Raises :class:`UnknownMessage` for a message not in the catalogue.
        """
        cls = type(message)
        getter = self._getters.get(cls)
        if getter is None:
            raise UnknownMessage(f"{cls.__name__} is not a registered flodl message")
        names = self._field_names[cls]
        if len(names) == 1:
            payload = {names[0]: getter(message)}
        else:
            payload = dict(zip(names, getter(message), strict=True))
        for name in self._map_fields[cls]:
            payload[name] = dict(payload[name])
        return payload

    def from_payload(self, tag: int, payload: object, allowed: frozenset[int] | None = None) -> M:
        """Build the message for ``tag`` from a decoded payload, validating every field.

        Raises :class:`UnknownMessage` for a tag that is unknown (or not in ``allowed``) and
        :class:`MessageValidationError` for a payload that is not a map, has missing or extra
        fields, or holds a value of the wrong type or range.
        """
        cls = self.by_tag.get(tag)
        if cls is None or (allowed is not None and tag not in allowed):
            raise UnknownMessage(f"unknown message tag {tag}")
        if type(payload) is not dict:
            raise MessageValidationError(
                f"{cls.__name__}: payload must be a map, got {type(payload).__name__}"
            )
        try:
            return cls(**payload)
        except MessageValidationError as err:
            raise MessageValidationError(f"{cls.__name__}: {err}") from None
        except TypeError:
            # Missing, unexpected or non-string keys: explain precisely (off the hot path).
            names = self._field_names[cls]
            keys = set(payload.keys())
            missing = sorted(self._required[cls] - keys)
            extra = sorted(repr(k) for k in keys - set(names))
            raise MessageValidationError(
                f"{cls.__name__}: missing fields {missing}, unexpected fields {extra}"
            ) from None
        except ValueError as err:  # a converter of an enum or list choked on a forged value
            raise MessageValidationError(f"{cls.__name__}: {err}") from None


def _no_fields(_message: object) -> tuple[()]:
    return ()
