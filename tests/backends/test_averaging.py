"""The mass rule and its flat-buffer layout, in one process (the all-reduce is a plain sum)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.averaging.mass import (
    FlatLayout,
    apply_average,
    bit_checksum,
    easgd_blend,
    finish_average,
    local_norms,
    mass_of,
    mover_of,
    pack,
    read_sums,
    relative_divergence,
)
from flodl.errors import BackendError


def make_rank(
    value: float, buffer: float, counter: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    params = [torch.full((3,), value), torch.full((2, 2), value)]
    buffers = [torch.full((2,), buffer), torch.tensor(counter, dtype=torch.int64)]
    return params, buffers


def simulate_round(
    ranks: list[tuple[list[torch.Tensor], list[torch.Tensor]]], batches: list[int], gamma: float
) -> list[tuple[bool, float]]:
    """Pack every rank, sum the flats (what SUM all-reduce does), finish and apply on each."""
    layout = FlatLayout.of(*ranks[0])
    flats = [pack(p, b, layout, n, gamma) for (p, b), n in zip(ranks, batches, strict=True)]
    total = torch.stack(flats).sum(dim=0)
    out = []
    for params, buffers in ranks:
        flat = total.clone()
        reduced = read_sums(flat, layout)
        if reduced.total_mass > 0:
            finish_average(flat, layout, reduced)
            applied = apply_average(flat, layout, params, buffers)
            out.append((False, applied.divergence))
        else:
            out.append((True, local_norms(params).divergence))
    return out


@pytest.mark.parametrize(
    ("batches", "gamma", "expected"),
    [
        (4, 1.0, 4.0),
        (4, 0.0, 1.0),
        (4, -1.0, 0.25),
        (9, 0.5, 3.0),
        (0, 1.0, 0.0),
        (0, 0.0, 0.0),
        (0, -1.0, 0.0),
    ],
)
def test_mass_is_n_to_the_gamma_and_zero_without_batches(
    batches: int, gamma: float, expected: float
) -> None:
    assert mass_of(batches, gamma) == expected


def test_mover_and_bad_batches() -> None:
    assert (mover_of(0), mover_of(1), mover_of(50)) == (0.0, 1.0, 1.0)
    with pytest.raises(BackendError):
        mass_of(-1, 1.0)


def test_relative_divergence_is_zero_for_a_vanishing_post_norm() -> None:
    assert relative_divergence(3.0, 6.0) == 0.5
    assert relative_divergence(3.0, 1e-11) == 0.0


def test_gamma_one_weights_by_batches_and_buffers_by_mover() -> None:
    ranks = [make_rank(1.0, 10.0, 5), make_rank(2.0, 20.0, 6), make_rank(3.0, 30.0, 7)]
    simulate_round(ranks, [0, 1, 3], gamma=1.0)
    for index, (params, buffers) in enumerate(ranks):
        for p in params:
            assert torch.equal(p, torch.full_like(p, (2 * 1 + 3 * 3) / 4))  # 2.75, exact
        # rank 0 did not move: its buffer does not count; movers are ranks 1 and 2
        assert torch.equal(buffers[0], torch.full((2,), 25.0))
        assert int(buffers[1]) == 5 + index  # integer buffers keep their local value


def test_gamma_zero_is_the_plain_mean_of_movers() -> None:
    ranks = [make_rank(1.0, 0.0, 0), make_rank(2.0, 0.0, 0), make_rank(6.0, 0.0, 0)]
    simulate_round(ranks, [1, 7, 100], gamma=0.0)
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for r in ranks for p in r[0])


def test_gamma_minus_one_weights_per_step() -> None:
    ranks = [make_rank(1.0, 0.0, 0), make_rank(2.0, 0.0, 0), make_rank(3.0, 0.0, 0)]
    simulate_round(ranks, [1, 2, 4], gamma=-1.0)
    expected = (1 * 1 + 2 * 0.5 + 3 * 0.25) / 1.75
    for params, _ in ranks:
        for p in params:
            assert torch.allclose(p, torch.full_like(p, expected), rtol=1e-6, atol=0)


def test_zero_mass_round_keeps_local_state() -> None:
    ranks = [make_rank(1.0, 10.0, 1), make_rank(2.0, 20.0, 2)]
    outcome = simulate_round(ranks, [0, 0], gamma=1.0)
    assert outcome == [(True, 0.0), (True, 0.0)]
    assert torch.equal(ranks[0][0][0], torch.full((3,), 1.0))
    assert torch.equal(ranks[1][1][0], torch.full((2,), 20.0))


def test_divergence_and_norms_are_reported() -> None:
    params = [torch.tensor([3.0, 4.0])]
    buffers: list[torch.Tensor] = []
    layout = FlatLayout.of(params, buffers)
    flat = torch.tensor([1.0, 1.0, 6.0, 8.0])  # mass, mover, finished average (6, 8)
    applied = apply_average(flat, layout, params, buffers)
    assert applied.pre_norm == 5.0 and applied.post_norm == 10.0
    assert applied.diff_norm == 5.0 and applied.divergence == 0.5


def test_easgd_blend_pulls_halfway_and_overwrites_buffers() -> None:
    params = [torch.tensor([1.5, 3.5])]
    buffers = [torch.tensor([7.0])]
    layout = FlatLayout.of(params, buffers)
    average = torch.tensor([2.0, 2.0, 2.0, 2.0, 9.0])  # mass, mover, params, buffer
    apply_average(average, layout, params, buffers, alpha=0.5)
    assert torch.equal(params[0], torch.tensor([1.75, 2.75]))
    assert torch.equal(buffers[0], torch.tensor([9.0]))
    assert easgd_blend(1.5, 2.0, 0.5) == 1.75
    assert math.isclose(easgd_blend(4.0, 2.0, 0.25), 3.5)
    with pytest.raises(BackendError):
        apply_average(average, layout, params, buffers, alpha=0.0)


def test_layout_promotes_dtypes_and_rejects_bad_tensors() -> None:
    layout = FlatLayout.of([torch.zeros(2, dtype=torch.bfloat16)], [torch.zeros(3)])
    assert layout.dtype == torch.float32 and layout.total == 2 + 2 + 3
    wide = FlatLayout.of([torch.zeros(2, dtype=torch.float64)], [])
    assert wide.dtype == torch.float64
    with pytest.raises(BackendError):
        FlatLayout.of([torch.zeros(2, dtype=torch.int32)], [])


def test_large_members_start_on_64_byte_boundaries_and_the_gaps_stay_zero() -> None:
    params = [torch.full((3,), 1.0), torch.full((2000,), 2.0), torch.full((5,), 3.0)]
    buffers = [torch.full((1024,), 4.0), torch.tensor(7, dtype=torch.int64)]
    layout = FlatLayout.of(params, buffers)
    # Header 2, then 3 elements at 2..5; the 2000-element member is moved up to 16; the small
    # one follows it at once (2016..2021); the 1024-element buffer starts at 2032.
    assert layout.param_ranges() == [(2, 5), (16, 2016), (2016, 2021)]
    assert layout.buffer_ranges() == [(2032, 3056), None]
    assert layout.total == 3056
    flat = pack(params, buffers, layout, batches=2, gamma=1.0)
    assert torch.count_nonzero(flat[5:16]) == 0 and torch.count_nonzero(flat[2021:2032]) == 0
    ranks = [(list(params), list(buffers)), ([p * 3 for p in params], [b * 3 for b in buffers])]
    simulate_round(ranks, [1, 1], 1.0)
    for rank_params, _ in ranks:  # (x + 3x) / 2 for every element, gaps or not
        for p, value in zip(rank_params, (2.0, 4.0, 6.0), strict=True):
            assert torch.equal(p, torch.full_like(p, value))


def test_mixed_dtype_round_casts_back_to_each_tensor_dtype() -> None:
    no_buffers: list[torch.Tensor] = []
    ranks = [
        ([torch.full((2,), 1.0, dtype=torch.float64), torch.full((2,), 1.0)], no_buffers),
        ([torch.full((2,), 2.0, dtype=torch.float64), torch.full((2,), 2.0)], no_buffers),
    ]
    simulate_round(ranks, [1, 1], gamma=1.0)
    p64, p32 = ranks[0][0]
    assert p64.dtype == torch.float64 and torch.equal(
        p64, torch.full((2,), 1.5, dtype=torch.float64)
    )
    assert p32.dtype == torch.float32 and torch.equal(p32, torch.full((2,), 1.5))


def test_bit_checksum_sees_single_bit_changes() -> None:
    a = torch.linspace(-1, 1, 100)
    b = a.clone()
    assert bit_checksum(a) == bit_checksum(b)
    b.view(torch.int32)[17] ^= 1
    assert bit_checksum(a) != bit_checksum(b)
    assert bit_checksum(torch.tensor([0.0])) != bit_checksum(torch.tensor([-0.0]))
    assert bit_checksum(a.double()) == bit_checksum(a.double().clone())


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-100, 100, width=32), min_size=1, max_size=4),
    batch_pool=st.lists(st.integers(0, 50), min_size=4, max_size=4),
    gamma=st.sampled_from([1.0, 0.0, -1.0, 0.5]),
)
def test_round_matches_the_weighted_mean_and_is_identical_on_every_rank(
    values: list[float], batch_pool: list[int], gamma: float
) -> None:
    batches = batch_pool[: len(values)]
    ranks = [make_rank(v, v, 0) for v in values]
    simulate_round(ranks, batches, gamma)
    masses = [mass_of(n, gamma) for n in batches]
    total = sum(masses)
    if total == 0:  # nobody moved: everyone keeps its own values
        assert [r[0][0][0].item() for r in ranks] == values
        return
    for params, _ in ranks:
        assert torch.equal(params[0], ranks[0][0][0])  # bitwise identical everywhere
    expected = sum(m * v for m, v in zip(masses, values, strict=True)) / total
    assert ranks[0][0][0][0].item() == pytest.approx(expected, rel=1e-5, abs=1e-4)
    movers = [v for v, n in zip(values, batches, strict=True) if n > 0]
    assert ranks[0][1][0][0].item() == pytest.approx(sum(movers) / len(movers), rel=1e-5, abs=1e-4)
