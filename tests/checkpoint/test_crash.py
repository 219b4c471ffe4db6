"""A save killed at a random moment never leaves a broken latest checkpoint.

A real subprocess saves ~16 MiB bundles in a loop and is SIGKILLed at random moments, over
and over in the same directory: at least 10 times, and until 3 kills caught a save in the
middle of changing files (about a third of the kills do), at most 30 times. After every kill,
loading the directory yields a complete bundle whose tensors all belong to one save, at least
as new as the last save the child reported done, or a CheckpointError saying there is no
complete bundle (only before any save finished).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch
import trio

from flodl.checkpoint import find_latest, load_bundle
from flodl.checkpoint.files import TEMP_MARKER
from flodl.errors import CheckpointError

SAVER = Path(__file__).with_name("crash_saver.py")
ROOT = Path(__file__).resolve().parents[2]
MIN_TRIES = 10
MAX_TRIES = 30
WANTED_INTERRUPTIONS = 3
SEED = 20240611


async def read_until(stream: trio.abc.ReceiveStream, needle: bytes, buffer: bytearray) -> None:
    while needle not in buffer:
        chunk = await stream.receive_some()
        if not chunk:
            raise AssertionError(f"saver exited before {needle!r}: {bytes(buffer)!r}")
        buffer += chunk


async def read_rest(stream: trio.abc.ReceiveStream, buffer: bytearray) -> None:
    while chunk := await stream.receive_some():
        buffer += chunk


def check_consistent(directory: Path, done_so_far: int | None) -> int | None:
    """The step of the loaded bundle (None when none exists), after checking its contents."""
    try:
        bundle = load_bundle(directory)
    except CheckpointError as exc:
        assert done_so_far is None, f"a save completed (step {done_so_far}) but: {exc}"
        assert "no complete checkpoint bundle" in str(exc)
        assert find_latest(directory) is None
        return None
    step = bundle.meta.global_step
    assert done_so_far is None or step >= done_so_far
    for name, tensor in bundle.model_state.items():
        assert torch.equal(tensor, torch.full_like(tensor, float(step))), name
    assert bundle.optimizer_state is not None
    for per_param in bundle.optimizer_state["state"].values():
        buf = per_param["momentum_buffer"]
        assert torch.equal(buf, torch.full_like(buf, -float(step)))
    return step


def interrupted_save_left_traces(directory: Path) -> bool:
    names = [p.name for p in directory.iterdir()]
    half_written = any(TEMP_MARKER in name for name in names)
    data_without_meta = any(
        name.endswith(".model.safetensors")
        and name.replace(".model.safetensors", ".meta.json") not in names
        for name in names
    )
    return half_written or data_without_meta


async def test_sigkill_during_saves_never_leaves_a_broken_latest(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done: int | None = None  # newest step a child reported saved
    loaded_steps: list[int | None] = []
    interrupted = 0
    attempt = 0
    while attempt < MIN_TRIES or (interrupted < WANTED_INTERRUPTIONS and attempt < MAX_TRIES):
        first_step = attempt * 1000
        proc = await trio.lowlevel.open_process(
            [sys.executable, str(SAVER), str(tmp_path), str(first_step)],
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        assert proc.stdout is not None
        out = bytearray()
        try:
            with trio.fail_after(60):
                await read_until(proc.stdout, b"ready\n", out)
            # The first try is killed almost at once, usually before any save completes.
            await trio.sleep(rng.uniform(0.0, 0.02) if attempt == 0 else rng.uniform(0.0, 0.6))
        finally:
            proc.kill()
            await proc.wait()
        with trio.fail_after(10):
            await read_rest(proc.stdout, out)
        await proc.stdout.aclose()
        assert proc.returncode == -9
        steps = [
            int(line.split()[1]) for line in out.decode().splitlines() if line.startswith("saved")
        ]
        if steps:
            done = max(steps)
        interrupted += interrupted_save_left_traces(tmp_path)
        loaded_steps.append(check_consistent(tmp_path, done))
        attempt += 1
    assert done is not None, "no save ever completed: the kill delays are too short"
    assert loaded_steps[-1] is not None and loaded_steps[-1] >= done
    assert interrupted >= WANTED_INTERRUPTIONS, f"{interrupted} kills landed mid-save"
