"""Device binding, checked when a rank joins: a rank past its host's GPUs, or a model with a
tensor off the backend's device, is a ConfigError that names what to change, not an error (or
every rank on GPU 0) at the first round. No GPU here: the devices are compared, never used
(the meta device stands in for a second device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from flodl.backends.devices import check_model_devices, gpu_for, named_tensors, on_device
from flodl.config import CoordinatorConfig
from flodl.coordinator.server import open_coordinator
from flodl.errors import ConfigError
from flodl.worker.runtime import open_worker
from tests.worker.test_facade import KEY, facade_config

SPLIT = r"body\.weight is on cpu and marker on meta: the gloo backend averages a model that"


def test_a_local_rank_past_the_gpus_is_refused_not_wrapped_around() -> None:
    assert gpu_for(1, 2) == torch.device("cuda", 1)
    with pytest.raises(
        ConfigError, match=r"LOCAL_RANK 2 has no GPU: torch sees 2 \(cuda:0..cuda:1\)"
    ):
        gpu_for(2, 2)  # 2 % 2 would put it on GPU 0, beside rank 0
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES"):
        gpu_for(5, 4)
    with pytest.raises(ConfigError, match="torch sees none"):
        gpu_for(0, 0)


class Marked(torch.nn.Module):
    """A model with a second device's tensor among its own (a stray buffer, a marker)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(3, 2)
        self.marker = torch.nn.Parameter(torch.empty(1, device="meta"))


def test_a_cpu_model_is_refused_by_a_gpu_backend_naming_both_devices() -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(
        ConfigError, match=r"weight is on cpu, but the nccl backend averages on cuda:1"
    ):
        check_model_devices(named_tensors(model), torch.device("cuda", 1), "nccl")


def test_a_model_split_across_devices_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=SPLIT,
    ):
        check_model_devices(named_tensors(Marked()), None, "gloo")
    check_model_devices(named_tensors(torch.nn.Linear(3, 2)), None, "gloo")  # one device: fine


def test_binding_a_thread_is_for_cuda_only() -> None:
    def work(x: int) -> int:
        return x + 1

    assert on_device(torch.device("cpu"), work) is work
    assert on_device(None, work) is work
    assert on_device(torch.device("cuda", 3), work) is not work


async def test_join_refuses_a_model_off_the_backend_s_device(tmp_path: Path) -> None:
    config = CoordinatorConfig(heartbeat_interval=0.2, heartbeat_timeout=5.0)
    with trio.fail_after(30):
        async with open_coordinator("tcp://127.0.0.1:0", 1, KEY, config, linger=0) as coordinator:
            with pytest.raises(ConfigError, match=SPLIT):
                async with open_worker(facade_config(coordinator.url, tmp_path), Marked()):
                    raise AssertionError("joined with a model on two devices")
