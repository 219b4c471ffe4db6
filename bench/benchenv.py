"""What every bench records about the machine it ran on (one place for all of them)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Iterable, Sequence
from importlib import metadata


def load() -> float:
    """The 1-minute load average, rounded: benches run on shared machines, so record it."""
    return round(os.getloadavg()[0], 2)


def package_versions(names: Iterable[str]) -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {name: version(name) for name in names}


def environment(packages: Iterable[str], **extra: object) -> dict[str, object]:
    """Python, platform, CPUs, load and the versions of ``packages``, plus ``extra`` keys."""
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": load(),
        "packages": package_versions(packages),
        **extra,
    }


def run_ranks(commands: Sequence[Sequence[str]], timeout: float, what: str) -> list[str]:
    """Run one process per command (a rank each) to its end; their outputs, by rank.

    Every process has exited when this returns or raises: those still running at the shared
    deadline are killed. Raises RuntimeError naming the ranks that failed, with all output.
    """
    processes = [
        subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for command in commands
    ]
    try:
        deadline = time.monotonic() + timeout
        outputs = [
            p.communicate(timeout=max(deadline - time.monotonic(), 1.0))[0] for p in processes
        ]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(rank, p.returncode) for rank, p in enumerate(processes) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{what} ranks failed {failed}:\n" + "\n".join(outputs))
    return outputs
