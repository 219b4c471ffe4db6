"""``flodl report --tensorboard DIR``: a run's event log as TensorBoard scalars.

Per settled round (step = the round number, wall time = the record's ``unix``):
``samples_per_s/rank<R>``, ``idle_share/rank<R>`` (idle time over the window, 0..1),
``averaging_ms/rank<R>``, ``divergence/rank<R>``, ``batches/rank<R>`` and
``round/duration_ms``; per epoch (step = the epoch): ``epoch/avg_loss``. Values a record
lacks (no batches yet, no divergence) are left out, not written as zero. Needs the
``tensorboard`` package (``pip install 'flodl[tensorboard]'``); written with its event file
writer as plain ``simple_value`` scalar summaries (what torch's ``SummaryWriter.add_scalar``
writes, without importing torch), which TensorBoard and its EventAccumulator read.
"""

from __future__ import annotations

from pathlib import Path

from flodl.errors import ConfigError
from flodl.observe.history import RunHistory, load_history

__all__ = ["export_tensorboard"]

PER_RANK = ("samples_per_s", "averaging_ms", "divergence", "batches")
"""Keys of a round record's per-rank facts written as they are, tagged ``<key>/rank<R>``."""


def scalars(history: RunHistory) -> list[tuple[str, float, int, float]]:
    """Every scalar the export writes: (tag, value, step, unix wall time), in log order."""
    out: list[tuple[str, float, int, float]] = []
    for row in history.rounds:
        for rank in sorted(row.ranks):
            for key in PER_RANK:
                value = row.value(rank, key)
                if value is not None:
                    out.append((f"{key}/rank{rank}", value, row.round, row.unix))
            idle_ms = row.value(rank, "idle_ms")
            if idle_ms is not None and row.window_s > 0:
                share = min(max(idle_ms / (row.window_s * 1000.0), 0.0), 1.0)
                out.append((f"idle_share/rank{rank}", share, row.round, row.unix))
        out.append(("round/duration_ms", row.duration_s * 1000.0, row.round, row.unix))
    for epoch, avg_loss, _, unix in history.epochs:
        out.append(("epoch/avg_loss", avg_loss, epoch, unix))
    return out


def export_tensorboard(run_dir: Path, out_dir: Path) -> int:
    """Write ``run_dir``'s event log to ``out_dir`` as TensorBoard scalars (one new event
    file); return how many. Raises ConfigError when the event log is missing or empty, or
    the tensorboard package is not installed."""
    history = load_history(run_dir)
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise ConfigError(
            "flodl report --tensorboard needs the tensorboard package: "
            "pip install 'flodl[tensorboard]'"
        ) from None
    rows = scalars(history)
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(out_dir))
    try:
        for tag, value, step, unix in rows:
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
            writer.add_event(Event(wall_time=unix, step=step, summary=summary))
    finally:
        writer.close()
    return len(rows)
