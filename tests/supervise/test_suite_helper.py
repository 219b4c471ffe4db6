"""The suite's own shared warm-start helper (``tests/conftest.py``) serves the runs the tests
start, also after a test in this process used a library that writes to ``os.environ``."""

from __future__ import annotations

import os
import sys

from flodl.supervise.warm import warm_starter_if


async def test_runs_started_after_torch_wrote_its_cache_folder_still_use_the_suites_helper() -> (
    None
):
    import sklearn  # noqa: F401  (its first import sets two KMP_ variables where unset)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    before = dict(os.environ)
    # What building the first optimizer in a process does (torch._dynamo's import calls it):
    # torch writes its inductor cache folder into os.environ, a variable the ranks' imports
    # read, so a helper started without it could not serve them.
    cache_dir()
    assert dict(os.environ) == before
    said: list[str] = []
    # What a launcher of two ranks asks for (tests/conftest.py starts the helper so).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    async with warm_starter_if(True, sys.executable, env, said.append) as starter:
        assert starter is not None
    assert said == []  # else: "...; this run starts a helper of its own"
