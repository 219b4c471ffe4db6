"""A save killed at a random moment never leaves a broken latest checkpoint.

A real process (crash_saver.py, forked from a warm-start helper that has torch imported)
saves ~16 MiB bundles in a loop, rotating over three stems, and is SIGKILLed at random moments,
over and over in the same directory: at least 10 times, and until 3 kills caught a save in the
middle of changing files (about a third of the kills do), at most 30 times. After every kill,
loading the directory must give a complete bundle whose tensors all belong to one save and which
is at least as new as every bundle known to be intact, or, while no bundle can exist, a
CheckpointError saying there is none.

What "known to be intact" means: a bundle whose save the child reported done, unless a later
save under the same stem started since. The save a kill interrupted may have completed (before
the child could report it) or not; the bundle it was replacing may or may not survive. Either
stays possible until a later save to that stem completes, however many loads come first.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import attrs
import pytest
import torch
import trio

from flodl.checkpoint import find_latest, load_bundle
from flodl.checkpoint.files import TEMP_MARKER
from flodl.errors import CheckpointError
from flodl.supervise.warm import WarmStarter, warm_starter_if

SAVER = Path(__file__).with_name("crash_saver.py")
ROOT = Path(__file__).resolve().parents[2]
SLOTS = 3  # crash_saver.py saves step s under stem f"slot{s % 3}"
MIN_TRIES = 10
MAX_TRIES = 30
WANTED_INTERRUPTIONS = 3
SEED = 20240611
SAVER_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@attrs.define
class Ledger:
    """Which step each stem holds: certainly (``intact``) or one of several (``perhaps``)."""

    intact: dict[int, int] = attrs.field(factory=dict)
    perhaps: dict[int, set[int]] = attrs.field(factory=dict)

    def saved(self, step: int) -> None:
        self.intact[step % SLOTS] = step
        self.perhaps.pop(step % SLOTS, None)

    def interrupted(self, step: int) -> None:
        """A save of ``step`` was killed: its stem now holds ``step`` (the save may have ended
        before the kill, with ``latest.json`` still naming another stem), what it held before,
        or nothing. It stays so until a later save to the stem completes, however many loads
        come first: a load follows ``latest.json`` and may pick another stem."""
        slot = step % SLOTS
        before = {self.intact.pop(slot)} if slot in self.intact else self.perhaps.get(slot, set())
        self.perhaps[slot] = {*before, step}

    def allowed(self) -> tuple[int | None, set[int]]:
        """The oldest acceptable step (None: no bundle needed) and every possible one."""
        floor = max(self.intact.values(), default=None)
        possible = {*self.intact.values(), *(step for s in self.perhaps.values() for step in s)}
        return floor, possible

    def confirm(self, step: int) -> None:
        """``step`` was loaded, so it is complete (and still in its stem)."""
        self.saved(step)


async def read_until(stream: trio.abc.ReceiveStream, needle: bytes, buffer: bytearray) -> None:
    while needle not in buffer:
        chunk = await stream.receive_some()
        if not chunk:
            raise AssertionError(f"saver exited before {needle!r}: {bytes(buffer)!r}")
        buffer += chunk


async def read_rest(stream: trio.abc.ReceiveStream, buffer: bytearray) -> None:
    while chunk := await stream.receive_some():
        buffer += chunk


def load_and_check(directory: Path, floor: int | None, possible: set[int]) -> int | None:
    """The step of the bundle the directory loads (None when none), after checking it."""
    try:
        bundle = load_bundle(directory)
    except CheckpointError as exc:
        assert floor is None, f"step {floor} is intact, yet: {exc}"
        assert "no complete checkpoint bundle" in str(exc)
        assert find_latest(directory) is None
        return None
    step = bundle.meta.global_step
    assert step in possible, f"loaded step {step}, never saved or since replaced"
    assert floor is None or step >= floor, f"loaded step {step}, but {floor} is intact"
    for name, tensor in bundle.model_state.items():
        assert torch.equal(tensor, torch.full_like(tensor, float(step))), name
    assert bundle.optimizer_state is not None
    for per_param in bundle.optimizer_state["state"].values():
        buf = per_param["momentum_buffer"]
        assert torch.equal(buf, torch.full_like(buf, -float(step)))
    return step


def traces_of_an_interrupted_save(directory: Path) -> bool:
    names = {p.name for p in directory.iterdir()}
    half_written = any(TEMP_MARKER in name for name in names)
    data_without_meta = any(
        name.endswith(".model.safetensors")
        and name.replace(".model.safetensors", ".meta.json") not in names
        for name in names
    )
    return half_written or data_without_meta


async def kill_a_saver(
    warm: WarmStarter, directory: Path, first_step: int, delay: float
) -> list[int]:
    """Fork a saver from ``first_step`` (``warm``: torch is imported already), SIGKILL it
    ``delay`` s after it is ready; its saves."""
    argv = [sys.executable, str(SAVER), str(directory), str(first_step)]
    proc = await warm.start(argv, SAVER_ENV, cwd=str(ROOT))
    assert proc.stdout is not None
    out = bytearray()
    try:
        with trio.fail_after(60):
            await read_until(proc.stdout, b"ready\n", out)
        await trio.sleep(delay)
    finally:
        proc.kill()
        await proc.wait()
    with trio.fail_after(10):
        await read_rest(proc.stdout, out)
    await proc.stdout.aclose()
    assert proc.returncode == -9
    lines = out.decode().splitlines()
    return [int(line.split()[1]) for line in lines if line.startswith("saved ")]


@pytest.mark.long
@pytest.mark.slow
async def test_sigkill_during_saves_never_leaves_a_broken_latest(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    ledger = Ledger()
    interruptions = completed = attempt = 0
    loaded: int | None = None
    async with warm_starter_if(True, sys.executable, SAVER_ENV) as warm:
        assert warm is not None
        while attempt < MIN_TRIES or (interruptions < WANTED_INTERRUPTIONS and attempt < MAX_TRIES):
            first_step = attempt * 1000
            # The first saver is killed almost at once, usually before any save completes.
            delay = rng.uniform(0.0, 0.02) if attempt == 0 else rng.uniform(0.0, 0.6)
            saves = await kill_a_saver(warm, tmp_path, first_step, delay)
            assert saves == list(range(first_step, first_step + len(saves)))
            for step in saves:
                ledger.saved(step)
            in_progress = first_step + len(saves)
            ledger.interrupted(in_progress)
            interruptions += traces_of_an_interrupted_save(tmp_path)
            completed += len(saves)

            loaded = load_and_check(tmp_path, *ledger.allowed())
            if loaded is not None:
                ledger.confirm(loaded)
            attempt += 1
    assert completed > 0, "no save ever completed: the kill delays are too short"
    assert loaded is not None
    assert interruptions >= WANTED_INTERRUPTIONS, f"only {interruptions} kills landed mid-save"


def test_the_ledger_keeps_an_interrupted_save_possible_until_its_stem_is_saved_again() -> None:
    """What a loaded CI run met: step 2000's save ended just before its kill, latest.json still
    named step 1002's stem, so the next load gave 1002; the save after it removed 1002's meta,
    and the load then found 2000, which must still count as possible."""
    ledger = Ledger()
    for step in (1000, 1001, 1002):
        ledger.saved(step)
    ledger.interrupted(2000)
    ledger.confirm(1002)
    ledger.interrupted(3000)
    floor, possible = ledger.allowed()
    assert floor == 1000
    assert possible == {1000, 1001, 2000, 1002, 3000}
    ledger.saved(3002)  # a completed save to 2000's stem: 2000 is gone from it
    assert 2000 not in ledger.allowed()[1]
