"""The plot of the time-to-quality bench: validation loss against training seconds.

One panel per workload and layout of a ``quality.json``, one line per variant: its median run
(the repeat whose loss at budget is the median; with an even count the lower of the middle
two), the solo runs' median loss at budget as a dashed line. Baselines are drawn dashed-dotted,
torchft's peers dotted, flodl's runs solid. The y axis starts below the lowest loss and leaves
out the first tenth of the budget, where every curve falls from the initial loss, so the end of
the race is readable.

    .venv/bin/python bench/quality_plot.py bench/results/quality.json docs/images/quality.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLOURS = (
    "#222222",
    "#7f7f7f",
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#aec7e8",
)
STYLES = {"solo": "-.", "solo+busy": "-.", "ddp": "-."}
"""Line styles by variant name (``torchft-*``: dotted; the rest, flodl's: solid)."""


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose loss at budget is the median (the lower middle one of an even count)."""
    ranked = sorted(runs, key=lambda run: run["loss_at_budget"])
    return ranked[(len(ranked) - 1) // 2]


def style(name: str) -> str:
    return ":" if name.startswith("torchft") else STYLES.get(name, "-")


def loss_range(cell: dict[str, Any]) -> tuple[float, float]:
    """The y range of a panel: every loss after the first tenth of the budget."""
    late = [
        point["loss"]
        for variant in cell["variants"].values()
        for run in variant.get("runs", [])
        for point in run.get("curve", [])
        if point["t"] >= cell["budget_s"] / 10
    ]
    if not late:
        return 0.0, 1.0
    low, high = min(late), max(late)
    pad = max(high - low, 1e-3) * 0.05
    return low - pad, high + pad


def plot(result: dict[str, Any], path: Path) -> None:
    """Draw ``result`` (a quality.json) into ``path`` (PNG)."""
    cells = list(result["results"].values())
    columns = 2 if len(cells) > 1 else 1
    rows = max(-(-len(cells) // columns), 1)
    figure, axes = plt.subplots(rows, columns, figsize=(9 * columns, 4.8 * rows), squeeze=False)
    for axis in axes.flat[len(cells) :]:
        axis.set_visible(False)
    for axis, cell in zip(axes.flat, cells, strict=False):
        colour = 0
        for name, variant in cell["variants"].items():
            runs = [run for run in variant.get("runs", []) if "curve" in run]
            if not runs:
                continue
            shade = COLOURS[colour % len(COLOURS)]
            colour += 1
            run = median_run(runs)
            axis.plot(
                [p["t"] for p in run["curve"]],
                [p["loss"] for p in run["curve"]],
                color=shade,
                linestyle=style(name),
                linewidth=1.6 if name != "solo" else 2.4,
                marker=".",
                markersize=3,
                label=f"{name} ({run['loss_at_budget']:.3f})",
            )
        target = cell.get("solo_loss_at_budget")
        if target is not None:
            axis.axhline(target, color="#444444", linestyle="--", linewidth=0.8)
        axis.set_ylim(*loss_range(cell))
        axis.set_xlim(0, cell["budget_s"] * 1.02)
        layout = cell["layout"]
        axis.set_title(
            f"{cell['workload']}: {layout['ranks']} ranks, rank {layout['slow_rank']} "
            f"{layout['slow_factor']:g}x slower; budget {cell['budget_s']:g} s, "
            f"{cell['repeats']} repeat(s)",
            fontsize=10,
        )
        axis.set_xlabel("training seconds (start-up and evaluation excluded)")
        axis.set_ylabel("validation loss (nats)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, ncol=2)
    load = result["load_average"]
    figure.suptitle(
        f"Time to quality, {result['date'][:10]} (1-minute load {load['start']} - {load['end']})"
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    plot(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
