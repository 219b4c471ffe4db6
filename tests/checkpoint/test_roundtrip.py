"""Bundles keep model and optimizer state bit for bit; training goes on as if never saved."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.checkpoint import load_bundle, save_bundle
from flodl.errors import CheckpointError

from .helpers import make_meta

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )


def batches(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
) -> None:
    for _ in range(steps):
        x, y = next(data)
        opt.zero_grad()
        torch.autograd.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()


def assert_same_tensors(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.95), weight_decay=1e-4),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_continues_identically_after_load(tmp_path: Path, name: str) -> None:
    factory = OPTIMIZERS[name]
    model = make_model()
    opt = factory(model.parameters())
    data = batches(1)
    train(model, opt, data, 5)

    save_bundle(
        tmp_path,
        "s",
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        meta=make_meta(),
        config={"optimizer": name, "lr": 0.05},
    )
    bundle = load_bundle(tmp_path)

    assert_same_tensors(bundle.model_state, model.state_dict())
    assert bundle.model_state["1.num_batches_tracked"].dtype == torch.int64
    assert bundle.optimizer_state is not None
    saved_opt = opt.state_dict()
    assert bundle.optimizer_state["param_groups"] == saved_opt["param_groups"]
    assert (
        sorted(bundle.optimizer_state["state"]) == sorted(saved_opt["state"]) == [0, 1, 2, 3, 4, 5]
    )
    for pid, per_param in saved_opt["state"].items():
        assert_same_tensors(bundle.optimizer_state["state"][pid], per_param)
    assert bundle.config == {"optimizer": name, "lr": 0.05}

    resumed = make_model()
    resumed.load_state_dict(bundle.model_state)
    resumed_opt = factory(resumed.parameters())
    resumed_opt.load_state_dict(bundle.optimizer_state)
    twin_data, resumed_data = batches(2), batches(2)
    for _ in range(3):
        train(model, opt, twin_data, 1)
        train(resumed, resumed_opt, resumed_data, 1)
        assert_same_tensors(resumed.state_dict(), model.state_dict())


def test_awkward_tensors_and_values(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    model_state = {
        "tied.a": base,
        "tied.b": base,  # same storage (tied weights)
        "transposed": base.t(),  # non-contiguous view
        "row": base[1],  # view at an offset
        "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(7, dtype=torch.int64),
    }
    optimizer_state = {
        "state": {0: {"buf": base, "step": torch.tensor(3.0)}, "named": {"x": 1}},
        "param_groups": [
            {"lr": math.inf, "eps": math.nan, "betas": (0.9, 0.99), "params": [0], "f": None}
        ],
    }
    save_bundle(
        tmp_path, "odd", model_state=model_state, optimizer_state=optimizer_state, meta=make_meta()
    )
    bundle = load_bundle(tmp_path / "odd")
    assert_same_tensors(bundle.model_state, {k: v.contiguous() for k, v in model_state.items()})
    loaded = bundle.optimizer_state
    assert loaded is not None
    assert torch.equal(loaded["state"][0]["buf"], base)
    assert loaded["state"]["named"] == {"x": 1}
    group = loaded["param_groups"][0]
    assert group["lr"] == math.inf and math.isnan(group["eps"])
    assert group["betas"] == (0.9, 0.99) and isinstance(group["betas"], tuple)
    assert (group["params"], group["f"]) == ([0], None)
    assert bundle.config is None


def test_unsaveable_values_are_refused_before_writing(tmp_path: Path) -> None:
    meta = make_meta()
    with pytest.raises(
        CheckpointError, match=r"state at param_groups\.0\.fn holds a builtin_function"
    ):
        save_bundle(
            tmp_path,
            "s",
            model_state={},
            optimizer_state={"param_groups": [{"fn": len}]},
            meta=meta,
        )
    with pytest.raises(CheckpointError, match=r"'extra' is a str, not a tensor"):
        save_bundle(tmp_path, "s", model_state={"extra": "x"}, optimizer_state=None, meta=meta)  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match="config cannot be written as JSON"):
        save_bundle(
            tmp_path, "s", model_state={}, optimizer_state=None, meta=meta, config={"f": {1, 2}}
        )
    with pytest.raises(CheckpointError, match="stem"):
        save_bundle(tmp_path, "a/b", model_state={}, optimizer_state=None, meta=meta)
    assert list(tmp_path.iterdir()) == []


def test_bundle_files_and_manifest(tmp_path: Path) -> None:
    path = save_bundle(
        tmp_path,
        "flodl-step000000120",
        model_state={"w": torch.ones(2)},
        optimizer_state={"state": {}, "param_groups": []},
        meta=make_meta(),
        config={"world_size": 3},
    )
    assert path == tmp_path / "flodl-step000000120"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "flodl-step000000120.config.json",
        "flodl-step000000120.meta.json",
        "flodl-step000000120.model.safetensors",
        "flodl-step000000120.optim.json",
        "flodl-step000000120.optim.safetensors",
        "latest.json",
    ]
    assert json.loads((tmp_path / "latest.json").read_text()) == {"stem": "flodl-step000000120"}
    meta = json.loads((tmp_path / "flodl-step000000120.meta.json").read_text())
    assert meta["schema_version"] == 3 and meta["global_step"] == 120
    assert sorted(meta["files"]) == ["config", "model", "optim_structure", "optim_tensors"]
    model_entry = meta["files"]["model"]
    assert model_entry["file"] == "flodl-step000000120.model.safetensors"
    assert model_entry["bytes"] == (tmp_path / model_entry["file"]).stat().st_size
    assert load_bundle(tmp_path / "flodl-step000000120.meta.json").meta.global_step == 120
