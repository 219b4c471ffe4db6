"""Split a state tree (an optimizer's ``state_dict``) into JSON structure plus named tensors.

The structure is plain JSON in which every object is a one-key tag, so nothing is ambiguous:

- ``{"tensor": key}``: the tensor stored under ``key`` (in a safetensors file);
- ``{"dict": [[k, v], ...]}``: a dict whose keys are strings or integers (kept apart, so the
  integer parameter ids of an optimizer's ``state`` come back as integers);
- ``{"tuple": [...]}``: a tuple (e.g. Adam's ``betas``);
- ``{"float": "nan" | "inf" | "-inf"}``: a float JSON cannot spell.

Lists, strings, integers, finite floats, booleans and null stand for themselves. Anything else
(an arbitrary object) is refused: nothing is pickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flodl.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["join_tree", "split_tree", "storable"]


def _child(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_TAGS = frozenset({"tensor", "dict", "tuple", "float"})


def storable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors that safetensors accepts, in the same order, sharing no storage.

    A tensor that is on another device, non-contiguous, a view into a larger storage, or shares
    its storage with an earlier one is copied; any other tensor is passed through uncopied.
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"state entry {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        t = tensor.detach().to("cpu")
        storage = t.untyped_storage()
        whole = (
            t.is_contiguous()
            and t.storage_offset() == 0
            and storage.nbytes() == t.numel() * t.element_size()
        )
        if not whole or (storage.data_ptr() != 0 and storage.data_ptr() in seen):
            t = t.clone(memory_format=torch.contiguous_format)
        if t.untyped_storage().data_ptr() != 0:
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def split_tree(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The JSON structure of ``tree`` and its tensors by key (keys are the tensors' paths).

    Raises:
        CheckpointError: the tree holds a value that is neither JSON, a tensor, a tuple nor a
            dict with string or integer keys (the message gives its path).
    """
    import torch

    tensors: dict[str, torch.Tensor] = {}

    def key_for(path: str) -> str:
        key, n = path or "tensor", 1
        while key in tensors:
            n += 1
            key = f"{path}#{n}"
        return key

    def encode(value: Any, path: str) -> Any:
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            x = float(value)
            if math.isfinite(x):
                return x
            return {"float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if isinstance(value, torch.Tensor):
            key = key_for(path)
            tensors[key] = value
            return {"tensor": key}
        if isinstance(value, tuple):
            return {"tuple": [encode(v, _child(path, i)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, _child(path, i)) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            items = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, str | int):
                    raise CheckpointError(
                        f"state at {path or '<root>'} has a key of type {type(k).__name__}; "
                        "only str and int keys can be saved"
                    )
                items.append([k if isinstance(k, str) else int(k), encode(v, _child(path, k))])
            return {"dict": items}
        raise CheckpointError(
            f"state at {path or '<root>'} holds a {type(value).__name__}, which cannot be saved "
            "without pickle (allowed: tensors, JSON scalars, lists, tuples, dicts)"
        )

    structure = encode(tree, "")
    return structure, storable(tensors)


def join_tree(structure: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the tree that :func:`split_tree` split (every tensor must be used exactly once).

    Raises:
        CheckpointError: the structure is malformed, names a missing tensor, or tensors are
            left over.
    """
    used: set[str] = set()

    def decode(node: Any, path: str) -> Any:
        if node is None or isinstance(node, bool | str | int | float):
            return node
        if isinstance(node, list):
            return [decode(v, _child(path, i)) for i, v in enumerate(node)]
        if not isinstance(node, dict) or len(node) != 1 or next(iter(node)) not in _TAGS:
            raise CheckpointError(f"malformed state structure at {path or '<root>'}: {node!r}")
        ((tag, body),) = node.items()
        if tag == "tensor":
            if not isinstance(body, str) or body not in tensors:
                raise CheckpointError(f"state at {path or '<root>'} names missing tensor {body!r}")
            if body in used:
                raise CheckpointError(f"state names tensor {body!r} twice")
            used.add(body)
            return tensors[body]
        if tag == "float":
            if body not in _SPECIAL_FLOATS:
                raise CheckpointError(f"malformed float {body!r} at {path or '<root>'}")
            return _SPECIAL_FLOATS[body]
        if not isinstance(body, list):
            raise CheckpointError(f"malformed {tag} at {path or '<root>'}: {body!r}")
        if tag == "tuple":
            return tuple(decode(v, _child(path, i)) for i, v in enumerate(body))
        out: dict[Any, Any] = {}
        for item in body:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or isinstance(item[0], bool)
                or not isinstance(item[0], str | int)
            ):
                raise CheckpointError(f"malformed dict entry at {path or '<root>'}: {item!r}")
            if item[0] in out:
                raise CheckpointError(f"duplicate key {item[0]!r} at {path or '<root>'}")
            out[item[0]] = decode(item[1], _child(path, item[0]))
        return out

    tree = decode(structure, "")
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointError(f"state tensors {unused} are not named by the structure")
    return tree
