"""File names of a bundle: ``<directory>/<stem><suffix>``."""

from __future__ import annotations

import re

from flodl.errors import CheckpointError

__all__ = [
    "CONFIG_SUFFIX",
    "LATEST_NAME",
    "META_SUFFIX",
    "MODEL_SUFFIX",
    "OPTIM_STRUCTURE_SUFFIX",
    "OPTIM_TENSORS_SUFFIX",
    "OUTER_SUFFIX",
    "check_stem",
]

MODEL_SUFFIX = ".model.safetensors"
OPTIM_TENSORS_SUFFIX = ".optim.safetensors"
OPTIM_STRUCTURE_SUFFIX = ".optim.json"
OUTER_SUFFIX = ".outer.safetensors"
"""The outer optimizer's state (global weights, momentum, version), when the run has one."""
CONFIG_SUFFIX = ".config.json"
META_SUFFIX = ".meta.json"
"""Written last: its presence (with every file it lists) marks a complete bundle."""
LATEST_NAME = "latest.json"
"""``{"stem": ...}``: the bundle saved last, replaced atomically after each save."""

_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


def check_stem(stem: str) -> str:
    """``stem`` if it is a plain file-name stem (letters, digits, ``_.-``; not hidden).

    Raises:
        CheckpointError: the stem is empty, hidden, too long, or holds a path separator.
    """
    if not isinstance(stem, str) or not _STEM.fullmatch(stem):
        raise CheckpointError(
            f"checkpoint stem {stem!r} must start with a letter or digit and hold only letters, "
            "digits, '_', '.' and '-' (at most 200 characters)"
        )
    return stem
