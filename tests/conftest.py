"""Suite-wide: the order tests start in (the longest scenarios first, then the other
multi-process tests, then the rest), and the sources compiled once before the run.

``make test`` runs the suite on two workers (pytest-xdist, ``--dist loadgroup`` handing tests
out one at a time in this order), so a scenario of 20 s or more starts at once and the quick
tests fill the other worker around it, instead of one starting last and running alone while
the other worker sits idle. Serially the order changes nothing a test can see.

The suite keeps bytecode where ``PYTHONDONTWRITEBYTECODE`` is set too: it starts hundreds of
Python processes that import flodl, none of which would save its bytecode, so each would compile
what it imports again. Before the run the process that hands the tests out compiles the
project's sources to ``__pycache__`` (a second when none is up to date), and every pytest process
saves the test modules it rewrites (pytest's assertion rewriting), for the next run.
"""

from __future__ import annotations

import compileall
import sys
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
    sys.dont_write_bytecode = False  # before collection: pytest saves the modules it rewrites
    if not hasattr(config, "workerinput"):  # not in a pytest-xdist worker: once per run
        for folder in SOURCES:
            compileall.compile_dir(ROOT / folder, quiet=1)
