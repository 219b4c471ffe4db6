"""The outer optimizer's step, state and settings (:mod:`flodl.averaging.outer`), on CPU."""

from __future__ import annotations

import math

import pytest
import torch

from flodl.averaging.outer import NO_STATE, OuterKind, OuterOptimizer, OuterSettings
from flodl.errors import ConfigError

NESTEROV = OuterSettings("nesterov", 0.7, 0.9)


def params(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=generator), torch.randn(7, generator=generator)]


def test_first_round_keeps_the_average_and_sets_the_global_weights() -> None:
    outer = OuterOptimizer(NESTEROV)
    assert outer.version == NO_STATE and outer.tensors() == []
    averaged = params(0)
    before = [a.clone() for a in averaged]
    outer.step(averaged)
    assert outer.version == 0
    assert all(torch.equal(a, b) for a, b in zip(averaged, before, strict=True))
    g, m = outer.tensors()[:2], outer.tensors()[2:]
    assert all(torch.equal(x, b) for x, b in zip(g, before, strict=True))
    assert all(torch.count_nonzero(x) == 0 for x in m)


def test_later_rounds_are_nesterov_sgd_on_the_pseudo_gradient() -> None:
    """The same numbers as torch.optim.SGD(nesterov=True) fed ``g - a`` as the gradient."""
    outer = OuterOptimizer(NESTEROV)
    outer.step(params(0))
    reference = [p.clone().requires_grad_() for p in params(0)]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    for seed in (1, 2, 3):
        averaged = params(seed)
        for p, a in zip(reference, averaged, strict=True):
            p.grad = p.detach() - a
        sgd.step()
        outer.step(averaged)
        for p, a in zip(reference, averaged, strict=True):
            torch.testing.assert_close(a, p.detach(), rtol=0, atol=1e-6)
    assert outer.version == 3


@pytest.mark.parametrize("settings", [OuterSettings(), OuterSettings("nesterov", 1.0, 0.0)])
def test_identity_settings_leave_the_average_bitwise(settings: OuterSettings) -> None:
    outer = OuterOptimizer(settings)
    assert settings.is_identity and not outer.active
    for seed in range(3):
        averaged = params(seed)
        expected = [a.clone() for a in averaged]
        outer.step(averaged)
        assert all(torch.equal(a, e) for a, e in zip(averaged, expected, strict=True))
    assert outer.state_dict() == {} and outer.version == NO_STATE


@pytest.mark.parametrize(
    ("settings", "copies"),
    [(NESTEROV, 2), (OuterSettings("sgd"), 1), (OuterSettings("nesterov", 1.2, 0.0), 1)],
)
def test_state_bytes_are_a_float32_copy_of_the_parameters_per_buffer(
    settings: OuterSettings, copies: int
) -> None:
    """g always; m only where the momentum is above 0 (sgd keeps one copy, nesterov two)."""
    model = [torch.zeros(10, 4), torch.zeros(3, dtype=torch.float16), torch.zeros(2, 2).double()]
    # float32 for float32 and float16 parameters, float64 for float64.
    outer = OuterOptimizer(settings)
    assert outer.state_bytes(model) == copies * (40 * 4 + 3 * 4 + 4 * 8)
    outer.step([p.clone() for p in model])
    assert len(outer.tensors()) == copies * len(model)
    held = sum(t.numel() * t.element_size() for t in outer.tensors())
    assert held == outer.state_bytes(model)
    assert OuterOptimizer(OuterSettings()).state_bytes(model) == 0


def test_sgd_steps_lr_times_the_common_move_from_the_last_global_weights() -> None:
    """g <- g - lr * (g - a): at lr 1.5 half a move past the average; bitwise what nesterov
    with momentum 0 computes."""
    sgd = OuterOptimizer(OuterSettings("sgd"))
    nesterov = OuterOptimizer(OuterSettings("nesterov", 1.5, 0.0))
    assert (sgd.settings.lr, sgd.settings.momentum) == (1.5, 0.0)
    sgd.step(params(0))
    nesterov.step(params(0))
    for seed in (1, 2):
        global_before = [g.clone() for g in sgd.tensors()]
        averaged, same = params(seed), params(seed)
        sgd.step(averaged)
        nesterov.step(same)
        for a, g, b, s in zip(averaged, global_before, params(seed), same, strict=True):
            torch.testing.assert_close(a, g + 1.5 * (b - g))
            assert torch.equal(a, s)
    assert sgd.version == nesterov.version == 2


def test_a_state_saved_with_other_settings_is_taken_up() -> None:
    """A resume may change the kind: a saved momentum is dropped where none is kept, and a
    missing one starts at zero."""
    with_momentum = OuterOptimizer(NESTEROV)
    for seed in range(3):
        with_momentum.step(params(seed))
    without = OuterOptimizer(OuterSettings("sgd"))
    without.load_state_dict(with_momentum.state_dict(), params(0))
    assert without.version == 2 and len(without.tensors()) == 2
    assert all(
        torch.equal(a, b)
        for a, b in zip(without.tensors(), with_momentum.tensors()[:2], strict=True)
    )
    back = OuterOptimizer(NESTEROV)
    back.load_state_dict(without.state_dict(), params(0))
    assert [torch.count_nonzero(m).item() for m in back.tensors()[2:]] == [0, 0]


def test_state_dict_round_trip_and_misfits() -> None:
    outer = OuterOptimizer(NESTEROV)
    for seed in range(3):
        outer.step(params(seed))
    state = outer.state_dict()
    restored = OuterOptimizer(NESTEROV)
    restored.load_state_dict(state, params(0))
    assert restored.version == outer.version == 2
    assert all(torch.equal(a, b) for a, b in zip(restored.tensors(), outer.tensors(), strict=True))
    with pytest.raises(ConfigError, match="holds 5 tensors, which do not fit the 3 parameters"):
        restored.load_state_dict(state, [*params(0), torch.zeros(1)])
    with pytest.raises(ConfigError, match=r"global tensor 0 is \(5, 3\)"):
        restored.load_state_dict(state, [torch.zeros(3, 5), torch.zeros(7)])
    restored.load_state_dict({}, params(0))
    assert restored.version == NO_STATE and restored.tensors() == []


def test_shared_tensors_give_a_rank_without_state_buffers_to_receive_into() -> None:
    outer = OuterOptimizer(NESTEROV)
    shared = outer.shared_tensors(params(0))
    assert [t.shape for t in shared] == [(5, 3), (7,), (5, 3), (7,)]
    for t in shared:
        t.fill_(2.0)
    outer.adopt_shared(4)  # the group wrote another rank's version-4 state into them
    assert outer.version == 4 and all(torch.equal(t, torch.full_like(t, 2.0)) for t in shared)
    averaged = params(1)
    outer.step(averaged)
    assert outer.version == 5
    nobody = OuterOptimizer(NESTEROV)
    nobody.shared_tensors(params(0))
    nobody.adopt_shared(NO_STATE)  # no member had any: the next round sets g
    assert nobody.tensors() == []


@pytest.mark.parametrize(
    ("kind", "lr", "momentum", "message"),
    [
        ("adam", 0.7, 0.9, "outer must be one of none, sgd, nesterov, got 'adam'"),
        ("sgd", 1.5, 0.9, r"outer_momentum must be 0 with outer sgd \(nesterov takes"),
        ("nesterov", 0.0, 0.9, "outer_lr must be a finite number > 0, got 0.0"),
        ("nesterov", -1.0, 0.9, "outer_lr must be a finite number > 0"),
        ("nesterov", math.inf, 0.9, "outer_lr must be a finite number > 0"),
        ("nesterov", math.nan, 0.9, "outer_lr must be a finite number > 0"),
        ("nesterov", 0.7, 1.0, r"outer_momentum must be a number in \[0, 1\), got 1.0"),
        ("nesterov", 0.7, -0.1, r"outer_momentum must be a number in \[0, 1\)"),
        ("nesterov", 0.7, math.nan, r"outer_momentum must be a number in \[0, 1\)"),
    ],
)
def test_bad_settings_name_the_setting(kind: str, lr: float, momentum: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        OuterSettings(kind, lr, momentum)


def test_kinds() -> None:
    assert [k.value for k in OuterKind] == ["none", "sgd", "nesterov"]
    assert OuterSettings().kind is OuterKind.NONE and OuterSettings().is_identity
    assert OuterSettings("nesterov") == OuterSettings("nesterov", 0.7, 0.9)
    assert OuterSettings.of("sgd", None, None) == OuterSettings("sgd", 1.5, 0.0)
    assert OuterSettings.of("nesterov", 0.5, None) == OuterSettings("nesterov", 0.5, 0.9)
