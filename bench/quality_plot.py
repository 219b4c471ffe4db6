"""The plot of the time-to-quality bench: validation loss against training seconds.

One panel per workload and layout of a ``quality.json``, one line per run (a colour per
variant; later repeats of a variant fainter), the solo run's loss at its budget as a dashed
line. The y axis starts below the lowest loss and leaves out the first tenth of the budget,
where every curve falls from the initial loss, so the end of the race is readable.

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

COLOURS = ("#444444", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


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
    figure, axes = plt.subplots(len(cells), 1, figsize=(9, 4.8 * max(len(cells), 1)), squeeze=False)
    for axis, cell in zip(axes[:, 0], cells, strict=True):
        colour = 0
        for name, variant in cell["variants"].items():
            runs = [run for run in variant.get("runs", []) if "curve" in run]
            if not runs:
                continue
            shade = COLOURS[colour % len(COLOURS)]
            colour += 1
            for repeat, run in enumerate(runs):
                axis.plot(
                    [p["t"] for p in run["curve"]],
                    [p["loss"] for p in run["curve"]],
                    color=shade,
                    alpha=1.0 if repeat == 0 else 0.45,
                    linewidth=1.8 if name != "solo" else 2.4,
                    marker=".",
                    markersize=4,
                    label=name if repeat == 0 else None,
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
        axis.legend(fontsize=8)
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
