"""The outer optimizer in real workers: a coordinator and two ranks in one trio run (memory
transport, real gloo groups). The rank's side of :mod:`flodl.averaging.outer`: every round
leaves the outer state bitwise equal on every rank, it is saved in the bundle and restored by a
resume (into another number of ranks too)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.averaging.outer import OuterOptimizer, OuterSettings
from flodl.checkpoint import find_latest, load_bundle
from flodl.config import CoordinatorConfig
from flodl.core.common.policy import Policy
from flodl.core.coordinator.machine import Status
from flodl.errors import CheckpointError
from flodl.worker import WorkerConfig
from flodl.worker.persist import SavePoint, save_rank_bundle
from flodl.worker.records import tensors_sha256
from tests.worker.test_inprocess import make_model, run_two_ranks, train

NESTEROV = OuterSettings("nesterov", 0.7, 0.9)
SGD = OuterSettings("sgd")  # the run default: lr 1.5, no momentum buffer


async def run_pair(
    tmp_path: Path, policy: Policy, outer: OuterSettings, **worker: Any
) -> tuple[list[dict[str, Any]], list[torch.nn.Module]]:
    """Two ranks (different starting weights) train to the end under ``policy`` and ``outer``;
    their reports and models."""
    coordinator_config = CoordinatorConfig(
        policy=policy,
        heartbeat_interval=0.2,
        heartbeat_timeout=5.0,
        anchor=3,
        outer=outer.kind.value,
        outer_lr=outer.lr,
        outer_momentum=outer.momentum,
    )

    async def train_rank(config: WorkerConfig, model: torch.nn.Module) -> dict[str, Any]:
        return await train(config, model, [])

    outcome, reports, models = await run_two_ranks(
        tmp_path, coordinator_config, train_rank, outer=outer, **worker
    )
    assert outcome.status is Status.COMPLETED, outcome
    return reports, models


@pytest.mark.parametrize(
    ("policy", "outer"),
    [
        (Policy.SYNC, NESTEROV),
        (Policy.CADENCE, NESTEROV),
        (Policy.ASYNC, NESTEROV),
        (Policy.CADENCE, SGD),
        (Policy.ASYNC, SGD),
    ],
    ids=["sync-nesterov", "cadence-nesterov", "async-nesterov", "cadence-sgd", "async-sgd"],
)
async def test_every_round_leaves_the_outer_state_equal_on_every_rank(
    policy: Policy, outer: OuterSettings, tmp_path: Path
) -> None:
    reports, models = await run_pair(tmp_path, policy, outer)
    rounds = [{h["round"]: h for h in r["param_hashes"]} for r in reports]
    assert rounds[0].keys() == rounds[1].keys() and len(rounds[0]) >= 3
    versions = []
    for number, mine in rounds[0].items():
        theirs = rounds[1][number]
        assert (mine["outer_version"], mine["outer_sha256"]) == (
            theirs["outer_version"],
            theirs["outer_sha256"],
        ), f"round {number}"
        if policy is not Policy.ASYNC:  # async blends into each rank's own weights
            assert mine["sha256"] == theirs["sha256"], f"round {number}"
        versions.append(mine["outer_version"])
    # One outer step per round: the first round set g (version 0).
    assert versions == list(range(len(versions)))
    # The bundle each rank saved at the end holds the same outer state.
    states = [load_bundle(_latest(tmp_path, rank)).outer_state for rank in range(2)]
    assert states[0].keys() == states[1].keys() and "global.0" in states[0]
    assert ("momentum.0" in states[0]) is (outer.momentum > 0)  # sgd keeps no momentum
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert int(states[0]["version"]) == versions[-1]
    if policy is not Policy.ASYNC:
        assert tensors_sha256(list(models[0].parameters())) == tensors_sha256(
            list(models[1].parameters())
        )


async def test_plain_averaging_keeps_and_saves_no_outer_state(tmp_path: Path) -> None:
    reports, _ = await run_pair(tmp_path, Policy.CADENCE, OuterSettings())
    assert all("outer_sha256" not in h for r in reports for h in r["param_hashes"])
    assert load_bundle(_latest(tmp_path, 0)).outer_state == {}
    assert not list(tmp_path.rglob("*.outer.safetensors"))


async def test_a_resume_into_another_rank_count_restores_the_outer_state(
    tmp_path: Path,
) -> None:
    # A one-rank run's bundle, taken at outer version 5, is resumed by two ranks.
    saved_model = make_model(seed=7)
    outer = OuterOptimizer(NESTEROV)
    generator = torch.Generator().manual_seed(3)
    for _ in range(6):
        outer.step(
            [
                p.detach() + torch.randn(p.shape, generator=generator)
                for p in saved_model.parameters()
            ]
        )
    source = tmp_path / "source"
    save_rank_bundle(
        source,
        0,
        saved_model,
        None,
        SavePoint(3, 60, 6, 1, "GRACEFUL"),
        outer_state=outer.state_dict(),
    )
    assert load_bundle(_latest(source, 0)).outer_state.keys() == outer.state_dict().keys()

    run_dir = tmp_path / "resumed"
    reports, _ = await run_pair(run_dir, Policy.SYNC, NESTEROV, resume=_latest(source, 0))
    for report in reports:
        first = report["param_hashes"][0]
        assert first["outer_version"] == 6  # continued from the saved version 5
    assert (
        reports[0]["param_hashes"][0]["outer_sha256"]
        == reports[1]["param_hashes"][0]["outer_sha256"]
    )


async def test_a_resume_refuses_an_outer_state_that_does_not_fit(tmp_path: Path) -> None:
    other = torch.nn.Linear(2, 2)
    outer = OuterOptimizer(NESTEROV)
    outer.step([p.detach().clone() for p in other.parameters()])
    model = make_model(seed=0)
    save_rank_bundle(
        tmp_path / "source",
        0,
        model,
        None,
        SavePoint(1, 4, 1, 1, "GRACEFUL"),
        outer_state=outer.state_dict(),
    )
    with pytest.raises(ExceptionGroup) as caught:
        await run_pair(
            tmp_path / "run", Policy.SYNC, NESTEROV, resume=_latest(tmp_path / "source", 0)
        )
    assert caught.group_contains(
        CheckpointError,
        match="does not fit: the saved outer state holds 5 tensors, which do not fit the 4 param",
    )


def _latest(run_dir: Path, rank: int) -> Path:
    latest = find_latest(run_dir / "checkpoints" / f"rank{rank}")
    assert latest is not None, f"rank {rank} saved no bundle"
    return latest
