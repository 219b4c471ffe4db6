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
