"""Keeping the newest K bundles of a directory: :func:`prune_bundles`.

Only bundles flodl named (``flodl-step<9 digits>`` with an optional ``-v<6 digits>``) are
counted and removed, and only the files flodl writes for them; a bundle of any other stem,
an incomplete one and every other file stay. The bundles kept are the ``keep`` newest complete
ones, ordered as :func:`~flodl.checkpoint.bundle.find_latest` orders them, so the bundle a
resume would pick is never removed; call it after a save completed, so the previous bundle
stays until the new one is whole on disk.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from flodl.checkpoint.bundle import _complete_meta
from flodl.checkpoint.names import (
    CONFIG_SUFFIX,
    META_SUFFIX,
    MODEL_SUFFIX,
    OPTIM_STRUCTURE_SUFFIX,
    OPTIM_TENSORS_SUFFIX,
    OUTER_SUFFIX,
)

__all__ = ["FLODL_STEM", "prune_bundles"]

FLODL_STEM = re.compile(r"flodl-step\d{9}(-v\d{6})?")
_DATA_SUFFIXES = (
    MODEL_SUFFIX,
    OPTIM_TENSORS_SUFFIX,
    OPTIM_STRUCTURE_SUFFIX,
    OUTER_SUFFIX,
    CONFIG_SUFFIX,
)
_DEATH = re.compile(r"\.rank\d+\.death\.json")


def prune_bundles(directory: Path, keep: int) -> list[str]:
    """Remove all but the ``keep`` (>= 1) newest complete flodl bundles; the stems removed."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    ranked: list[tuple[float, int, str]] = []
    for meta_path in directory.glob("flodl-step*" + META_SUFFIX):
        stem = meta_path.name[: -len(META_SUFFIX)]
        if not FLODL_STEM.fullmatch(stem):
            continue
        raw = _complete_meta(directory / stem)
        if raw is None:
            continue
        created, step = raw.get("created_unix"), raw.get("global_step")
        ranked.append(
            (
                float(created) if isinstance(created, int | float) else 0.0,
                step if isinstance(step, int) else 0,
                stem,
            )
        )
    ranked.sort(reverse=True)
    removed = [stem for _, _, stem in ranked[keep:]]
    for stem in removed:
        _remove_bundle(directory, stem)
    return removed


def _remove_bundle(directory: Path, stem: str) -> None:
    # The meta goes first: a prune cut short leaves an incomplete bundle, which nothing loads.
    names = [stem + META_SUFFIX, *(stem + suffix for suffix in _DATA_SUFFIXES)]
    names += [
        path.name
        for path in directory.glob(stem + ".rank*.death.json")
        if _DEATH.fullmatch(path.name[len(stem) :])
    ]
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
