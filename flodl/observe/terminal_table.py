"""What the live terminal view draws, from the run's state (:meth:`Observer.state`): pure.

A header line (status, round, generation, epoch, policy), a progress bar with the ETA, the
total samples/s and the last epoch's loss, a table with one row per rank, and the last few
event lines. Only the live view imports this module (it imports rich).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

__all__ = ["COLUMNS", "render"]

COLUMNS = ("rank", "state", "batches", "samples/s", "window", "idle", "averaging", "heartbeat")
"""The rank table's column headers."""

_STATE_STYLES = {
    "training": "green",
    "joined": "cyan",
    "joining": "dim",
    "dead": "bold red",
    "left": "yellow",
    "done": "blue",
    "stopped": "yellow",
}
_ENDED = ("finished", "completed", "saved", "failed")
"""Run statuses after which no rank trains."""
_SILENT_S = 3.0
"""A heartbeat older than this is shown in yellow (the rank may be stalling)."""


def render(
    state: Mapping[str, Any],
    events: Sequence[str] = (),
    width: int = 100,
    height: int | None = None,
) -> Group:
    """The whole view for ``state``: header, progress, rank table, then ``events`` (the last
    few event lines, oldest first). ``width``: the columns the progress bar may use;
    ``height``: the lines the view may take (ranks that do not fit are counted in one line
    by state instead of shown); None: no limit."""
    rows = None if height is None else max(height - 4 - len(events), 1)
    parts: list[RenderableType] = [header(state), progress(state, width), rank_table(state, rows)]
    if events:
        parts.append(Text("\n".join(events), style="dim", no_wrap=True, overflow="ellipsis"))
    return Group(*parts)


def header(state: Mapping[str, Any]) -> Text:
    """``flodl  training   round 12  generation 1  epoch 3/8  policy cadence``"""
    text = Text("flodl ", style="bold")
    status = str(state.get("status") or "joining")
    text.append(f" {status} ", style="reverse " + _status_style(status))
    epochs = state.get("epochs")
    epoch = state.get("epoch")
    epoch_text = "-" if epoch is None or epochs is None else f"{min(epoch + 1, epochs)}/{epochs}"
    fields = [
        ("round", str(state.get("round", 0))),
        ("generation", str(state.get("generation", 0))),
        ("epoch", epoch_text),
        ("policy", str(state.get("policy") or "-")),
    ]
    for name, value in fields:
        text.append(f"  {name} ", style="dim")
        text.append(value, style="bold")
    return text


def progress(state: Mapping[str, Any], width: int = 100) -> Table:
    """A bar of the share of the run's batches done, then the percentage, the ETA, the total
    samples/s of the live ranks and the last epoch's loss: ``37.5%  ETA 1:23  2,346
    samples/s  loss 0.1234``."""
    share = state.get("progress")
    done = 0.0 if share is None else float(share)
    text = Text(f"{100 * done:5.1f}%", style="bold")
    text.append("  ETA ", style="dim")
    text.append(eta_text(state), style="bold")
    text.append(f"  {_number(state.get('samples_per_s'))}", style="bold")
    text.append(" samples/s", style="dim")
    loss = state.get("window_loss")  # the latest window's, else the latest epoch's
    if not isinstance(loss, int | float):
        loss = state.get("last_loss")
    if isinstance(loss, int | float):
        text.append("  loss ", style="dim")
        text.append(f"{loss:.4f}", style="bold")
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    # The bar takes what the figures leave of the line (they need about 50 columns).
    bar = ProgressBar(total=1.0, completed=done, width=max(min(width - 52, 60), 10))
    grid.add_row(bar, text)
    return grid


def eta_text(state: Mapping[str, Any]) -> str:
    """``1:23`` (minutes:seconds, hours when needed); ``0:00`` once completed; ``-`` when unknown
    or when the run stopped short."""
    status = state.get("status")
    if status in ("finished", "completed"):
        return "0:00"
    eta = state.get("eta_s")
    if eta is None or status in ("saved", "failed"):
        return "-"
    seconds = round(float(eta))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def rank_table(state: Mapping[str, Any], rows: int | None = None) -> RenderableType:
    """One row per rank: the columns of :data:`COLUMNS`. ``rows``: the most lines the rows
    may take; when the ranks need more, the last line counts the ranks left out by state."""
    table = Table(box=None, header_style="bold", pad_edge=False, padding=(0, 2, 0, 0))
    for name in COLUMNS:
        table.add_column(name, justify="left" if name == "state" else "right", no_wrap=True)
    ended = state.get("status") in _ENDED
    ranks = list(state.get("ranks") or [])
    hidden: list[str] = []
    if rows is not None and len(ranks) > rows:
        ranks, left_out = ranks[: max(rows - 1, 0)], ranks[max(rows - 1, 0) :]
        hidden = [_shown_state(str(row.get("state") or "-"), state, ended) for row in left_out]
    for row in ranks:
        rank_state = _shown_state(str(row.get("state") or "-"), state, ended)
        live = rank_state in ("training", "joined")
        table.add_row(
            f"rank {row.get('rank')}",
            Text(rank_state, style=_STATE_STYLES.get(rank_state, "")),
            str(row.get("batches") or 0),
            _number(row.get("samples_per_s")) if live else "-",
            str(row["window_batches"]) if live and row.get("window_batches") is not None else "-",
            _percent(row.get("idle_share")),
            _percent(row.get("averaging_share")),
            _heartbeat(row.get("heartbeat_age_s")) if live else Text("-"),
        )
    if not hidden:
        return table
    counts = ", ".join(f"{hidden.count(name)} {name}" for name in sorted(set(hidden)))
    return Group(table, Text(f"+{len(hidden)} more ranks: {counts}", style="dim"))


def _shown_state(rank_state: str, state: Mapping[str, Any], ended: bool) -> str:
    if ended and rank_state in ("training", "joined", "joining"):
        # A run stopped short records no end per rank: say what is known.
        return "done" if state.get("status") == "completed" else "stopped"
    return rank_state


def _heartbeat(age: Any) -> Text:
    if not isinstance(age, int | float):
        return Text("-")
    return Text(f"{age:.1f}s ago", style="yellow" if age >= _SILENT_S else "")


def _number(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:,.0f}"


def _percent(share: Any) -> str:
    return "-" if not isinstance(share, int | float) else f"{100 * share:.1f}%"


def _status_style(status: str) -> str:
    if status in ("training", "completed", "finished"):
        return "green"
    if status == "saved":
        return "yellow"
    if status == "failed":
        return "red"
    return ""
