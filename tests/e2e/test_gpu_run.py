"""`flodl run` on a GPU with the nccl backend (skipped where there is no CUDA device).

A device machine has one GPU, and NCCL refuses two ranks on one device, so this is a world
of one: it still runs the whole rank path on CUDA (the backend choice, the group on GPU
``LOCAL_RANK``, rounds on device tensors, the end-of-round pass's torch path, a clean exit).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl.backends.nccl import nccl_usable
from flodl.config import CoordinatorConfig
from flodl.core.common.policy import Policy
from flodl.launch.config import LaunchConfig
from flodl.launch.launcher import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nccl_usable(), reason="needs a torch build with NCCL and a GPU"),
]

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.py"


@pytest.mark.parametrize(
    ("backend", "policy"), [("nccl", "cadence"), ("auto", "cadence"), ("nccl", "async")]
)
async def test_one_gpu_rank_trains_digits_over_nccl(
    tmp_path: Path, backend: str, policy: str
) -> None:
    config = LaunchConfig(
        script=str(DIGITS),
        script_args=("--device", "cuda", "--epochs", "3"),
        nproc=1,
        backend=backend,
        coordinator=CoordinatorConfig(policy=Policy(policy)),
        run_dir=tmp_path / "run",
        echo=False,
    )
    summary = await launch(config)
    log = (tmp_path / "run" / "rank0.log").read_text()
    assert summary["status"] == "completed", summary["message"] + "\n" + log
    (rank,) = summary["ranks"]
    assert rank["exit_code"] == 0, log
    assert rank["syncs"] >= 1
    assert rank["final_metrics"]["test_accuracy"] >= 0.85
