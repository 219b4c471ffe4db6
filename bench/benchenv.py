"""What every bench records about the machine it ran on (one place for all of them)."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
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
