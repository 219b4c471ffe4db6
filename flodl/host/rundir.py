"""The folder a run writes to: a new one per run, claimed by one launcher at a time.

``flodl run`` without ``--run-dir`` writes to ``runs/<time>-<short id>/`` (:func:`fresh_run_dir`)
and points the symlink ``runs/latest`` at it (:func:`point_latest`). :func:`claim_run_dir`
holds the folder for the launcher's life: an ``flock`` on ``flodl.lock`` keeps a second launcher
out, and a folder that already holds a run is refused unless the new run resumes it or
overwrites it. Overwriting removes only the files flodl writes (:func:`run_files`); anything
else in the folder stays.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from flodl.errors import ConfigError

__all__ = [
    "LATEST",
    "LOCK_NAME",
    "RUNS_ROOT",
    "claim_run_dir",
    "fresh_run_dir",
    "point_latest",
    "run_files",
]

RUNS_ROOT = Path("runs")
LATEST = "latest"
LOCK_NAME = "flodl.lock"
"""Never removed: deleting a lock file would let a later launcher lock a different inode."""

# What flodl writes in a run folder: the launcher's files and each rank's report, log and death
# record at the top; the coordinator's meta and each rank's bundles under checkpoints/. Hidden
# names are the temporary files of an atomic write a kill interrupted.
_TOP = re.compile(
    r"summary\.json|session\.key|coordinator\.sock|rank\d+\.(json|log)|rank\d+\.\d+\.log|events(\.\d+)?\.jsonl"
    r"|flodl\.rank\d+\.death\.json|\.rank\d+\.json\.\d+\.tmp"
)
_CHECKPOINTS = re.compile(r"coordinator\.meta\.json|\.coordinator\.meta\.json\.tmp-\d+-[0-9a-f]+")
_RANK_DIR = re.compile(r"rank\d+")
_BUNDLE = re.compile(
    r"latest\.json"
    r"|[A-Za-z0-9][A-Za-z0-9_.-]*"
    r"(\.model\.safetensors|\.optim\.safetensors|\.optim\.json|\.outer\.safetensors"
    r"|\.config\.json|\.meta\.json"
    r"|\.death\.json)"
    r"|\..+\.tmp-\d+-[0-9a-f]+"
)


def set_aside(path: Path) -> Path | None:
    """Rename ``path`` (``name.ext``) to ``name.<N>.ext``, N the first free number from 1, so
    that a file a run writes holds that run only (a resumed run's rank logs and event log).
    Returns the new path, or None when there was no file."""
    if not path.exists():
        return None
    stem, suffix = path.name.split(".", 1) if "." in path.name else (path.name, "")
    number = 1
    while (
        aside := path.with_name(f"{stem}.{number}.{suffix}" if suffix else f"{stem}.{number}")
    ).exists():
        number += 1
    path.rename(aside)
    return aside


def fresh_run_dir(root: Path = RUNS_ROOT) -> Path:
    """A new, unused folder name ``root/<YYYYmmdd-HHMMSS>-<6 hex>`` (not created)."""
    while True:
        path = root / f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        if not os.path.lexists(path):
            return path


def point_latest(run_dir: Path) -> None:
    """Create ``run_dir`` and point ``<its parent>/latest`` at it (atomically: readers see the
    old target or the new one). A ``latest`` that is not a symlink (an older flodl's folder)
    is left alone, with a warning."""
    run_dir.mkdir(parents=True, exist_ok=True)
    link = run_dir.parent / LATEST
    if os.path.lexists(link) and not link.is_symlink():
        print(
            f"flodl: warning: {link} is not a symlink (a run folder of an older flodl?); "
            f"left as it is, this run writes to {run_dir}",
            file=sys.stderr,
        )
        return
    staged = run_dir.parent / f".{LATEST}.{os.getpid()}.{secrets.token_hex(4)}"
    os.symlink(run_dir.name, staged)
    try:
        os.replace(staged, link)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(staged)
        raise


def _is_file(path: Path) -> bool:
    """A file, socket or symlink: anything that is not a real directory."""
    return path.is_symlink() or (path.exists() and not path.is_dir())


def run_files(run_dir: Path) -> list[Path]:
    """The files a flodl run left in ``run_dir`` (its lock excepted), sorted."""
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if _TOP.fullmatch(p.name) and _is_file(p)]
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        for path in checkpoints.iterdir():
            if _CHECKPOINTS.fullmatch(path.name) and _is_file(path):
                found.append(path)
            elif _RANK_DIR.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                found += [p for p in path.iterdir() if _BUNDLE.fullmatch(p.name) and _is_file(p)]
    return sorted(found)


def _remove_run(run_dir: Path) -> None:
    """Remove :func:`run_files`, then the checkpoint folders they leave empty (nothing else)."""
    for path in run_files(run_dir):
        path.unlink()
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        for path in checkpoints.iterdir():
            if _RANK_DIR.fullmatch(path.name) and path.is_dir() and not path.is_symlink():
                with contextlib.suppress(OSError):  # not empty: it holds files of someone else
                    path.rmdir()
        with contextlib.suppress(OSError):
            checkpoints.rmdir()


def _resumes(resume: Path | None, run_dir: Path) -> bool:
    """True when ``resume`` names ``run_dir`` (or its checkpoints folder)."""
    if resume is None:
        return False
    target = resume.resolve()
    here = run_dir.resolve()
    return target in (here, here / "checkpoints")


def check_overwrite_and_resume(run_dir: Path, resume: Path | None, overwrite: bool) -> None:
    """``--overwrite`` would delete the checkpoints ``--resume`` reads when both name one run."""
    if overwrite and _resumes(resume, run_dir):
        raise ConfigError(
            f"--overwrite would remove the checkpoints --resume {resume} reads; drop one of the two"
        )


@contextlib.contextmanager
def claim_run_dir(run_dir: Path, *, resume: Path | None, overwrite: bool) -> Iterator[Path]:
    """Hold ``run_dir`` for this run until the block ends.

    Creates the folder and locks it (``flock`` on ``flodl.lock``; released when the block
    ends or the process dies). Raises ConfigError when another launcher holds it, or when it
    holds an earlier run and neither ``resume`` names it (the new run goes on in it) nor
    ``overwrite`` is set (that run's files are removed first).
    """
    check_overwrite_and_resume(run_dir, resume, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError(
                f"run dir {run_dir} is in use by another flodl run (pid {holder}); "
                "wait for it to end or choose another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        earlier = run_files(run_dir)
        if earlier and not _resumes(resume, run_dir):
            if not overwrite:
                names = ", ".join(str(p.relative_to(run_dir)) for p in earlier[:3])
                more = f" and {len(earlier) - 3} more" if len(earlier) > 3 else ""
                raise ConfigError(
                    f"run dir {run_dir} already holds a run ({names}{more}); pass "
                    f"--resume {run_dir} to go on from it there, --overwrite to remove its "
                    "files first, or another --run-dir (none: a new folder under runs/)"
                )
            _remove_run(run_dir)
        yield run_dir
    finally:
        os.close(fd)
