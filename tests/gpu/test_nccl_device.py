"""The NCCL backend on a real GPU: what the CPU tests cannot reach (``.ci/device-check`` runs
this file; it skips where torch has no NCCL or no GPU, as in CI).

A device machine has one GPU and NCCL refuses two ranks on one device, so the NCCL groups here
are worlds of one; several ranks on the one GPU run over gloo, which reduces CUDA tensors and
so exercises the device binding and stream ordering all the same.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import torch
import trio

from flodl.backends.gloo import GlooBackend
from flodl.backends.nccl import ERROR_HANDLING_ENV, NcclBackend, nccl_usable
from flodl.config import CoordinatorConfig
from flodl.coordinator.server import open_coordinator
from flodl.errors import ConfigError
from flodl.worker.runtime import open_worker
from tests.backends.test_inprocess import form
from tests.worker.test_facade import KEY, facade_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not nccl_usable(), reason="needs a torch build with NCCL and a GPU"),
]


async def test_a_zero_size_parameter_and_a_bf16_model_average_on_the_gpu() -> None:
    backend = NcclBackend(op_timeout=30.0, verify_every=1)
    try:
        await form([backend], 0)
        device = backend.device
        for dtype in (torch.float32, torch.bfloat16):
            params = [
                torch.full((5,), 2.0, device=device, dtype=dtype),
                torch.empty(0, device=device, dtype=dtype),  # a device marker
            ]
            buffers = [torch.full((2,), 4.0, device=device, dtype=dtype)]
            result = await backend.average(params, buffers, batches=3)
            assert result.total_mass == 3.0 and result.divergence == 0.0
            assert torch.equal(params[0].float().cpu(), torch.full((5,), 2.0))
            assert params[1].numel() == 0 and params[1].device == device
    finally:
        await backend.close()
    assert os.environ[ERROR_HANDLING_ENV] == "2"  # owned by the backend, whatever was set


async def test_three_groups_formed_aborted_and_retired_in_one_process() -> None:
    backend = NcclBackend(op_timeout=20.0, verify_every=1)
    try:
        params = [torch.ones(1 << 16, device="cuda")]
        for generation in range(3):
            await form([backend], generation)
            await backend.average(params, [], batches=1)
            # Broken as by a dead peer: the abort runs off the event loop.
            current = backend._groups.current
            assert current is not None
            backend._groups.break_(current)
            assert backend.broken
        await form([backend], 3)
        await backend.average(params, [], batches=1)
        assert torch.equal(params[0].cpu(), torch.ones(1 << 16))
    finally:
        with trio.fail_after(60):
            await backend.close()


async def test_cpu_parameters_are_refused_by_nccl_at_join(tmp_path: Path) -> None:
    config = CoordinatorConfig(heartbeat_interval=0.2, heartbeat_timeout=5.0)
    with trio.fail_after(60):
        async with open_coordinator("tcp://127.0.0.1:0", 1, KEY, config, linger=0) as coord:
            on_nccl = attrs.evolve(facade_config(coord.url, tmp_path), backend="nccl")
            with pytest.raises(ConfigError, match="weight is on cpu, but the nccl backend"):
                async with open_worker(on_nccl, torch.nn.Linear(3, 2)):
                    raise AssertionError("joined with CPU parameters on nccl")


async def test_two_ranks_on_the_one_gpu_over_gloo_with_a_side_stream() -> None:
    backends = [GlooBackend(op_timeout=30.0, join_timeout=30.0, verify_every=1) for _ in range(2)]
    try:
        await form(backends, 0)
        models = [[torch.full((1 << 16,), float(v), device="cuda")] for v in (1, 3)]
        for backend, params in zip(backends, models, strict=True):
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(side):  # a loop that steps under its own stream
                params[0].mul_(2.0).div_(2.0)
            backend.steps.mark(params[0].device)
        async with trio.open_nursery() as nursery:
            for backend, params in zip(backends, models, strict=True):
                nursery.start_soon(backend.average, params, [], 1)
        for params in models:
            assert torch.equal(params[0].cpu(), torch.full((1 << 16,), 2.0))
    finally:
        for backend in backends:
            await backend.close()
