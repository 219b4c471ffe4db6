"""Suite-wide collection order: the longest scenarios first, then the other multi-process
tests, then the rest.

``make test`` runs the suite on two workers (pytest-xdist, ``--dist loadgroup`` handing tests
out one at a time in this order), so a scenario of 20 s or more starts at once and the quick
tests fill the other worker around it, instead of one starting last and running alone while
the other worker sits idle. Serially the order changes nothing a test can see.
"""

from __future__ import annotations

import pytest


def _start_order(item: pytest.Item) -> int:
    if item.get_closest_marker("long") is not None:
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_start_order)
