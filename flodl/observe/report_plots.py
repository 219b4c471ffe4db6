"""The report's figures, one function per plot, each drawn from a :class:`RunHistory`.

Every function returns a matplotlib ``Figure`` with a title and labelled axes (units in the
labels); a plot without data shows a "no data" note instead of raising. Figures are made
with ``matplotlib.figure.Figure`` (no pyplot, no global backend switch); saving one renders
it with matplotlib's Agg/SVG canvases. Imported only by :mod:`flodl.observe.report`.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from flodl.observe.history import ROWS, RunHistory

__all__ = ["PLOTS", "Plot"]

SIZE = (8.0, 3.6)
MARKERS_UP_TO = 200
"""A line with more points than this is drawn without markers (a long run's SVG stays small)."""
LEGEND_UP_TO = 12
"""More ranks than this: no legend (colours repeat after ten anyway)."""


@attrs.frozen
class Plot:
    """One figure of the report: its file stem, heading, caption and how to draw it."""

    name: str
    title: str
    caption: str
    draw: Callable[[RunHistory], Figure]


def _figure(title: str, size: tuple[float, float] = SIZE) -> tuple[Figure, Axes]:
    figure = Figure(figsize=size, layout="constrained")
    axes = figure.add_subplot()
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    return figure, axes


def _no_data(axes: Axes, what: str) -> None:
    axes.text(0.5, 0.5, f"no data: {what}", ha="center", va="center", transform=axes.transAxes)
    axes.set_xticks([])
    axes.set_yticks([])


def _color(rank: int) -> str:
    return f"C{rank % 10}"


def _per_rank_lines(
    history: RunHistory, axes: Axes, key: str, *, over_time: bool, scale: float = 1.0
) -> bool:
    """One line per rank of ``ranks[rank][key] * scale``; False when no round has a value."""
    drawn = False
    for rank in history.ranks:
        points = [
            (row.start if over_time else row.round, value * scale)
            for row in history.rounds
            if (value := row.value(rank, key)) is not None
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            style = "o-" if len(points) <= MARKERS_UP_TO else "-"
            axes.plot(xs, ys, style, markersize=3, color=_color(rank), label=f"rank {rank}")
            drawn = True
    if drawn and len(history.ranks) <= LEGEND_UP_TO:
        axes.legend(loc="best", fontsize="small")
    return drawn


def samples_per_s(history: RunHistory) -> Figure:
    """Per rank, its samples/s in each window over time (a line per rank)."""
    figure, axes = _figure("Throughput per rank while training")
    axes.set_xlabel("time since the coordinator started (s)")
    axes.set_ylabel("samples/s")
    if not _per_rank_lines(history, axes, "samples_per_s", over_time=True):
        _no_data(axes, "no round with trained batches")
    return figure


def batches(history: RunHistory) -> Figure:
    """Per rank, the batches it ran in each round's window, over the round number."""
    figure, axes = _figure("Batches per rank in each round's window")
    axes.set_xlabel("round")
    axes.set_ylabel("batches")
    if not _per_rank_lines(history, axes, "batches", over_time=False):
        _no_data(axes, "no settled round")
    return figure


def shares(history: RunHistory) -> Figure:
    """Idle and averaging time of each rank as a share of its rounds (windows + rounds).

    Rounds whose window trained nothing are left out: the run's first round (every rank
    starts from the same weights) also waits for the first group to form, seconds that are
    neither idling nor averaging between batches."""
    figure, axes = _figure("Idle and averaging share per rank")
    axes.set_xlabel("rank")
    axes.set_ylabel("share of its rounds' time (%)")
    idle, averaging = [], []
    for rank in history.ranks:
        rows = [
            row
            for row in history.rounds
            if rank in row.ranks and any(row.value(r, "batches") for r in row.ranks)
        ]
        span_ms = sum((row.window_s + row.duration_s) * 1000.0 for row in rows)
        idle_ms = sum(row.value(rank, "idle_ms") or 0.0 for row in rows)
        averaging_ms = sum(row.value(rank, "averaging_ms") or 0.0 for row in rows)
        idle.append(100.0 * idle_ms / span_ms if span_ms > 0 else 0.0)
        averaging.append(100.0 * averaging_ms / span_ms if span_ms > 0 else 0.0)
    if not history.ranks:
        _no_data(axes, "no settled round")
        return figure
    xs = range(len(history.ranks))
    axes.bar([x - 0.2 for x in xs], idle, width=0.4, label="idle", color="C1")
    axes.bar([x + 0.2 for x in xs], averaging, width=0.4, label="averaging", color="C0")
    axes.set_xticks(list(xs), [str(rank) for rank in history.ranks])
    axes.legend(loc="best", fontsize="small")
    return figure


def round_time(history: RunHistory) -> Figure:
    """Each settled round's duration (ms) over its number; redone rounds marked, rounds
    that never settled drawn as dotted lines."""
    figure, axes = _figure("Averaging round time")
    axes.set_xlabel("round")
    axes.set_ylabel("SyncNow to last ack (ms)")
    rows = history.rounds
    if not rows:
        _no_data(axes, "no settled round")
        return figure
    style = "o-" if len(rows) <= MARKERS_UP_TO else "-"
    axes.plot([r.round for r in rows], [r.duration_s * 1000.0 for r in rows], style, markersize=3)
    redone = [r for r in rows if r.redo]
    if redone:
        axes.plot(
            [r.round for r in redone],
            [r.duration_s * 1000.0 for r in redone],
            "s",
            color="C3",
            label="redone on a re-formed group",
        )
    for i, number in enumerate(history.unsettled):
        label = "started, never settled" if i == 0 else None
        axes.axvline(number, color="grey", linestyle=":", linewidth=1.0, label=label)
    if redone or history.unsettled:
        axes.legend(loc="best", fontsize="small")
    durations = [r.duration_s for r in rows if r.duration_s > 0]
    if durations and max(durations) > 100 * min(durations):
        axes.set_yscale("log")  # the first round (ranks still starting) dwarfs the rest
    return figure


def divergence(history: RunHistory) -> Figure:
    """Per rank, its divergence at each round it reported one."""
    figure, axes = _figure("Divergence from the average per rank")
    axes.set_xlabel("round")
    axes.set_ylabel("||pre - post|| / ||post|| (ratio)")
    if not _per_rank_lines(history, axes, "divergence", over_time=False):
        _no_data(axes, "no rank reported a divergence")
    return figure


def loss(history: RunHistory) -> Figure:
    """The training loss against wall time: each window's mean over every rank's batches
    (at the end of the round that averaged it), and each aggregated epoch's average."""
    figure, axes = _figure("Training loss over time")
    axes.set_xlabel("time since the coordinator started (s)")
    axes.set_ylabel("average training loss")
    windows = [(row.end, row.loss) for row in history.rounds if row.loss is not None]
    if not windows and not history.epochs:
        _no_data(axes, "no rank reported a loss")
        return figure
    if windows:
        axes.plot([t for t, _ in windows], [v for _, v in windows], ".-", label="window")
    if history.epochs:
        epochs_t = [e[2] for e in history.epochs]
        axes.plot(epochs_t, [e[1] for e in history.epochs], "o", label="epoch")
    axes.legend(loc="upper right")
    return figure


def timeline(history: RunHistory) -> Figure:
    """Settled rounds as spans on the top row (redone ones red); deaths, regroups, rejoins,
    redone rounds and saves as labelled markers on a row each; marks of a row close in time
    share one label."""
    figure, axes = _figure("Timeline", (8.0, 3.8))
    axes.set_xlabel("time since the coordinator started (s)")
    rows = ["rounds", *ROWS]
    levels = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
    for redo, color in ((False, "C0"), (True, "C3")):
        spans = [(r.start, max(r.duration_s, 1e-4)) for r in history.rounds if r.redo is redo]
        axes.broken_barh(spans, (levels["rounds"] - 0.3, 0.6), color=color, alpha=0.6)
    first = min((float(r["t"]) for r in history.records if "t" in r), default=0.0)
    pad = max(history.end - first, 1e-3) * 0.03
    counts = dict.fromkeys(ROWS, 0)
    for row, t, labels in _grouped(history, pad):
        counts[row] += len(labels)
        y = levels[row]
        axes.plot([t], [y], "v" if row == "deaths" else "o", color="C3")
        text = ", ".join(labels)
        axes.annotate(text, (t, y), xytext=(3, 4), textcoords="offset points", fontsize=7)
    for record in history.of_kind("Shutdown"):
        axes.axvline(float(record["t"]), color="grey", linestyle="--", linewidth=0.8)
    names = [f"rounds ({len(history.rounds)})", *(f"{n} ({counts[n]})" for n in ROWS)]
    axes.set_yticks([levels[name] for name in rows], names)
    axes.set_ylim(-0.7, len(rows) - 0.3)
    axes.set_xlim(first - pad, history.end + pad)
    return figure


def _grouped(history: RunHistory, within: float) -> list[tuple[str, float, list[str]]]:
    """(row, time of the first, labels) for each run of marks of a row less than ``within``
    seconds after the group's first."""
    groups: list[tuple[str, float, list[str]]] = []
    for mark in sorted(history.marks, key=lambda m: (m.row, m.t)):
        if groups and groups[-1][0] == mark.row and mark.t - groups[-1][1] < within:
            groups[-1][2].append(mark.label)
        else:
            groups.append((mark.row, mark.t, [mark.label]))
    return groups


PLOTS = (
    Plot("timeline", "Timeline", "Settled rounds (top row), deaths, group re-formations, "
         "rejoins, redone rounds, save requests and saves; dashed: shutdown.", timeline),
    Plot("samples_per_s", "Throughput", "Each rank's samples/s while it trained in a window "
         "(batch size over its ms per batch), at the start of the round closing it.",
         samples_per_s),
    Plot("batches", "Batches per round", "How many batches each rank ran in the window each "
         "round averaged (ElChe gives slow ranks fewer).", batches),
    Plot("shares", "Idle and averaging", "Per rank: time waiting for the round to start "
         "(idle) and time from SyncNow to its ack (averaging), as a share of the windows "
         "and rounds it was in.", shares),
    Plot("round_time", "Round time", "Each settled round from SyncNow to the last ack; "
         "square: redone on a re-formed group; dotted: a round started that never settled "
         "(a member died in it).", round_time),
    Plot("divergence", "Divergence", "How far each rank's parameters were from the average "
         "when it averaged: ||pre - post|| / ||post||.", divergence),
    Plot("loss", "Loss", "Training loss against wall time: each window's mean over every "
         "rank's batches (SyncEnd) and each epoch's average (EpochAggregated).", loss),
)  # fmt: skip
"""Every plot, in the page's order."""
