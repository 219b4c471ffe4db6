"""What a run shows while it trains, as ``flodl run`` and ``flodl coordinator`` were asked."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs

from flodl.errors import ConfigError

__all__ = ["ViewConfig", "add_view_flags", "is_loopback", "parse_bind", "view_config_from"]


def parse_bind(text: str) -> tuple[str, int]:
    """``[HOST:]PORT`` -> (host, port); the host defaults to 127.0.0.1. ConfigError if bad."""
    host, _, port_text = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"--dashboard must be [HOST:]PORT, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--dashboard port must be 0..65535, got {port}")
    return host, port


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@attrs.frozen
class ViewConfig:
    """What a run shows while it trains."""

    live: bool | None = None
    """The live table: None = when stdout is a terminal; False = ``--no-live``."""
    quiet: bool = False
    """``--quiet``: neither rank output nor event lines, only the end-of-run summary."""
    dashboard: tuple[str, int] | None = None
    """(host, port) to serve the dashboard on; None: no dashboard."""
    dashboard_token_file: Path | None = None
    """A file whose content (stripped) every dashboard request must present."""

    def __attrs_post_init__(self) -> None:
        if self.dashboard is None:
            if self.dashboard_token_file is not None:
                raise ConfigError("--dashboard-token-file needs --dashboard")
            return
        if not is_loopback(self.dashboard[0]) and self.dashboard_token_file is None:
            raise ConfigError(
                f"--dashboard {self.dashboard[0]}:{self.dashboard[1]} binds beyond this host's "
                "loopback: give --dashboard-token-file FILE (every request must present it)"
            )
        if self.dashboard_token_file is not None:
            self.token()  # readable and non-empty, or ConfigError now

    def token(self) -> str | None:
        """The dashboard's token, or None when none is required."""
        path = self.dashboard_token_file
        if path is None:
            return None
        try:
            token = path.read_text().strip()
        except OSError as err:
            raise ConfigError(f"--dashboard-token-file {path}: {err.strerror}") from None
        if len(token) < 16:
            raise ConfigError(f"--dashboard-token-file {path}: the token must be >= 16 characters")
        return token


def add_view_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of what a run shows (``flodl run``, ``flodl coordinator``)."""
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="no live table even on a terminal: plain lines (rank output and events) instead",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print only the end-of-run summary (rank output is still in run_dir/rank<N>.log)",
    )
    parser.add_argument(
        "--dashboard",
        default=None,
        metavar="[HOST:]PORT",
        help="serve a live web dashboard, /api/state, /api/events and /metrics "
        "(host default 127.0.0.1; any other host needs --dashboard-token-file)",
    )
    parser.add_argument(
        "--dashboard-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="every dashboard request must present this file's token (Bearer or ?token=)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="write run_dir/report/index.html (plots of the event log) when the run ends",
    )


def view_config_from(args: argparse.Namespace) -> ViewConfig:
    """The :class:`ViewConfig` the flags of :func:`add_view_flags` ask for."""
    return ViewConfig(
        live=False if args.no_live or args.quiet else None,
        quiet=args.quiet,
        dashboard=None if args.dashboard is None else parse_bind(args.dashboard),
        dashboard_token_file=args.dashboard_token_file,
    )
