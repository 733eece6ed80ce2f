"""The metrics a picture shows (the changed and the failing ones, as :class:`Bar`) and ``changes.png``, their bar
chart.

Every picture of a run draws the same selection (:func:`changed_bars`): the Mermaid charts of ``report.md``
(:mod:`vramgate.report.mermaid`), the SVG charts of the HTML page (:mod:`vramgate.report.html`) and
``changes.png``. matplotlib is imported only here and only when ``changes.png`` is drawn; without it the report
says the picture was left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramgate.core.checks import Verdict, verdict_text
from vramgate.core.kinds import changed_by_kind
from vramgate.report.summary import verdict_rank
from vramgate.store.report_files import Report, Row, as_report

#: The colour of a bar by its :attr:`Bar.state`: failing red, improved green, otherwise changed blue.
STATE_COLORS = {"failing": "#d62728", "improved": "#2ca02c", "changed": "#1f77b4"}
#: The most bars ``changes.png`` draws (the largest changes; the title counts the others).
PNG_BARS = 60
#: The longest label a chart shows (longer ones are cut, with an ellipsis).
LABEL_CHARS = 48


@dataclass(frozen=True)
class Bar:
    """One changed or failing metric of a run, as a chart draws it."""

    suite: str
    test: str
    """The test's node id."""
    metric: str
    change: float
    """The relative change against the baseline (a finite fraction: 0.05 is +5%)."""
    verdict: Verdict
    failed: bool
    outside_budget: bool = False

    @property
    def verdict_text(self) -> str:
        """The verdict as the tables show it."""
        return verdict_text(self.verdict, self.outside_budget)

    @property
    def state(self) -> str:
        """``failing``, ``improved`` or ``changed`` (the key of :data:`STATE_COLORS`)."""
        if self.failed:
            return "failing"
        return "improved" if self.verdict == "improved" else "changed"

    @property
    def color(self) -> str:
        """The bar's colour (:data:`STATE_COLORS`)."""
        return STATE_COLORS[self.state]

    @property
    def label(self) -> str:
        """The test id without its file and the metric, at most :data:`LABEL_CHARS` long: a long test id is cut
        (the metric is kept whole)."""
        test = self.test.split("::", 1)[-1]
        return f"{short_label(test, max(LABEL_CHARS - len(self.metric) - 3, 12))} · {self.metric}"


def short_label(text: str, limit: int = LABEL_CHARS) -> str:
    """*text* cut to *limit* characters, the cut marked with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def metric_kinds(report: Report) -> dict[tuple[str, str], str]:
    """The kind (``exact``, ``measured``, ...) of every metric of a report, by (node id, metric)."""
    return {(m.nodeid, m.metric.name): m.metric.kind for m in report.metrics()}


def is_changed(row: Row, kind: str) -> bool:
    """Whether *row* belongs in a picture: it fails, or it has a finite change and either a verdict other than
    ``ok`` or an exact figure that moved within its tolerance (a measured one judged ``ok`` moved within its
    noise): its kind's rule, as :attr:`vramgate.report.compare.ComparedMetric.changed` asks it."""
    if row.failed:
        return True
    if row.change_value is None or not math.isfinite(row.change_value):
        return False
    return changed_by_kind(kind, row.verdict, row.change_value)  # a figure outside its budget failed above


def changed_bars(data: Report | dict[str, Any]) -> list[Bar]:
    """The changed and failing metrics of a report that have a finite change, by suite, then failing first, then
    the largest change first."""
    report = as_report(data)
    kinds = metric_kinds(report)
    bars = [
        Bar(suite=t.suite, test=r.test, metric=r.metric, change=float(r.change_value), verdict=r.verdict,
            failed=r.failed, outside_budget=r.outside_budget)
        for t in report.tests for r in t.rows
        if r.change_value is not None and math.isfinite(r.change_value)
        and is_changed(r, kinds.get((r.test, r.metric), ""))
    ]
    return sorted(bars, key=lambda b: (b.suite, not b.failed, verdict_rank(b.verdict, b.outside_budget),
                                       -abs(b.change), b.label))


def failing_without_change(report: Report) -> list[Row]:
    """The failing metrics no bar can show: no baseline to change from (missing, a broken ceiling) or an
    infinite change."""
    return [row for row in report.rows()
            if row.failed and (row.change_value is None or not math.isfinite(row.change_value))]


def by_suite(bars: list[Bar]) -> dict[str, list[Bar]]:
    """*bars* grouped by suite, suites in name order, each suite's bars in their order."""
    out: dict[str, list[Bar]] = {}
    for bar in sorted(bars, key=lambda b: b.suite):
        out.setdefault(bar.suite, []).append(bar)
    return out


def plot_changes(data: Report | dict[str, Any], path: Path) -> list[Bar] | None:
    """Bar chart (PNG) of the changed and failing metrics of report data into *path*; the bars drawn (the
    largest :data:`PNG_BARS`), an empty list where nothing changed (no file is written), None without
    matplotlib."""
    bars = changed_bars(data)
    if not bars:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shown = sorted(bars, key=lambda b: (not b.failed, -abs(b.change)))[:PNG_BARS]
    shown.sort(key=lambda b: (b.suite, not b.failed, -abs(b.change), b.label))
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.3 * len(shown) + 1.4)))
    try:
        labels = [f"{b.suite} · {b.label}" for b in shown]
        ax.barh(range(len(shown)), [b.change * 100 for b in shown], color=[b.color for b in shown])
        ax.set_yticks(range(len(shown)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_xlabel("change vs baseline (%)")
        more = f"; {len(bars) - len(shown)} smaller change(s) not drawn" if len(bars) > len(shown) else ""
        ax.set_title(f"vramgate: {len(bars)} changed or failing metric(s) (red: failing, green: improved, "
                     f"blue: changed){more}", fontsize=10)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, format="png")
    finally:
        plt.close(fig)
    return shown
