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

Each pytest process starts one shared warm-start helper (``flodl warm-helper``) and names it in
``FLODL_WARM_HELPER``, so every ``flodl run`` and ``flodl agent`` a test starts forks its ranks
from a helper that has imported torch once for the whole suite instead of once per run (three
seconds of CPU each), and so do the tests' own multi-process helpers
(``tests/worker/procs.py``, ``tests/backends/harness.py``, the crash test's savers). For that
the session's ``PYTHONPATH`` is the repository's root, the variables that torch and
scikit-learn write into ``os.environ`` part-way through a session are set from its start (and
the ranks' import environment is put back after each test), and the helper imports with
``OMP_NUM_THREADS=1``, as the ranks of a launcher of two ranks or more do. A run whose ranks
would import in another environment (one rank: no ``OMP_NUM_THREADS=1``) starts its own, as do
the tests that use :func:`own_warm_helper` because they find a launcher's ranks among its
descendants.
"""

from __future__ import annotations

import compileall
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl.supervise.zygote import SHARED_VAR, import_environment

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("flodl", "tests", "bench", "examples")
INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"


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


@pytest.fixture(scope="session", autouse=True)
def shared_warm_helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The suite's warm-start helper, named in ``FLODL_WARM_HELPER`` for every process the
    tests start (and the launches they run in this process); gone after the last test."""
    path = str(tmp_path_factory.mktemp("warm-helper") / "helper.sock")
    pinned = {
        # Every process the tests start finds the repository's packages (the scripts that
        # import tests' helpers need it), so what they start and the helper share one path.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **{name: os.environ.get(name, value) for name, value in _LIBRARY_WRITTEN.items()},
        # torch keeps the folder it finds set (made absolute), else sets its default.
        INDUCTOR_CACHE_VAR: os.path.abspath(
            os.environ.get(INDUCTOR_CACHE_VAR) or tmp_path_factory.mktemp("torchinductor")
        ),
    }
    saved = {name: os.environ.get(name) for name in pinned}
    os.environ.update(pinned)
    # The environment a launcher gives ranks when a run has more than one and sets no
    # thread count (flodl/host/torchrun_env.py): the helper imports torch in it.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(SHARED_VAR, None)
    with subprocess.Popen(
        [sys.executable, "-m", "flodl.cli", "warm-helper", path],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as helper:
        try:
            assert helper.stdout is not None
            ready = helper.stdout.readline()
            assert "ready" in ready, f"the warm-start helper did not start: {ready!r}"
            os.environ[SHARED_VAR] = path
            yield path
        finally:
            os.environ.pop(SHARED_VAR, None)
            _restore(saved)
            helper.terminate()


@pytest.fixture(autouse=True)
def kept_import_environment(shared_warm_helper: str) -> Iterator[None]:
    """After each test, the variables ranks' imports read are as the suite's helper was started
    with: a library a test imported may have written one (as those in :data:`_LIBRARY_WRITTEN`
    do, and others may), and every later run would then start a helper of its own."""
    kept = import_environment(os.environ)
    yield
    now = import_environment(os.environ)
    _restore({name: kept.get(name) for name in now.keys() | kept.keys()})


_LIBRARY_WRITTEN = {
    # scikit-learn's import sets these where unset (for the OpenMP runtimes it may load), so
    # they are set only where unset here too.
    "KMP_DUPLICATE_LIB_OK": "True",
    "KMP_INIT_AT_FORK": "FALSE",
}
"""What libraries the tests import write into ``os.environ``, among the variables ranks'
imports read, set from the start: else the first test in a pytest process to import one
would leave every later run unable to use the suite's helper (each run then imports torch
again in a helper of its own, 3 - 4 s of CPU). torch's inductor cache folder (which torch
writes when a test first builds an optimizer) is pinned beside them."""


def _restore(values: dict[str, str | None]) -> None:
    """Set each variable of ``values`` to its value, or unset it where that is None."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def own_warm_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs started in this test start a warm-start helper of their own, whose children their
    ranks are (for tests that find a launcher's ranks among its descendants)."""
    monkeypatch.delenv(SHARED_VAR, raising=False)
