"""What ``flodl agent`` was asked to do: :class:`AgentConfig`, checked on construction."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs

from flodl.config import (
    check_at_least,
    check_host,
    check_port,
    check_script,
    check_seconds,
    check_url,
)

__all__ = ["AgentConfig"]


@attrs.frozen(kw_only=True)
class AgentConfig:
    """One host's agent: where the coordinator is, which node this is, what to run."""

    coordinator: str
    """The coordinator's URL (``tcp://HOST:PORT``)."""
    node_rank: int
    nproc: int
    """Ranks this host runs (hosts may run different numbers)."""
    script: str
    script_args: tuple[str, ...] = ()
    run_dir: Path = Path("runs/agent")
    """Where this host's ranks write (logs ``rank<N>.log``, checkpoints, the key file)."""
    restarts: int = 0
    """How many times, in all, this host starts a rank again after its process failed."""
    join_timeout: float = 300.0
    """Seconds to keep trying to reach the coordinator (it may start after the agents)."""
    exit_grace: float = 30.0
    """Seconds the ranks get to exit on their own once the run ended, before they are killed."""
    host: str | None = None
    """This host's address for the ranks' peers (None: the one that reaches the coordinator)."""
    master_addr: str | None = None
    """MASTER_ADDR for a script's own rendezvous (None: the coordinator's host)."""
    master_port: int = 29500
    resume: Path | None = None
    """A checkpoint bundle on this host every rank resumes from (``FLODL_RESUME``)."""
    python: str = sys.executable
    warm_start: bool = True
    """Fork the ranks from a helper that has torch imported (:mod:`flodl.supervise.warm`)."""
    echo: bool = True
    show_ranks: frozenset[int] | None = None

    def __attrs_post_init__(self) -> None:
        check_url("--coordinator", self.coordinator)
        check_at_least("--node-rank", self.node_rank, 0)
        check_at_least("--nproc", self.nproc, 1)
        check_at_least("--restarts", self.restarts, 0)
        check_seconds("--join-timeout", self.join_timeout)
        check_port("--master-port", self.master_port)
        check_host("--host", self.host)
        check_script(self.script)
