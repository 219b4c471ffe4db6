"""Incomplete, corrupt and foreign files: find_latest skips them, load_bundle names them.

The states here are what an interrupted save or a damaged disk leaves behind, built by editing
real bundle files (the subprocess kill test in test_crash.py produces them for real).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flodl.checkpoint import find_latest, load_bundle, save_bundle
from flodl.errors import CheckpointError

from .helpers import make_meta

PICKLE_PROTO = b"\x80"  # PROTO opcode that starts every pickle of protocol >= 2
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip container


def save_step(directory: Path, step: int, stem: str | None = None) -> Path:
    return save_bundle(
        directory,
        stem or f"s{step}",
        model_state={"w": torch.full((64,), float(step))},
        optimizer_state={"state": {0: {"m": torch.full((64,), -float(step))}}, "param_groups": []},
        meta=make_meta(global_step=step, created_unix=1_700_000_000.0 + step),
    )


def test_empty_or_missing_directory(tmp_path: Path) -> None:
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "nope") is None
    with pytest.raises(CheckpointError, match="no complete checkpoint bundle"):
        load_bundle(tmp_path)


def test_latest_pointer_follows_the_last_save(tmp_path: Path) -> None:
    save_step(tmp_path, 20)
    save_step(tmp_path, 10)  # saved last, so latest, although its step is lower
    assert find_latest(tmp_path) == tmp_path / "s10"
    assert load_bundle(tmp_path).meta.global_step == 10


def test_missing_meta_means_incomplete(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    (tmp_path / "s2.meta.json").unlink()
    assert find_latest(tmp_path) == tmp_path / "s1"
    with pytest.raises(CheckpointError, match=r"s2\.meta\.json is missing"):
        load_bundle(tmp_path / "s2")


def test_truncated_data_file_is_skipped_and_named(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    model = tmp_path / "s2.model.safetensors"
    model.write_bytes(model.read_bytes()[:-10])
    assert find_latest(tmp_path) == tmp_path / "s1"
    with pytest.raises(CheckpointError, match=r"s2\.model\.safetensors does not match"):
        load_bundle(tmp_path / "s2")


def test_flipped_byte_is_detected(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    optim = tmp_path / "s1.optim.safetensors"
    data = bytearray(optim.read_bytes())
    data[-1] ^= 0xFF
    optim.write_bytes(bytes(data))
    assert find_latest(tmp_path) == tmp_path / "s1"  # same size: found, but loading checks
    with pytest.raises(CheckpointError, match=r"s1\.optim\.safetensors does not match"):
        load_bundle(tmp_path)


def test_broken_pointer_falls_back_to_the_newest_complete_bundle(tmp_path: Path) -> None:
    save_step(tmp_path, 5)
    save_step(tmp_path, 7)
    save_step(tmp_path, 6)
    (tmp_path / "latest.json").write_text('{"stem": "../../etc"}')
    assert find_latest(tmp_path) == tmp_path / "s7"  # the latest created_unix
    (tmp_path / "latest.json").write_text("{not json")
    assert find_latest(tmp_path) == tmp_path / "s7"
    (tmp_path / "latest.json").unlink()
    assert load_bundle(tmp_path).meta.global_step == 7


def test_resave_of_a_stem_replaces_it_and_clears_leftovers(tmp_path: Path) -> None:
    save_step(tmp_path, 1, stem="slot")
    leftover = tmp_path / ".slot.model.safetensors.tmp-1234-abcd"
    leftover.write_bytes(b"half a write")
    pointer_leftover = tmp_path / ".latest.json.tmp-1234-abcd"
    pointer_leftover.write_bytes(b"{")
    save_step(tmp_path, 2, stem="slot")
    assert not leftover.exists()
    assert not pointer_leftover.exists()
    bundle = load_bundle(tmp_path)
    assert bundle.meta.global_step == 2
    assert torch.equal(bundle.model_state["w"], torch.full((64,), 2.0))


def test_newer_schema_on_disk_is_refused_not_skipped(tmp_path: Path) -> None:
    save_step(tmp_path, 1)
    save_step(tmp_path, 2)
    meta_path = tmp_path / "s2.meta.json"
    meta_path.write_text(json.dumps(json.loads(meta_path.read_text()) | {"schema_version": 4}))
    with pytest.raises(CheckpointError, match="schema version 4"):
        load_bundle(tmp_path)


def test_no_file_of_a_bundle_is_a_pickle(tmp_path: Path) -> None:
    save_step(tmp_path, 3)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 5  # model, optim tensors, optim structure, meta, latest
    for path in files:
        head = path.read_bytes()[:4]
        assert not head.startswith(PICKLE_PROTO), path
        assert head != ZIP_MAGIC, path
    for path in tmp_path.glob("*.safetensors"):
        data = path.read_bytes()
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        assert "__metadata__" in header


def test_a_pickle_in_place_of_the_model_is_never_unpickled(tmp_path: Path) -> None:
    """A pickle that would create a marker file on unpickling, with a matching manifest."""
    save_step(tmp_path, 3)
    marker = tmp_path / "unpickled"
    evil = b"\x80\x02cbuiltins\nopen\n(V" + str(marker).encode() + b"\nVw\ntR."
    model = tmp_path / "s3.model.safetensors"
    model.write_bytes(evil)
    meta_path = tmp_path / "s3.meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["model"] |= {"bytes": len(evil), "sha256": hashlib.sha256(evil).hexdigest()}
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not valid safetensors"):
        load_bundle(tmp_path)
    assert not marker.exists()


def test_importing_flodl_checkpoint_does_not_import_torch() -> None:
    code = (
        "import sys, flodl.checkpoint; print('torch' in sys.modules, 'safetensors' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_resave_without_config_drops_the_old_config(tmp_path: Path) -> None:
    meta = make_meta()
    save_bundle(tmp_path, "s", model_state={}, optimizer_state=None, meta=meta, config={"a": 1})
    assert (tmp_path / "s.config.json").exists()
    save_bundle(tmp_path, "s", model_state={}, optimizer_state=None, meta=meta)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest.json",
        "s.meta.json",
        "s.model.safetensors",
    ]
    bundle = load_bundle(tmp_path)
    assert (bundle.config, bundle.optimizer_state, bundle.model_state) == (None, None, {})
