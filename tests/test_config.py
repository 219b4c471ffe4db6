"""CoordinatorConfig: what a user may set, and what it refuses."""

from __future__ import annotations

import pytest

from flodl.config import CoordinatorConfig
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
