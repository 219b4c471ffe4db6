"""``stop(reason)`` from a script and the ``max_time`` budget end the run for every rank with
one model: a coordinator and two real workers in one trio run (memory transport, real gloo
groups); the final bundles of the ranks hold bitwise-equal weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from flodl.checkpoint import find_latest, load_bundle
from flodl.config import CoordinatorConfig
from flodl.core.common.policy import Policy
from flodl.core.coordinator.machine import Status
from flodl.worker import WorkerConfig, open_worker
from flodl.worker.records import tensors_sha256
from tests.worker.test_inprocess import run_two_ranks

DATASET, BATCH, EPOCHS = 4096, 4, 50  # far more than the run will train


async def train_until(
    config: WorkerConfig, model: torch.nn.Module, stop_after: int | None, ms_per_batch: float
) -> dict[str, Any]:
    x = torch.linspace(-1, 1, DATASET * 3).reshape(DATASET, 3)
    y = x.sum(dim=1, keepdim=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    async with open_worker(config, model, optimizer) as worker:
        await worker.announce(DATASET, BATCH, EPOCHS)
        batches = 0
        while (item := await worker.next_batch()) is not None:
            idx = list(item.indices)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            await trio.sleep(ms_per_batch / 1000)
            await worker.batch_done(0.0)
            batches += 1
            if batches == stop_after:
                await worker.stop("the target loss is reached")
        worker.report_final(batches=batches)
    report: dict[str, Any] = json.loads((config.run_dir / f"rank{config.rank}.json").read_text())
    return report


async def run_pair(
    tmp_path: Path, policy: Policy, stop_after: int | None, max_time: float | None = None
) -> tuple[Any, list[dict[str, Any]], list[torch.nn.Module]]:
    coordinator_config = CoordinatorConfig(
        policy=policy, heartbeat_interval=0.2, heartbeat_timeout=5.0, anchor=3, max_time=max_time
    )

    async def train_rank(config: WorkerConfig, model: torch.nn.Module) -> dict[str, Any]:
        # rank 1 is the slower one, and the one that stops the run
        slower = config.rank == 1
        return await train_until(
            config, model, stop_after if slower else None, 2.0 + 3 * config.rank
        )

    return await run_two_ranks(tmp_path, coordinator_config, train_rank)


def assert_one_model(tmp_path: Path, reports: list[dict[str, Any]], models: list[Any]) -> None:
    for report in reports:
        assert report["exit_reason"] == "completed"
    final = [tensors_sha256(list(m.parameters())) for m in models]
    assert final[0] == final[1]
    bundles = []
    for rank in range(2):
        latest = find_latest(tmp_path / "checkpoints" / f"rank{rank}")
        assert latest is not None, f"rank {rank} saved no bundle"
        bundles.append(load_bundle(latest))
    first, second = (b.model_state for b in bundles)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert tensors_sha256(list(first.values())) == tensors_sha256(
        list(models[0].state_dict().values())
    )


@pytest.mark.parametrize("policy", [Policy.SYNC, Policy.CADENCE, Policy.ASYNC])
async def test_a_scripts_stop_ends_every_rank_with_one_model(
    policy: Policy, tmp_path: Path
) -> None:
    outcome, reports, models = await run_pair(tmp_path, policy, stop_after=30)
    assert outcome.status is Status.COMPLETED, outcome
    assert outcome.message == "rank 1 stopped the training: the target loss is reached"
    assert_one_model(tmp_path, reports, models)
    # The stop ended the run within a window or two, far from its 50 epochs (51,200 batches).
    trained = sum(r["final_metrics"]["batches"] for r in reports)
    assert trained < 1_000, trained


async def test_the_time_budget_ends_every_rank_with_one_model(tmp_path: Path) -> None:
    outcome, reports, models = await run_pair(tmp_path, Policy.CADENCE, None, max_time=1.0)
    assert outcome.status is Status.COMPLETED, outcome
    assert outcome.message == "the time budget (1 s of training) is spent"
    assert_one_model(tmp_path, reports, models)
