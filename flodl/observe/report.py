"""``flodl report RUN_DIR``: a page of plots of a run's event log, ``RUN_DIR/report/index.html``.

The page opens with a summary table (status, root cause, wall time, final metrics, ranks,
rounds, deaths; from ``summary.json`` where the run wrote one, else from the event log,
and it says which), then one SVG figure per plot of :data:`flodl.observe.report_plots.PLOTS`
and the run's notable events as sentences. It stands on its own: inline CSS, no script,
nothing fetched. matplotlib is imported only when a report is written.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flodl.observe.history import RunHistory, load_history, load_summary
from flodl.observe.state import describe, is_notable

__all__ = ["write_report"]

REPORT_DIR = "report"

STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; line-height: 1.4; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; }
th, td { text-align: left; padding: 0.25rem 0.75rem; border-bottom: 1px solid #ddd;
         vertical-align: top; }
th { background: #f4f4f4; }
figure { margin: 1.5rem 0; }
figure img { width: 100%; border: 1px solid #eee; }
figcaption, .note { color: #555; font-size: 0.9rem; }
.failed { color: #b00; font-weight: bold; }
code { background: #f4f4f4; padding: 0 0.2rem; }
"""


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir/report/index.html`` and one SVG per plot beside it; return the page's
    path. Raises ConfigError naming the file when ``run_dir/events.jsonl`` is missing or
    empty; a missing ``summary.json`` is said on the page. Earlier report files are replaced."""
    history = load_history(run_dir)
    summary = load_summary(run_dir)
    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    figures = _save_figures(history, out)
    index = out / "index.html"
    index.write_text(_page(run_dir, history, summary, figures), encoding="utf-8")
    return index


def _save_figures(history: RunHistory, out: Path) -> list[tuple[str, str, str]]:
    """Draw and save every plot; (file name, heading, caption) of each, in order."""
    import matplotlib

    from flodl.observe.report_plots import PLOTS

    saved = []
    # Text stays text in the SVG (smaller, searchable); no date, so a rerun writes the same.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "flodl"}):
        for plot in PLOTS:
            name = f"{plot.name}.svg"
            plot.draw(history).savefig(out / name, format="svg", metadata={"Date": None})
            saved.append((name, plot.title, plot.caption))
    return saved


def _e(value: object) -> str:
    return html.escape(str(value))


def _page(
    run_dir: Path,
    history: RunHistory,
    summary: Mapping[str, Any] | None,
    figures: list[tuple[str, str, str]],
) -> str:
    title = f"flodl run report: {run_dir.resolve().name}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f'<p class="note">Run folder <code>{_e(run_dir.resolve())}</code>; '
        f"{len(history.records)} events from <code>{_e(history.path.name)}</code>.</p>",
    ]
    if summary is None:
        parts.append(
            '<p class="note">No summary.json in the run folder (the run is still going, or '
            "its launcher was killed): the table below is read from the event log alone.</p>"
        )
    if history.dropped:
        parts.append(
            f'<p class="failed">{history.dropped} events could not be written during the run: '
            "the plots miss them.</p>"
        )
    parts.append(_summary_table(history, summary))
    parts.append("<h2>Plots</h2>")
    for name, heading, caption in figures:
        parts.append(
            f'<figure id="{_e(name)}"><a href="{_e(name)}"><img src="{_e(name)}" '
            f'alt="{_e(heading)}"></a><figcaption><b>{_e(heading)}.</b> {_e(caption)}'
            "</figcaption></figure>"
        )
    parts.append(_events_table(history))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _row(name: str, value: str, css: str = "") -> str:
    klass = f' class="{css}"' if css else ""
    return f"<tr><th>{_e(name)}</th><td{klass}>{value}</td></tr>"


def _summary_table(history: RunHistory, summary: Mapping[str, Any] | None) -> str:
    s = summary or {}
    status = str(s.get("status") or "unknown (no summary.json)")
    message = s.get("message")
    status_text = _e(status) + (f": {_e(message)}" if message else "")
    rows = [_row("status", status_text, "" if status == "completed" else "failed")]
    rows.append(_row("root cause", _root_cause(s.get("root_cause"))))
    wall = s.get("wall_s")
    if wall is not None:
        rows.append(_row("wall time", f"{float(wall):.1f} s"))
    else:
        rows.append(_row("wall time", f"{history.end:.1f} s to the last event (event log)"))
    metrics = s.get("final_metrics") or {}
    rows.append(
        _row("final metrics", ", ".join(f"{_e(k)} {_e(_num(v))}" for k, v in metrics.items()))
        if metrics
        else _row("final metrics", "none reported")
    )
    ranks = [int(r["rank"]) for r in s.get("ranks") or [] if "rank" in r] or history.ranks
    rows.append(_row("ranks", f"{len(ranks)} ({', '.join(str(r) for r in ranks)})"))
    redone = sum(1 for r in history.rounds if r.redo)
    last = history.rounds[-1] if history.rounds else None
    rounds_text = f"{len(history.rounds)} settled" + (f", {redone} redone" if redone else "")
    if history.unsettled:
        listed = ", ".join(str(n) for n in history.unsettled)
        rounds_text += f", {len(history.unsettled)} never settled (round {listed})"
    if last is not None:
        rounds_text += f"; global step {last.global_step}"
    rows.append(_row("rounds", rounds_text))
    rows.append(_row("deaths", _deaths(history, s)))
    return "<h2>Summary</h2><table>" + "".join(rows) + "</table>"


def _num(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _root_cause(cause: object) -> str:
    if not isinstance(cause, Mapping):
        return "none"
    how = cause.get("kind") or "failed"
    if cause.get("signal"):
        how = f"{how} by {cause['signal']}"
    elif cause.get("exit_code") is not None:
        how = f"{how} with exit code {cause['exit_code']}"
    text = f"rank {_e(cause.get('rank'))} (pid {_e(cause.get('pid'))}) {_e(how)}"
    if cause.get("time"):
        text += f" at {_e(cause['time'])}"
    if cause.get("error"):
        text += f"<br><code>{_e(cause['error'])}</code>"
    if cause.get("log"):
        text += f"<br>log: <code>{_e(cause['log'])}</code>"
    return text


def _deaths(history: RunHistory, summary: Mapping[str, Any]) -> str:
    recovered = {
        int(d["rank"]): d.get("recovery_s")
        for d in summary.get("deaths") or []
        if isinstance(d, Mapping) and "rank" in d
    }
    lines = []
    for record in history.of_kind("RankDead"):
        rank = record.get("rank")
        line = (
            f"rank {_e(rank)} at {float(record.get('t', 0.0)):.1f} s "
            f"({_e(record.get('cause'))}: {_e(record.get('why'))})"
        )
        took = recovered.get(int(rank)) if isinstance(rank, int) else None
        if took is not None:
            line += f", recovered in {float(took):.2f} s"
        lines.append(line)
    if not lines:
        return "none"
    return f"{len(lines)}: " + "<br>".join(lines)


def _events_table(history: RunHistory) -> str:
    notable = [r for r in history.records if is_notable(r)]
    if not notable:
        return "<h2>Events</h2><p class='note'>No notable events.</p>"
    rows = "".join(f"<tr><td>{_e(describe(r))}</td></tr>" for r in notable)
    return f"<h2>Events</h2><table>{rows}</table>"
