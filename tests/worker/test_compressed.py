"""Compressed rounds in real workers (``average_dtype`` bf16, fp16): a coordinator and two ranks
in one trio run (memory transport, real gloo groups). The first round of a group generation runs
in full precision and sets the reference; every later one reduces 16-bit moves, and leaves the
ranks bitwise identical, with the outer optimizer too."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl.averaging.outer import OuterSettings
from flodl.core.common.policy import Policy
from flodl.errors import ConfigError
from flodl.worker.records import tensors_sha256
from tests.worker.test_inprocess import worker_config
from tests.worker.test_outer import NESTEROV, run_pair


@pytest.mark.parametrize(
    ("policy", "dtype", "outer"),
    [
        (Policy.CADENCE, "bf16", OuterSettings()),
        (Policy.SYNC, "fp16", OuterSettings()),
        (Policy.CADENCE, "bf16", NESTEROV),
    ],
)
async def test_compressed_rounds_leave_the_ranks_bitwise_identical(
    tmp_path: Path, policy: Policy, dtype: str, outer: OuterSettings
) -> None:
    reports, models = await run_pair(tmp_path, policy, outer, average_dtype=dtype)
    rounds = [{h["round"]: h for h in r["param_hashes"]} for r in reports]
    assert rounds[0].keys() == rounds[1].keys() and len(rounds[0]) >= 3
    for number, mine in rounds[0].items():
        assert mine["sha256"] == rounds[1][number]["sha256"], f"round {number}"
    compressed = [rounds[0][n].get("compressed", False) for n in sorted(rounds[0])]
    assert compressed[0] is False  # the first round sets the reference
    assert all(compressed[1:]), compressed
    assert tensors_sha256(list(models[0].parameters())) == tensors_sha256(
        list(models[1].parameters())
    )


def test_an_unknown_average_dtype_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="average_dtype must be one of"):
        worker_config("memory://x", 0, 1, tmp_path, average_dtype="int8")
