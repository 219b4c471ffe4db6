"""CoordinatorConfig: what a user may set, and what it refuses."""

from __future__ import annotations

import pytest

from flodl.config import CoordinatorConfig, GuardKind, Policy
from flodl.errors import ConfigError


def test_relax_up_needs_cadence_windows() -> None:
    assert CoordinatorConfig(relax_up=True, policy="async").relax_up
    with pytest.raises(ConfigError, match="relax_up"):
        CoordinatorConfig(relax_up=True, policy="sync")


def test_relax_up_is_reachable_from_the_command_line() -> None:
    from flodl.cli import _coordinator_config, build_parser

    argv = ["coordinator", "--listen", "tcp://127.0.0.1:0", "--world-size", "2"]
    assert not _coordinator_config(build_parser().parse_args(argv)).relax_up
    assert _coordinator_config(build_parser().parse_args([*argv, "--relax-up"])).relax_up


def test_machine_settings_carry_every_setting_with_defaults_resolved() -> None:
    config = CoordinatorConfig(heartbeat_timeout=40.0, heartbeat_interval=2.0, anchor=7)
    settings = config.machine_settings()
    assert settings.policy is Policy.CADENCE
    assert settings.guard is GuardKind.TREND
    assert settings.cadence.anchor == 7
    assert settings.timeouts.heartbeat == 40.0
    assert settings.timeouts.reduce_stall == 400.0  # max(10 x heartbeat timeout, 300 s)
    assert settings.timeouts.window_wait == 42.0  # heartbeat timeout + 2 s
    explicit = CoordinatorConfig(reduce_stall_ceiling=12.0).machine_settings()
    assert explicit.timeouts.reduce_stall == 12.0


# Each flagged setting, a value to type for it, and the value it becomes.
TYPED = {
    "policy": ("async", Policy.ASYNC),
    "heartbeat_timeout": ("4", 4.0),
    "reduce_stall_ceiling": ("90", 90.0),
    "join_timeout": ("60", 60.0),
    "anchor": ("25", 25),
    "relax_up": (None, True),
    "max_batch_diff": ("3", 3),
    "window_cap_epochs": ("2.5", 2.5),
    "min_ranks": ("2", 2),
    "checkpoint_every": ("5", 5),
    "checkpoint_every_epochs": ("1", 1),
    "max_anchor": ("40", 40),
    "average_dtype": ("bf16", "bf16"),
    "window_cap_s": ("2.5", 2.5),
    "max_time": ("120", 120.0),
    "outer": ("nesterov", "nesterov"),
    "outer_lr": ("0.5", 0.5),
    "outer_momentum": ("0", 0.0),
}


def coordinator_args(*flags: str) -> list[str]:
    return ["coordinator", "--listen", "tcp://127.0.0.1:0", "--world-size", "4", *flags]


def test_every_flagged_setting_is_a_flag_of_both_commands_with_its_default() -> None:
    from flodl.cli import build_parser
    from flodl.config import flagged_settings

    flagged = {field.name: flag for field, flag in flagged_settings()}
    assert sorted(flagged) == sorted(TYPED)
    parser = build_parser()
    for argv in (coordinator_args(), ["run", "--nproc", "2", "train.py"]):
        args = vars(parser.parse_args(argv))
        built = CoordinatorConfig()
        for name in flagged:
            default = getattr(built, name)
            assert args[name] == (default.value if isinstance(default, Policy) else default)


@pytest.mark.parametrize("name", sorted(TYPED))
def test_a_typed_flag_reaches_its_setting_and_the_machine(name: str) -> None:
    from flodl.cli import _coordinator_config, build_parser
    from flodl.config import flagged_settings

    flag = dict((field.name, flag) for field, flag in flagged_settings())[name]
    text, value = TYPED[name]
    typed = [flag.name] if text is None else [flag.name, text]
    config = _coordinator_config(build_parser().parse_args(coordinator_args(*typed)))
    assert getattr(config, name) == value
    assert config != CoordinatorConfig(heartbeat_interval=config.heartbeat_interval)
    config.machine_settings()  # every value also builds the machine's settings


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("heartbeat_timeout", -1.0),
        ("reduce_stall_ceiling", 0.0),
        ("anchor", 0),
        ("max_batch_diff", -1),
        ("window_cap_epochs", 0.0),
        ("checkpoint_every", 0),
        ("max_time", 0.0),
        ("outer_lr", -0.5),
        ("outer_momentum", 1.0),
    ],
)
def test_one_rule_refuses_by_the_setting_or_by_its_flag(name: str, bad: object) -> None:
    from flodl.config import coordinator_config_from, flagged_settings

    flag = dict((field.name, flag) for field, flag in flagged_settings())[name]
    with pytest.raises(ConfigError, match=rf"^{name} must be"):
        CoordinatorConfig(**{name: bad})  # type: ignore[arg-type]
    options = {
        field.name: getattr(CoordinatorConfig(), field.name) for field, _ in flagged_settings()
    }
    options["policy"] = Policy.CADENCE.value
    with pytest.raises(ConfigError, match=rf"^{flag.name} must be"):
        coordinator_config_from({**options, name: bad})


def test_machine_settings_copy_the_cadence_by_name() -> None:
    config = CoordinatorConfig(
        anchor=3,
        max_anchor=9,
        overhead_target=0.2,
        max_batch_diff=4,
        relax_up=True,
        window_cap_epochs=None,
        fill_idle_ranks=False,
        min_ranks=3,
        trend_threshold=0.5,
    )
    settings = config.machine_settings()
    cadence = settings.cadence
    assert (cadence.anchor, cadence.max_anchor, cadence.overhead_target) == (3, 9, 0.2)
    assert (cadence.max_batch_diff, cadence.relax_up) == (4, True)
    assert (cadence.window_cap_epochs, cadence.fill_idle_ranks) == (None, False)
    assert (settings.min_ranks, settings.trend_threshold) == (3, 0.5)


def test_max_anchor_defaults_to_the_anchor_when_that_is_larger_and_never_below_it() -> None:
    from flodl.cli import _coordinator_config, build_parser

    def typed(*flags: str) -> CoordinatorConfig:
        return _coordinator_config(build_parser().parse_args(coordinator_args(*flags)))

    assert typed().max_anchor == 1000
    assert typed("--anchor", "2000").max_anchor == 2000
    assert typed("--anchor", "5", "--max-anchor", "20").max_anchor == 20
    with pytest.raises(ConfigError, match=r"^--max-anchor \(5\) must be >= --anchor \(10\)"):
        typed("--max-anchor", "5")
