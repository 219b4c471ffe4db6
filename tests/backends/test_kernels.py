"""The one-pass end of a round: the compiled loop and the torch path write the same average,
bit for bit, and both measure the norms a float64 reference gives."""

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

from flodl.backends.kernels import (
    PieceNorms,
    finish_piece,
    finish_piece_torch,
    fused_kernel,
    takes_fused,
    warm_up,
)

REPO = Path(__file__).resolve().parents[2]
HAS_NUMBA = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")


@pytest.fixture(autouse=True)
def loaded() -> None:
    """Wait for the compiled loop (loaded in the background otherwise)."""
    assert warm_up() is HAS_NUMBA


def reference(summed: torch.Tensor, source: torch.Tensor, mass: float) -> tuple[float, ...]:
    """The three norms in float64, against the average as the float dtype divides it."""
    average = (summed / mass).double()
    own = source.double()
    return (
        float((average - own).norm()),
        float(average.norm()),
        float(own.norm()),
    )


def norms_of(result: PieceNorms | list[torch.Tensor]) -> tuple[float, ...]:
    squares = (
        (result.diff, result.post, result.pre)
        if isinstance(result, PieceNorms)
        else tuple(float(t) for t in result)
    )
    return tuple(math.sqrt(q) for q in squares)


def pair(size: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    own = torch.randn(size, generator=generator).to(dtype)
    # A sum of three ranks that drifted a little from this one: the case the guard watches.
    summed = (3 * own.double() + 0.01 * torch.randn(size, generator=generator).double()).to(dtype)
    return summed, own


@needs_numba
@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(0, 40_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    mass=st.floats(0.01, 1e4, allow_nan=False, allow_infinity=False),
    seed=st.integers(0, 2**16),
)
def test_compiled_loop_and_torch_path_write_the_same_bits(
    size: int, dtype: torch.dtype, mass: float, seed: int
) -> None:
    summed, own = pair(size, dtype, seed)
    fused, plain = summed.clone(), summed.clone()
    assert takes_fused(fused, own)
    fused_norms = norms_of(finish_piece(fused, own, mass, torch.empty(1000, dtype=dtype)))
    plain_norms = norms_of(finish_piece_torch(plain, own, mass, torch.empty(1000, dtype=dtype)))
    assert torch.equal(fused, plain)
    assert torch.equal(fused, summed / mass)  # one IEEE division per element, no reciprocal
    expected = reference(summed, own, mass)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    for got in (fused_norms, plain_norms):
        assert got == pytest.approx(expected, rel=tolerance, abs=1e-30)


@needs_numba
def test_divergence_of_nearly_equal_ranks_keeps_its_digits() -> None:
    """A divergence of 1e-4 is measured to 1e-3 relative: the gap is formed per element,
    never as a difference of two large sums."""
    own = torch.randn(2_000_000, generator=torch.Generator().manual_seed(1))
    average = own + 1e-4 * torch.randn(own.shape, generator=torch.Generator().manual_seed(2))
    summed = (average.double() * 4).float()  # a mass of 4 divides exactly
    result = finish_piece(summed.clone(), own, 4.0, torch.empty(1024))
    assert isinstance(result, PieceNorms)
    diff, post, _ = norms_of(result)
    exact_diff = float((average.double() - own.double()).norm())
    assert diff == pytest.approx(exact_diff, rel=1e-3)
    assert diff / post == pytest.approx(1e-4, rel=0.05)


@pytest.mark.parametrize(
    "summed, source",
    [
        (torch.randn(64), torch.randn(64).to(torch.bfloat16)),  # dtypes differ
        (torch.randn(64, 2)[:, 0], torch.randn(64)),  # strided
    ],
)
def test_pieces_the_loop_does_not_take_go_the_torch_way(
    summed: torch.Tensor, source: torch.Tensor
) -> None:
    assert not takes_fused(summed, source)
    expected_average = summed / 2.5
    expected = reference(summed, source, 2.5)
    result = finish_piece(summed, source, 2.5, torch.empty(16))
    assert isinstance(result, list)
    assert torch.equal(summed, expected_average)
    assert norms_of(result) == pytest.approx(expected, rel=1e-2)


def test_source_is_never_written() -> None:
    summed, own = pair(10_000, torch.float32, 3)
    before = own.clone()
    finish_piece(summed, own, 3.0, torch.empty(256))
    assert torch.equal(own, before)


def test_once_loaded_the_loop_is_there_exactly_when_numba_is() -> None:
    assert (fused_kernel() is not None) is HAS_NUMBA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pieces_take_the_torch_path() -> None:
    """On a GPU the average may differ from the CPU's in the last bit (torch divides by a
    scalar as a multiply by its reciprocal there); every rank of an NCCL group runs the same
    kernel, so they still agree with each other."""
    summed, own = pair(100_000, torch.float32, 5)
    on_gpu, own_gpu = summed.cuda(), own.cuda()
    assert not takes_fused(on_gpu, own_gpu)
    again = on_gpu.clone()
    result = finish_piece(on_gpu, own_gpu, 3.7, torch.empty(1 << 14, device="cuda"))
    finish_piece(again, own_gpu, 3.7, torch.empty(1 << 12, device="cuda"))
    assert isinstance(result, list)
    assert torch.equal(on_gpu, again)  # the same bits whatever the block size
    assert torch.allclose(on_gpu.cpu(), summed / 3.7, rtol=2e-7, atol=0.0)
    assert norms_of(result) == pytest.approx(reference(summed, own, 3.7), rel=1e-5)


BROKEN_NUMBA_PROBE = """
import warnings, torch
from flodl.backends.kernels import finish_piece, warm_up
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded = warm_up()
summed = torch.full((5,), 6.0)
finish_piece(summed, torch.ones(5), 3.0, torch.empty(4))
print(loaded, summed.tolist(), [str(w.message) for w in caught])
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
    assert rest.startswith("[2.0, 2.0, 2.0, 2.0, 2.0]")
    assert ("ZeroDivisionError" in rest and "using torch ops" in rest) is warned
