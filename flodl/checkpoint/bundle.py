"""Checkpoint bundles: save atomically, find the newest complete one, load it back.

A bundle with stem ``S`` in directory ``D`` is::

    D/S.model.safetensors     model tensors (safetensors; key order kept in its metadata)
    D/S.optim.safetensors     optimizer tensors     } only when an optimizer state was given
    D/S.optim.json            optimizer structure   }
    D/S.outer.safetensors     outer optimizer state   only when one was given
    D/S.config.json           run config (JSON)       only when a config was given
    D/S.meta.json             CheckpointMeta + manifest (name, size, sha256 of each file above)
    D/latest.json             {"stem": "S"}: the bundle saved last

No pickle anywhere: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from flodl.checkpoint.death import DeathRecord, read_death_records
from flodl.checkpoint.files import TEMP_MARKER, fsync_directory, stage, write_atomically
from flodl.checkpoint.meta import MANIFEST_KEY, CheckpointMeta
from flodl.checkpoint.names import (
    CONFIG_SUFFIX,
    LATEST_NAME,
    META_SUFFIX,
    MODEL_SUFFIX,
    OPTIM_STRUCTURE_SUFFIX,
    OPTIM_TENSORS_SUFFIX,
    OUTER_SUFFIX,
    check_stem,
)
from flodl.checkpoint.tree import join_tree, split_tree, storable
from flodl.errors import CheckpointError

if TYPE_CHECKING:
    import torch

__all__ = ["Bundle", "default_stem", "find_latest", "load_bundle", "save_bundle"]

TREE_FORMAT = "flodl-state-tree/1"
_ROLES = {
    "model": MODEL_SUFFIX,
    "optim_tensors": OPTIM_TENSORS_SUFFIX,
    "optim_structure": OPTIM_STRUCTURE_SUFFIX,
    "outer": OUTER_SUFFIX,
    "config": CONFIG_SUFFIX,
}
_MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024


@attrs.frozen
class Bundle:
    """A loaded checkpoint. Tensors are on the CPU; ``path`` is ``<directory>/<stem>``."""

    path: Path
    meta: CheckpointMeta
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None
    config: dict[str, Any] | None
    deaths: tuple[DeathRecord, ...]
    outer_state: dict[str, torch.Tensor] = attrs.field(factory=dict)
    """The outer optimizer's named tensors (:mod:`flodl.averaging.outer`); empty: none saved."""


def default_stem(meta: CheckpointMeta) -> str:
    """A stem that sorts by step: ``flodl-step000001234``."""
    return f"flodl-step{meta.global_step:09d}"


def _json_bytes(value: object, what: str) -> bytes:
    try:
        return json.dumps(value, indent=1, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} cannot be written as JSON: {exc}") from exc


def _safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    from safetensors.torch import save

    try:
        return save(dict(tensors), metadata=metadata)
    except Exception as exc:  # safetensors raises bare errors (dtype, sharing, names)
        raise CheckpointError(f"tensors cannot be written as safetensors: {exc}") from exc


def save_bundle(
    directory: str | Path,
    stem: str,
    *,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any] | None,
    meta: CheckpointMeta,
    config: Mapping[str, Any] | None = None,
    outer_state: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a bundle and point ``latest.json`` at it; returns ``<directory>/<stem>``.

    Everything is serialized in memory first (a bad value raises before any file changes).
    Then every data file is written and fsynced under a temporary name, renamed into place, the
    directory fsynced, the meta written the same way, and ``latest.json`` last. So whenever the
    process is killed, :func:`find_latest` sees either this complete bundle or earlier ones. A
    re-save under an existing stem removes that stem's meta just before the renames, so a
    half-replaced bundle never looks complete (but a kill in that short window loses the old
    bundle of this stem: give each save its own stem, as :func:`default_stem` does, to always
    keep the previous one). Synchronous: from trio, run it in ``trio.to_thread.run_sync``; if that
    thread is abandoned, the save still finishes or leaves earlier bundles intact.

    Raises:
        CheckpointError: bad stem; a state value that cannot be saved without pickle; a config
            that is not JSON; or an OS error while writing (the message names the file).
    """
    directory = Path(directory)
    check_stem(stem)
    model_names = list(model_state)
    payload: dict[str, bytes] = {
        "model": _safetensors_bytes(
            storable(model_state),
            {"format": "flodl-model", "order": json.dumps(model_names)},
        )
    }
    if optimizer_state is not None:
        structure, tensors = split_tree(dict(optimizer_state))
        payload["optim_tensors"] = _safetensors_bytes(tensors, {"format": TREE_FORMAT})
        payload["optim_structure"] = _json_bytes(
            {"format": TREE_FORMAT, "structure": structure}, "optimizer state"
        )
    if outer_state:
        payload["outer"] = _safetensors_bytes(outer_state, {"format": "flodl-outer"})
    if config is not None:
        payload["config"] = _json_bytes(dict(config), "config")
    manifest: dict[str, dict[str, Any]] = {
        role: {
            "file": stem + _ROLES[role],
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        for role, data in payload.items()
    }
    meta_bytes = _json_bytes({**meta.to_json(), MANIFEST_KEY: manifest}, "checkpoint meta")

    try:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_files(directory, stem)
        _swap_in(directory, stem, {manifest[role]["file"]: data for role, data in payload.items()})
        write_atomically(directory / (stem + META_SUFFIX), meta_bytes)
        write_atomically(directory / LATEST_NAME, _json_bytes({"stem": stem}, "latest pointer"))
    except OSError as exc:
        raise CheckpointError(f"could not write checkpoint {directory / stem}: {exc}") from exc
    return directory / stem


def _swap_in(directory: Path, stem: str, files: Mapping[str, bytes]) -> None:
    """Put the data files of a bundle in place; on return they are durable, the meta absent.

    Every file is first written and fsynced under a temporary name, while an earlier bundle of
    this stem stays whole. Only then is that bundle's meta removed (so from here on it is
    incomplete, never a mix), its files replaced by renames, and the directory fsynced.
    """
    staged: list[tuple[Path, Path]] = []
    try:
        for name, data in files.items():
            staged.append((stage(directory / name, data), directory / name))
        old_meta = directory / (stem + META_SUFFIX)
        if old_meta.exists():
            old_meta.unlink()
            fsync_directory(directory)
        for suffix in _ROLES.values():
            if stem + suffix not in files:
                (directory / (stem + suffix)).unlink(missing_ok=True)
        for temp, final in staged:
            os.replace(temp, final)
        fsync_directory(directory)
    finally:
        for temp, _ in staged:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)


def _remove_stale_temp_files(directory: Path, stem: str) -> None:
    """Drop temp files that killed saves of this stem (or of the pointer) left behind.

    One process saves into a directory at a time, so no live save owns them.
    """
    leftovers = [
        *directory.glob(f".{stem}.*{TEMP_MARKER}*"),
        *directory.glob(f".{LATEST_NAME}{TEMP_MARKER}*"),
    ]
    for leftover in leftovers:
        with contextlib.suppress(OSError):
            leftover.unlink()


# --- finding ------------------------------------------------------------------------------------


def _complete_meta(stem_path: Path) -> dict[str, Any] | None:
    """The raw meta of ``stem_path`` if it exists and every file it lists has its size."""
    try:
        raw = json.loads((stem_path.parent / (stem_path.name + META_SUFFIX)).read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    try:
        manifest = _manifest(raw, stem_path)
    except CheckpointError:
        return None
    for entry in manifest.values():
        try:
            if (stem_path.parent / entry["file"]).stat().st_size != entry["bytes"]:
                return None
        except OSError:
            return None
    return raw


def find_latest(directory: str | Path) -> Path | None:
    """``<directory>/<stem>`` of the newest complete bundle, or None if there is none.

    ``latest.json`` names it; when the pointer is missing or names a bundle that is not complete
    (a save was interrupted, or files were removed), the complete bundle with the latest
    ``created_unix`` (then ``global_step``) wins. Complete means: the meta exists and every
    file its manifest lists has the recorded size (contents are verified by :func:`load_bundle`).
    """
    directory = Path(directory)
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError, CheckpointError):
        pointed = json.loads((directory / LATEST_NAME).read_bytes())["stem"]
        candidate = directory / check_stem(pointed)
        if _complete_meta(candidate) is not None:
            return candidate
    best: tuple[float, int, str] | None = None
    for meta_path in directory.glob("*" + META_SUFFIX):
        stem = meta_path.name[: -len(META_SUFFIX)]
        raw = _complete_meta(directory / stem)
        if raw is None:
            continue
        created, step = raw.get("created_unix"), raw.get("global_step")
        key = (
            float(created) if isinstance(created, int | float) else 0.0,
            step if isinstance(step, int) else 0,
            stem,
        )
        if best is None or key > best:
            best = key
    return None if best is None else directory / best[2]


# --- loading ------------------------------------------------------------------------------------


def _manifest(raw: Mapping[str, Any], stem_path: Path) -> dict[str, dict[str, Any]]:
    manifest = raw.get(MANIFEST_KEY)
    where = f"checkpoint {stem_path}"
    if not isinstance(manifest, dict) or "model" not in manifest:
        raise CheckpointError(f"{where}: the meta has no file manifest naming the model")
    if set(manifest) - set(_ROLES):
        raise CheckpointError(f"{where}: unknown files in manifest {sorted(manifest)}")
    if ("optim_tensors" in manifest) != ("optim_structure" in manifest):
        raise CheckpointError(f"{where}: manifest lists half of the optimizer state")
    for role, entry in manifest.items():
        if (
            not isinstance(entry, dict)
            or entry.get("file") != stem_path.name + _ROLES[role]
            or type(entry.get("bytes")) is not int
            or not isinstance(entry.get("sha256"), str)
        ):
            raise CheckpointError(f"{where}: malformed manifest entry {role!r}: {entry!r}")
    return manifest


def _read_verified(stem_path: Path, entry: Mapping[str, Any]) -> bytes:
    path = stem_path.parent / str(entry["file"])
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from exc
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(
            f"checkpoint file {path} does not match the meta's manifest "
            f"({len(data)} bytes, expected {entry['bytes']}); it is corrupt or from another save"
        )
    return data


def _load_tensors(data: bytes, path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors.torch import load

    try:
        tensors = load(data)
        (header_len,) = struct.unpack("<Q", data[:8])
        if header_len > _MAX_SAFETENSORS_HEADER:
            raise ValueError(f"header of {header_len} bytes")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except Exception as exc:  # safetensors raises its own bare error type
        raise CheckpointError(f"checkpoint file {path} is not valid safetensors: {exc}") from exc
    return tensors, metadata


def _load_json(data: bytes, path: Path) -> Any:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint file {path} is not valid JSON: {exc}") from exc


def _stem_path(path: Path) -> Path:
    if path.is_dir():
        latest = find_latest(path)
        if latest is None:
            raise CheckpointError(f"no complete checkpoint bundle in {path}")
        return latest
    if path.name.endswith(META_SUFFIX):
        path = path.with_name(path.name[: -len(META_SUFFIX)])
    check_stem(path.name)
    return path


def load_bundle(path: str | Path) -> Bundle:
    """Load a bundle: ``path`` is a directory (its newest complete bundle), a stem path
    ``<directory>/<stem>``, or the bundle's ``.meta.json``. Every file is checked against the
    meta's manifest (size and sha256) before it is parsed.

    Raises:
        CheckpointError: no complete bundle; a missing, partial or corrupt file; a meta of a
            newer schema or with malformed fields. The message names the file.
    """
    stem_path = _stem_path(Path(path))
    meta_path = stem_path.parent / (stem_path.name + META_SUFFIX)
    try:
        meta_data = meta_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{stem_path} is not a complete checkpoint bundle: {meta_path.name} is missing "
            "(the save may have been interrupted)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint meta {meta_path} cannot be read: {exc}") from exc
    raw = _load_json(meta_data, meta_path)
    meta = CheckpointMeta.from_json(raw)
    manifest = _manifest(raw, stem_path)

    model_file = stem_path.parent / manifest["model"]["file"]
    tensors, metadata = _load_tensors(_read_verified(stem_path, manifest["model"]), model_file)
    order = _load_json(metadata.get("order", "null").encode(), model_file)
    if (
        not isinstance(order, list)
        or not all(isinstance(name, str) for name in order)
        or sorted(order) != sorted(tensors)
    ):
        raise CheckpointError(f"checkpoint file {model_file} has no valid key order")
    model_state = {name: tensors[name] for name in order}

    optimizer_state = None
    if "optim_tensors" in manifest:
        tensors_file = stem_path.parent / manifest["optim_tensors"]["file"]
        structure_file = stem_path.parent / manifest["optim_structure"]["file"]
        optim_tensors, _ = _load_tensors(
            _read_verified(stem_path, manifest["optim_tensors"]), tensors_file
        )
        doc = _load_json(_read_verified(stem_path, manifest["optim_structure"]), structure_file)
        if not isinstance(doc, dict) or doc.get("format") != TREE_FORMAT or "structure" not in doc:
            raise CheckpointError(f"{structure_file} is not a {TREE_FORMAT} document")
        tree = join_tree(doc["structure"], optim_tensors)
        if not isinstance(tree, dict):
            raise CheckpointError(f"{structure_file} does not hold a state dict")
        optimizer_state = tree

    outer_state: dict[str, torch.Tensor] = {}
    if "outer" in manifest:
        outer_file = stem_path.parent / manifest["outer"]["file"]
        outer_state, _ = _load_tensors(_read_verified(stem_path, manifest["outer"]), outer_file)

    config = None
    if "config" in manifest:
        config_file = stem_path.parent / manifest["config"]["file"]
        config = _load_json(_read_verified(stem_path, manifest["config"]), config_file)
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_file} does not hold a JSON object")

    return Bundle(
        path=stem_path,
        meta=meta,
        model_state=model_state,
        optimizer_state=optimizer_state,
        config=config,
        deaths=read_death_records(stem_path.parent, stem_path.name),
        outer_state=outer_state,
    )
