"""The bucketed round: plan, checksums, and real gloo pairs (one process) cut into tiny buckets.

Every result is checked bitwise against the mass rule as a pre-scaled round computes it (each
rank's share ``p * m / M`` multiplied in float64 and rounded once, then summed), and the
norms against float64 references.
"""

from __future__ import annotations

import math
import struct
from collections.abc import AsyncIterator, Sequence

import pytest
import torch
import trio

from flodl.averaging.kernels import NormSample
from flodl.averaging.mass import FlatLayout, bit_checksum, checksum_part, combine_checksums
from flodl.backends.base import AverageResult
from flodl.backends.gloo import GlooBackend
from flodl.backends.pipeline import BucketPlan, Piece
from flodl.backends.torch_backend import Comm, _GroupVerifyFailed
from flodl.errors import BackendError

Model = tuple[list[torch.Tensor], list[torch.Tensor]]


def pair_of(bucket_elements: int | None) -> list[GlooBackend]:
    return [
        GlooBackend(
            op_timeout=1.0, join_timeout=10.0, verify_every=1, bucket_elements=bucket_elements
        )
        for _ in range(2)
    ]


@pytest.fixture
async def tiny_buckets() -> AsyncIterator[list[GlooBackend]]:
    backends = pair_of(4)
    try:
        yield backends
    finally:
        for backend in backends:
            await backend.close()


async def form(backends: Sequence[GlooBackend], generation: int) -> None:
    info = backends[0].prepare_group(generation, "127.0.0.1")
    async with trio.open_nursery() as nursery:
        for rank, backend in enumerate(backends):
            nursery.start_soon(backend.join_group, info, rank, len(backends), generation)


def random_model(seed: int) -> Model:
    g = torch.Generator().manual_seed(seed)
    params = [
        torch.randn(3, 5, generator=g),
        torch.zeros(0),  # an empty parameter lies in no bucket
        torch.randn(7, generator=g),
        torch.randn(2, generator=g),
    ]
    buffers = [torch.randn(3, generator=g), torch.tensor(seed, dtype=torch.int64)]
    return params, buffers


def copy_model(model: Model) -> Model:
    return [p.clone() for p in model[0]], [b.clone() for b in model[1]]


def reference_average(models: list[Model], batches: list[int]) -> torch.Tensor:
    """The finished flat average of two ranks (gamma 1): the summed mass and movers, then
    the sum of each rank's shares, each product taken in float64 and rounded once."""
    layout = FlatLayout.of(*models[0])
    total = torch.zeros(layout.total)
    mass, movers = sum(batches), sum(1 for n in batches if n > 0)
    total[0], total[1] = mass, movers
    for (params, buffers), n in zip(models, batches, strict=True):
        shares = [
            (p, n / mass, span) for p, span in zip(params, layout.param_ranges(), strict=True)
        ]
        shares += [
            (b, (1.0 if n > 0 else 0.0) / movers, span)
            for b, span in zip(buffers, layout.buffer_ranges(), strict=True)
            if span is not None
        ]
        for tensor, share, (start, end) in shares:
            total[start:end] += (tensor.reshape(-1).double() * share).float()
    return total


async def average_all(
    backends: Sequence[GlooBackend], models: list[Model], batches: list[int]
) -> list[AverageResult]:
    results: list[AverageResult | None] = [None] * len(backends)

    async def one(index: int) -> None:
        params, buffers = models[index]
        results[index] = await backends[index].average(params, buffers, batches[index])

    async with trio.open_nursery() as nursery:
        for index in range(len(backends)):
            nursery.start_soon(one, index)
    return [r for r in results if r is not None]


def norm64(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


# --- plan and checksums ----------------------------------------------------------------------


def test_plan_cuts_on_even_elements_and_splits_members() -> None:
    params = [torch.zeros(3), torch.zeros(5)]
    buffers = [torch.zeros(2), torch.zeros((), dtype=torch.int64)]
    layout = FlatLayout.of(params, buffers)  # [mass mover | p0 x3 | p1 x5 | b0 x2] = 12
    plan = BucketPlan.of(layout, 5)  # rounded up to 6
    assert [(b.start, b.end) for b in plan.buckets] == [(0, 6), (6, 12)]
    assert plan.buckets[0].pieces == (Piece(0, True, 0, 2, 5), Piece(1, True, 0, 5, 6))
    assert plan.buckets[1].pieces == (Piece(1, True, 1, 6, 10), Piece(2, False, 0, 10, 12))
    whole = BucketPlan.of(layout, None)
    assert [(b.start, b.end) for b in whole.buckets] == [(0, 12)]
    assert len(whole.buckets[0].pieces) == 3
    with pytest.raises(BackendError, match="bucket_elements"):
        BucketPlan.of(layout, 1)
    with pytest.raises(BackendError, match="bucket_elements"):
        GlooBackend(bucket_elements=0)


def test_checksum_parts_add_up_to_the_whole_buffer() -> None:
    flat = torch.randn(11)
    raw = flat.numpy().tobytes()
    words = struct.unpack("<5Q", raw[:40])
    (tail,) = struct.unpack("<i", raw[40:])  # a lone 4-byte tail counts signed
    expected = (sum(words) + tail) % 2**64
    parts = [checksum_part(flat[a:b]) for a, b in ((0, 4), (4, 10), (10, 11))]
    assert combine_checksums(parts) == expected
    signed = expected - 2**64 if expected >= 2**63 else expected
    assert bit_checksum(flat) == signed
    changed = flat.clone()
    changed.view(torch.int32)[9] ^= 1 << 31  # the sign bit of an odd element
    assert bit_checksum(changed) != bit_checksum(flat)
    with pytest.raises(BackendError, match="4- or 8-byte"):
        checksum_part(torch.zeros(4, dtype=torch.float16))


# --- rounds over real gloo pairs ------------------------------------------------------------


async def test_bucketed_round_is_bitwise_the_one_shot_average(
    tiny_buckets: list[GlooBackend],
) -> None:
    await form(tiny_buckets, 0)
    models = [random_model(1), random_model(2)]
    before = [copy_model(m) for m in models]
    batches = [3, 5]
    expected = reference_average(models, batches)
    layout = FlatLayout.of(*models[0])
    assert len(tiny_buckets[0]._plan_for(layout).buckets) == 8  # 2 + 24 + 3 = 29 elements
    results = await average_all(tiny_buckets, models, batches)
    for (params, buffers), (old_params, _), result in zip(models, before, results, strict=True):
        for p, (start, end) in zip(params, layout.param_ranges(), strict=True):
            assert torch.equal(p.reshape(-1), expected[start:end])
        span = layout.buffer_ranges()[0]
        assert span is not None and torch.equal(buffers[0], expected[span[0] : span[1]])
        diffs = [old - new for old, new in zip(old_params, params, strict=True)]
        assert result.pre_norm == pytest.approx(norm64(old_params), rel=1e-5)
        assert result.post_norm == pytest.approx(norm64(params), rel=1e-5)
        assert result.divergence == pytest.approx(norm64(diffs) / norm64(params), rel=1e-4)
        assert (result.total_mass, result.movers) == (8.0, 2)
    assert [int(m[1][1]) for m in models] == [1, 2]  # int buffers keep their local value


async def test_sampled_norms_keep_the_average_bitwise_and_estimate_the_divergence() -> None:
    """With ``norm_sample``, the divergence norms read a fixed sample of each large
    parameter (exact is the default). The average is untouched by it (bitwise the reference
    on both ranks, so the ranks are equal); on drift spread evenly the estimated divergence
    is within 2% of the exact one."""
    g = torch.Generator().manual_seed(9)
    base = [torch.randn(300_000, generator=g), torch.randn(70_000, generator=g)]
    models: list[Model] = [
        ([t + 0.01 * r * torch.randn(t.shape, generator=g) for t in base], []) for r in (1, 2)
    ]
    before = [copy_model(m) for m in models]
    batches = [3, 5]
    expected = reference_average(models, batches)
    layout = FlatLayout.of(*models[0])
    sampled = [
        GlooBackend(op_timeout=5.0, join_timeout=10.0, norm_sample=NormSample()) for _ in range(2)
    ]
    exact = [GlooBackend(op_timeout=5.0, join_timeout=10.0) for _ in range(2)]
    assert sampled[0].norm_sample is not None and exact[0].norm_sample is None
    try:
        await form(sampled, 0)
        await form(exact, 0)
        estimates = await average_all(sampled, models, batches)
        truths = await average_all(exact, before, batches)
    finally:
        for backend in [*sampled, *exact]:
            await backend.close()
    for params, _ in (*models, *before):
        for p, (start, end) in zip(params, layout.param_ranges(), strict=True):
            assert torch.equal(p, expected[start:end])
    for estimate, truth in zip(estimates, truths, strict=True):
        assert estimate.pre_norm == truth.pre_norm  # ||p|| is always exact
        assert estimate.divergence == pytest.approx(truth.divergence, rel=0.02)
        assert estimate.divergence != truth.divergence  # it was sampled
        assert estimate.post_norm == pytest.approx(truth.post_norm, rel=0.01)


async def test_bucketed_zero_mass_round_keeps_local_state(
    tiny_buckets: list[GlooBackend],
) -> None:
    await form(tiny_buckets, 0)
    models = [random_model(3), random_model(4)]
    before = [copy_model(m) for m in models]
    results = await average_all(tiny_buckets, models, [0, 0])
    for (params, buffers), (old_params, old_buffers), result in zip(
        models, before, results, strict=True
    ):
        assert all(torch.equal(a, b) for a, b in zip(params, old_params, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(buffers, old_buffers, strict=True))
        assert result.skipped is True and result.divergence == 0.0
        assert result.pre_norm == result.post_norm
        assert result.pre_norm == pytest.approx(norm64(old_params), rel=1e-6)


async def test_mixed_dtypes_and_strided_params_in_buckets() -> None:
    backends = pair_of(2)
    try:
        await form(backends, 0)

        def model(value: float) -> Model:
            strided = torch.full((2, 3), value).t()  # not contiguous
            assert not strided.is_contiguous()
            params = [
                torch.full((3,), value, dtype=torch.float64),
                torch.full((5,), value, dtype=torch.bfloat16),
                strided,
            ]
            return params, [torch.full((2,), value * 10)]

        models = [model(1.0), model(2.5)]
        await average_all(backends, models, [1, 3])
        expected = (1.0 * 1 + 2.5 * 3) / 4  # 2.125, exact in every dtype here
        for params, buffers in models:
            assert params[0].dtype == torch.float64 and params[1].dtype == torch.bfloat16
            assert params[2].stride() == (1, 3)  # written in place, strides kept
            for p in params:
                assert torch.equal(p, torch.full_like(p, expected))
            assert torch.equal(buffers[0], torch.full((2,), 17.5))
    finally:
        for backend in backends:
            await backend.close()


def lies_in(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[bool]:
    base = flat.untyped_storage().data_ptr()
    return [t.untyped_storage().data_ptr() == base for t in tensors]


async def test_parameters_become_views_of_the_average_and_two_buffers_alternate(
    tiny_buckets: list[GlooBackend],
) -> None:
    await form(tiny_buckets, 0)
    models = [random_model(5), random_model(6)]
    params, buffers = models[0]
    objects = [id(p) for p in params]
    backend = tiny_buckets[0]
    await average_all(tiny_buckets, models, [1, 1])
    first = backend._installed
    assert first is not None and backend._pool._idle == []
    assert lies_in(params, first.flat) == [True] * 4  # no copy: views of the averaged buffer
    assert lies_in(buffers, first.flat) == [False, False]  # buffers are copied
    assert [id(p) for p in params] == objects  # the same tensor objects
    await average_all(tiny_buckets, models, [1, 1])
    second = backend._installed
    assert second is not None and second is not first
    assert backend._pool._idle == [first]  # free again: no parameter lies in it
    await average_all(tiny_buckets, models, [1, 1])
    assert backend._installed is first and backend._pool._idle == [second]

    before = copy_model(models[0])
    with trio.move_on_after(0.2) as scope:  # peer never enters: every bucket is left pending
        await backend.average(params, buffers, 2)
    assert scope.cancelled_caught
    assert all(torch.equal(a, b) for a, b in zip(params, before[0], strict=True))
    assert backend._pool._idle == []  # the abandoned ops may still write into it: dropped
    assert backend._installed is first

    await form(tiny_buckets, 1)
    await average_all(tiny_buckets, models, [1, 1])
    assert all(
        torch.equal(a, b) for a, b in zip(models[0][0], models[1][0], strict=True)
    )  # averaged again, identical


async def test_swapped_parameters_keep_training_and_copying_is_a_setting() -> None:
    for swap in (True, False):
        backends = [
            GlooBackend(op_timeout=1.0, join_timeout=10.0, swap_parameters=swap) for _ in range(2)
        ]
        try:
            await form(backends, 0)
            torch.manual_seed(0)
            nets = [torch.nn.Linear(4, 3) for _ in range(2)]
            optimizers = [torch.optim.Adam(net.parameters(), lr=0.1) for net in nets]
            for net, optimizer in zip(nets, optimizers, strict=True):
                net(torch.randn(8, 4)).square().sum().backward()
                optimizer.step()
            addresses = [p.data_ptr() for p in nets[0].parameters()]
            models: list[Model] = [(list(net.parameters()), []) for net in nets]
            await average_all(backends, models, [1, 1])
            moved = [
                p.data_ptr() != a for p, a in zip(nets[0].parameters(), addresses, strict=True)
            ]
            assert moved == [swap, swap]
            assert all(isinstance(p, torch.nn.Parameter) for p in nets[0].parameters())
            averaged = [p.detach().clone() for p in nets[0].parameters()]
            # The optimizer (state keyed by Parameter) goes on updating the live tensors.
            nets[0](torch.randn(8, 4)).square().sum().backward()
            optimizers[0].step()
            after = list(nets[0].parameters())
            assert all(not torch.equal(a, b) for a, b in zip(after, averaged, strict=True))
        finally:
            for backend in backends:
                await backend.close()


async def test_background_round_in_buckets_blends(tiny_buckets: list[GlooBackend]) -> None:
    await form(tiny_buckets, 0)
    models: list[Model] = [
        ([torch.full((9,), 1.0)], [torch.full((3,), 5.0)]),
        ([torch.full((9,), 3.0)], [torch.full((3,), 7.0)]),
    ]
    async with trio.open_nursery() as nursery:
        pendings = [
            await backend.start_background_average(nursery, params, buffers, 1)
            for backend, (params, buffers) in zip(tiny_buckets, models, strict=True)
        ]
        for params, _ in models:
            params[0].add_(1.0)  # training goes on: 2.0 and 4.0
        for pending in pendings:
            await pending.wait()
    for pending, (params, buffers) in zip(pendings, models, strict=True):
        pending.blend_into(params, buffers, alpha=0.5)
    assert torch.equal(models[0][0][0], torch.full((9,), 2.0))  # (2 + 2) / 2
    assert torch.equal(models[1][0][0], torch.full((9,), 3.0))  # (4 + 2) / 2
    assert all(torch.equal(b[0], torch.full((3,), 6.0)) for _, b in models)
    assert len(tiny_buckets[0]._pool._idle) == 1  # handed back after the blend


@pytest.mark.parametrize(
    ("checksums", "agree"),
    [
        ((2**64 - 1, 2**64 - 1), True),  # the top half alone would overflow an int64 negation
        ((0, 0), True),
        ((2**63, 0), False),
        ((5, 5 + 2**32), False),
    ],
)
async def test_verify_collective_compares_full_64_bit_checksums(
    tiny_buckets: list[GlooBackend], checksums: tuple[int, int], agree: bool
) -> None:
    await form(tiny_buckets, 0)
    outcomes: list[str] = ["", ""]

    def verify(index: int) -> None:
        backend = tiny_buckets[index]
        assert backend._current is not None and backend._current.comm is not None
        try:
            backend._verify(backend._current.comm, checksums[index], torch.device("cpu"))
            outcomes[index] = "agree"
        except _GroupVerifyFailed:
            outcomes[index] = "differ"

    async with trio.open_nursery() as nursery:
        for index in range(2):
            nursery.start_soon(trio.to_thread.run_sync, verify, index)
    assert outcomes == ["agree" if agree else "differ"] * 2


class CountingVerify(GlooBackend):
    """Records which rounds of the current generation ran the verify collective."""

    def __init__(self, verify_every: int) -> None:
        super().__init__(op_timeout=1.0, join_timeout=10.0, verify_every=verify_every)
        self.verified: list[int] = []

    def _verify(self, comm: Comm, checksum: int, device: torch.device) -> None:
        assert self._current is not None
        self.verified.append(self._current.rounds - 1)
        super()._verify(comm, checksum, device)


async def test_verify_runs_on_the_first_round_of_a_generation_then_every_nth() -> None:
    backends = [CountingVerify(verify_every=3) for _ in range(2)]
    try:
        await form(backends, 0)
        models = [random_model(7), random_model(8)]
        for _ in range(7):
            await average_all(backends, models, [1, 2])
        assert [b.verified for b in backends] == [[0, 3, 6]] * 2
        await form(backends, 1)  # a new generation starts its count again
        for _ in range(2):
            await average_all(backends, models, [1, 2])
        assert [b.verified for b in backends] == [[0, 3, 6, 0]] * 2
        with pytest.raises(BackendError, match="verify_every"):
            GlooBackend(verify_every=0)
    finally:
        for backend in backends:
            await backend.close()
