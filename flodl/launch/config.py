"""What ``flodl run`` was asked to do: :class:`LaunchConfig`, checked on construction."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs

from flodl.backends import BACKEND_NAMES, check_backend_on_host
from flodl.config import CoordinatorConfig, check_at_least, check_script
from flodl.errors import ConfigError
from flodl.host.rundir import check_overwrite_and_resume, fresh_run_dir
from flodl.observe.view_config import ViewConfig


@attrs.frozen
class LaunchConfig:
    """What ``flodl run`` was asked to do."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc: int = 2
    transport: str = "tcp"
    backend: str = "auto"
    run_dir: Path = attrs.field(factory=fresh_run_dir)
    """Where the run writes; by default a new folder under ``runs/``. A folder that holds an
    earlier run is refused unless ``resume`` names it or ``overwrite`` is set."""
    seed: int = 0
    coordinator: CoordinatorConfig = attrs.field(factory=CoordinatorConfig)
    python: str = sys.executable
    warm_start: bool = True
    """Fork the ranks from a helper that has torch imported (:mod:`flodl.supervise.warm`)."""
    resume: Path | None = None
    exit_grace: float = 30.0
    """Seconds ranks get to exit on their own after the run ended, before they are killed."""
    echo: bool = True
    """Relay the ranks' output to this process's stdout."""
    show_ranks: frozenset[int] | None = None
    """Relay only these ranks' output (None: every rank's); all of it is in the rank logs."""
    restarts: int = 0
    """How many times a rank whose process failed is started again (it rejoins the group)."""
    overwrite: bool = False
    """Remove the files of the run ``run_dir`` holds (flodl's own only) before starting."""
    keep_checkpoints: int = 2
    """Bundles each rank keeps in its checkpoint folder (it removes older ones after a save)."""
    views: ViewConfig = attrs.field(factory=ViewConfig)
    """What the run shows while it trains (live table, event lines, dashboard)."""

    def __attrs_post_init__(self) -> None:
        check_at_least("--nproc", self.nproc, 1)
        check_at_least("--keep-checkpoints", self.keep_checkpoints, 1)
        if self.transport not in ("tcp", "unix"):
            raise ConfigError(f"--transport must be tcp or unix, got {self.transport!r}")
        if self.backend not in BACKEND_NAMES:
            raise ConfigError(f"--backend must be auto, gloo or nccl, got {self.backend!r}")
        check_at_least("--restarts", self.restarts, 0)
        check_at_least("--seed", self.seed, 0)
        if not self.exit_grace >= 0:
            raise ConfigError(f"exit_grace must be >= 0 seconds, got {self.exit_grace!r}")
        check_overwrite_and_resume(self.run_dir, self.resume, self.overwrite)

    def check_host(self) -> None:
        """Refuse what this host cannot run: a script that is not a file, ``--backend nccl``
        without a GPU per rank, ``--average-dtype bf16`` on GPUs that cannot reduce it (imports
        torch for nccl only). ConfigError naming the flag."""
        check_script(self.script)
        check_backend_on_host(self.backend, self.nproc, self.coordinator.average_dtype)
