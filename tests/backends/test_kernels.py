"""The one-pass pieces of a pre-scaled round: the share copy (``out = p * m / M`` and
``||p||``) and the gap (``||a - p||`` and ``||a||``), compiled and with torch ops, against
float64 references."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.averaging.kernels import (
    NormSample,
    compiled,
    gap_piece,
    share_piece,
    takes_fused,
    warm_up,
)

REPO = Path(__file__).resolve().parents[2]
HAS_NUMBA = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")


@pytest.fixture(autouse=True)
def loaded() -> None:
    """Wait for the compiled loops (loaded in the background otherwise)."""
    assert warm_up() is HAS_NUMBA


def root(square: float | torch.Tensor | list[torch.Tensor] | tuple[float, float]) -> float:
    return math.sqrt(float(square))  # type: ignore[arg-type]


def gap_norms(result: tuple[float, float] | list[torch.Tensor]) -> tuple[float, float]:
    diff, post = result
    return math.sqrt(float(diff)), math.sqrt(float(post))


def pair(size: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's parameters and an average that drifted a little from them (what the guard
    watches)."""
    generator = torch.Generator().manual_seed(seed)
    own = torch.randn(size, generator=generator).to(dtype)
    average = (own.double() + 0.01 * torch.randn(size, generator=generator).double()).to(dtype)
    return average, own


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 40_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    factor=st.floats(0.0, 1.0, allow_nan=False),
    seed=st.integers(0, 2**16),
)
def test_the_compiled_share_rounds_each_float64_product_once(
    size: int, dtype: torch.dtype, factor: float, seed: int
) -> None:
    _, own = pair(size, dtype, seed)
    out = torch.full((size,), math.nan, dtype=dtype)
    assert takes_fused(out, own)
    pre = share_piece(own, out, factor)
    assert isinstance(pre, float)
    assert torch.equal(out, (own.double() * factor).to(dtype))
    assert root(pre) == pytest.approx(float(own.double().norm()), rel=1e-5, abs=1e-30)


@settings(max_examples=20, deadline=None)
@given(size=st.integers(2, 10_000), seed=st.integers(0, 2**16))  # 2: strided exists
def test_both_share_paths_write_the_same_bits_for_a_factor_exact_in_float32(
    size: int, seed: int
) -> None:
    _, own = pair(size, torch.float32, seed)
    compiled_out, torch_out = torch.empty(size), torch.empty(size)
    share_piece(own, compiled_out, 0.375)
    # A strided source never takes the compiled loop.
    strided = torch.stack([own, own], dim=1)[:, 0]
    assert not takes_fused(torch_out, strided)
    pre = share_piece(strided, torch_out, 0.375)
    assert torch.equal(compiled_out, torch_out)
    assert torch.equal(torch_out, own * 0.375)
    assert root(pre) == pytest.approx(float(own.double().norm()), rel=1e-5, abs=1e-30)


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(2, 40_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_compiled_and_torch_gaps_match_the_float64_reference(
    size: int, dtype: torch.dtype, seed: int
) -> None:
    average, own = pair(size, dtype, seed)
    expected = (float((average.double() - own.double()).norm()), float(average.double().norm()))
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    assert takes_fused(average, own)
    fast = gap_piece(average, own, torch.empty(1000, dtype=dtype))
    assert isinstance(fast, tuple)
    strided_own = torch.stack([own, own], dim=1)[:, 0]
    plain = gap_piece(average, strided_own, torch.empty(1000, dtype=dtype))
    assert isinstance(plain, list)
    for got in (gap_norms(fast), gap_norms(plain)):
        assert got == pytest.approx(expected, rel=tolerance, abs=1e-30)


@needs_numba
def test_divergence_of_nearly_equal_ranks_keeps_its_digits() -> None:
    """A divergence of 1e-4 is measured to 1e-3 relative: the gap is formed per element,
    never as a difference of two large sums."""
    own = torch.randn(2_000_000, generator=torch.Generator().manual_seed(1))
    average = own + 1e-4 * torch.randn(own.shape, generator=torch.Generator().manual_seed(2))
    diff, post = gap_norms(gap_piece(average, own, torch.empty(1024)))
    exact_diff = float((average.double() - own.double()).norm())
    assert diff == pytest.approx(exact_diff, rel=1e-3)
    assert diff / post == pytest.approx(1e-4, rel=0.05)


def test_a_bfloat16_source_is_cast_then_scaled_in_the_flat_dtype() -> None:
    own = torch.randn(64).to(torch.bfloat16)
    out = torch.empty(64)
    assert not takes_fused(out, own)
    pre = share_piece(own, out, 2.5)
    assert torch.equal(out, own.float() * 2.5)
    assert root(pre) == pytest.approx(float(own.double().norm()), rel=1e-2)
    average = out / 2
    diff, post = gap_norms(gap_piece(average, own, torch.empty(16)))
    assert diff == pytest.approx(float((average.double() - own.double()).norm()), rel=1e-2)
    assert post == pytest.approx(float(average.double().norm()), rel=1e-5)


def test_sources_and_averages_are_never_written() -> None:
    average, own = pair(10_000, torch.float32, 3)
    before_own, before_average = own.clone(), average.clone()
    share_piece(own, torch.empty(10_000), 0.5)
    gap_piece(average, own, torch.empty(256))
    assert torch.equal(own, before_own) and torch.equal(average, before_average)


def test_once_loaded_the_loops_are_there_exactly_when_numba_is() -> None:
    assert compiled() is HAS_NUMBA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pieces_take_the_torch_path() -> None:
    average, own = pair(100_000, torch.float32, 5)
    own_gpu, average_gpu = own.cuda(), average.cuda()
    out = torch.empty(100_000, device="cuda")
    assert not takes_fused(out, own_gpu)
    pre = share_piece(own_gpu, out, 0.25)
    assert torch.equal(out.cpu(), own * 0.25)
    assert root(pre) == pytest.approx(float(own.double().norm()), rel=1e-5)
    result = gap_piece(average_gpu, own_gpu, torch.empty(1 << 14, device="cuda"))
    assert isinstance(result, list)
    expected = (float((average.double() - own.double()).norm()), float(average.double().norm()))
    assert gap_norms(result) == pytest.approx(expected, rel=1e-5)


BROKEN_NUMBA_PROBE = """
import warnings, torch
from flodl.averaging.kernels import share_piece, warm_up
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded = warm_up()
out = torch.empty(5)
share_piece(torch.full((5,), 6.0), out, 0.5)
print(loaded, out.tolist(), [str(w.message) for w in caught])
"""


@pytest.mark.parametrize(
    "failure, warned", [("raise ImportError('no numba')", False), ("1 / 0", True)]
)
def test_a_numba_that_will_not_import_leaves_the_torch_path(
    tmp_path: Path, failure: str, warned: bool
) -> None:
    """A missing numba is silent; a broken one (here: an import that raises) warns once.
    Either way rounds still average, with torch ops."""
    (tmp_path / "numba").mkdir()
    (tmp_path / "numba" / "__init__.py").write_text(failure + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]))
    done = subprocess.run(
        [sys.executable, "-c", BROKEN_NUMBA_PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded, rest = done.stdout.split(" ", 1)
    assert loaded == "False"
    assert rest.startswith("[3.0, 3.0, 3.0, 3.0, 3.0]")
    assert ("ZeroDivisionError" in rest and "using torch ops" in rest) is warned


def sampled_reference(
    average: torch.Tensor, own: torch.Tensor, sample: NormSample, start: int
) -> tuple[float, float]:
    """The sampled estimate in float64: the squares of the chosen elements, scaled up."""
    index = torch.arange(start, start + average.numel())
    chosen = index % sample.every < sample.block
    scale = average.numel() / int(chosen.sum())
    diff = (average.double() - own.double())[chosen].square().sum() * scale
    post = average.double()[chosen].square().sum() * scale
    return math.sqrt(float(diff)), math.sqrt(float(post))


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 20_000),
    start=st.integers(0, 5_000),
    block=st.integers(1, 300),
    every=st.integers(1, 900),
    seed=st.integers(0, 2**16),
)
def test_both_sampled_paths_read_exactly_the_fixed_sample(
    size: int, start: int, block: int, every: int, seed: int
) -> None:
    """Compiled and torch paths estimate from the same elements (flat index modulo ``every``
    below ``block``), whatever the piece's offset; pieces the sample does not take (too short,
    or a sample that reads everything) are exact."""
    block = min(block, every)
    sample = NormSample(block=block, every=every, whole_below=1000)
    average, own = pair(size, torch.float32, seed)
    strided_own = torch.stack([own, own], dim=1)[:, 0]  # not contiguous: the torch path
    if sample.takes(size):
        expected = sampled_reference(average, own, sample, start)
    else:
        expected = (float((average.double() - own.double()).norm()), float(average.norm()))
    results = [gap_piece(average, strided_own, torch.empty(64), sample, start)]
    if HAS_NUMBA:
        results.append(gap_piece(average, own, torch.empty(64), sample, start))
        assert isinstance(results[-1], tuple)
    for result in results:
        assert gap_norms(result) == pytest.approx(expected, rel=1e-5, abs=1e-30)


def test_a_sampled_gap_sees_drift_spread_over_a_large_tensor() -> None:
    """Drift spread evenly over 4M elements: the default sample (1/16 read) is within 1% of
    the exact norms; drift confined to the unsampled blocks is missed (the estimate's limit)."""
    sample = NormSample()
    own = torch.randn(4_000_000, generator=torch.Generator().manual_seed(5))
    noise = 1e-3 * torch.randn(own.shape, generator=torch.Generator().manual_seed(6))
    average = own + noise
    diff, post = gap_norms(gap_piece(average, own, torch.empty(1024), sample, 2))
    assert diff == pytest.approx(float(noise.double().norm()), rel=0.01)
    assert post == pytest.approx(float(average.double().norm()), rel=0.01)
    hidden = own.clone()
    hidden[sample.block + 10 : sample.every - 10] += 1.0  # between the first two blocks
    diff, _ = gap_norms(gap_piece(hidden, own, torch.empty(1024), sample, 0))
    assert diff == 0.0


@pytest.mark.parametrize("sample", [None, NormSample(block=2, every=4, whole_below=0)])
def test_an_empty_piece_s_norms_live_on_the_piece_s_device(sample: NormSample | None) -> None:
    # A zero-element parameter (a common device marker) lands as an empty piece; its zero
    # norms must stack with the other pieces' sums, which live on the model's device (a GPU
    # there; the meta device stands in for it here: no data, just the device).
    empty = torch.empty(0, device="meta")
    spare = torch.empty(4, device="meta")
    norms = gap_piece(empty, empty, spare, sample)
    assert isinstance(norms, list)
    assert [n.device.type for n in norms] == ["meta", "meta"]
    assert [n.dtype for n in norms] == [torch.float64, torch.float64]
