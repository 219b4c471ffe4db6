"""Suite-wide: the order tests start in (the longest scenarios first, then the other
multi-process tests, then the rest), and the sources compiled once before the run.

``make test`` runs the suite on two workers (pytest-xdist, ``--dist loadgroup`` handing tests
out one at a time in this order), so a scenario of 20 s or more starts at once and the quick
tests fill the other worker around it, instead of one starting last and running alone while
the other worker sits idle. Serially the order changes nothing a test can see.

Before the run, the project's sources are compiled to ``__pycache__`` (once, in the process that
hands the tests out): the suite starts hundreds of Python processes that import flodl, and where
``PYTHONDONTWRITEBYTECODE`` is set none of them would save its bytecode, so each would compile
what it imports again.
"""

from __future__ import annotations

import compileall
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("flodl", "tests", "bench", "examples")


def _start_order(item: pytest.Item) -> int:
    if item.get_closest_marker("long") is not None:
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_start_order)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # not in a pytest-xdist worker: once per run
        for folder in SOURCES:
            compileall.compile_dir(ROOT / folder, quiet=1)
