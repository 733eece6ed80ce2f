"""``changes.png``: a bar chart of the relative change of every compared metric.

matplotlib is imported only here and only when a report is written; without it the report says the plot was
left out.
"""

from __future__ import annotations

import math
from pathlib import Path

from vramgate.report.table import Row


def plot_changes(rows: list[Row], path: Path) -> bool:
    """Bar chart (PNG) of the relative change of every compared metric into *path*; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    data = [r for r in rows if r.change_value is not None and math.isfinite(r.change_value)]
    height = max(2.5, 0.25 * len(data) + 1.0)
    fig, ax = plt.subplots(figsize=(9, height))
    try:
        if data:
            labels = [f"{r.test.split('::', 1)[-1]} · {r.metric}" for r in data]
            values = [r.change_value * 100 for r in data if r.change_value is not None]
            colors = ["#d62728" if r.failed else ("#2ca02c" if r.verdict == "improved" else "#7f7f7f")
                      for r in data]
            ax.barh(range(len(data)), values, color=colors)
            ax.set_yticks(range(len(data)))
            ax.set_yticklabels(labels, fontsize=7)
            ax.invert_yaxis()
            ax.axvline(0, color="black", linewidth=0.8)
        else:
            ax.text(0.5, 0.5, "no metric was compared with a baseline", ha="center", va="center")
        ax.set_xlabel("change vs baseline (%)")
        ax.set_title("vramgate: change of each metric (red: failing, green: improved)")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)
    return True
