"""The charts of ``report.md``: one Mermaid ``xychart-beta`` per suite, drawn by GitHub where the markdown is shown
(a job summary, a PR comment), of the suite's changed and failing metrics (:func:`vramgate.report.chart.changed_bars`).

Note [mermaid bars from zero]: an xychart draws every bar from the edge of its plot, not from zero, so a
negative change would look like a positive one. Each chart gets the axis range [lo, hi] around zero and, per
bar, a coloured bar to ``max(change, 0)``, then a bar in the background colour to ``min(change, 0)`` drawn over
it: what stays coloured is the span between zero and the change. Bars of the other colours stand at ``lo``; the
mask, drawn last, also hides the stub the plot's padding gives them. The chart fixes its own colours (the
``base`` theme, a white background), so the mask matches the background in a light and a dark page alike.
"""

from __future__ import annotations

import json
from typing import Any

from vramgate.report.chart import STATE_COLORS, Bar, by_suite, changed_bars, failing_without_change
from vramgate.report.svg import axis_ticks
from vramgate.store.report_files import Report, as_report

#: The most bars one suite's chart draws (failing first, then the largest changes; the others are counted).
MERMAID_BARS = 12
BACKGROUND = "#ffffff"
TEXT = "#24292f"
ZERO = "#57606a"


def mermaid_text(text: str) -> str:
    """*text* fit for a double-quoted Mermaid string inside a markdown code fence: no double quote, backtick,
    ``%%`` (a Mermaid comment), ``#...;`` (an entity), backslash or line break."""
    out = text.replace('"', "'").replace("`", "'").replace("\\", "/").replace("#", "no.").replace(";", ",")
    out = " ".join(out.split())
    while "%%" in out:
        out = out.replace("%%", "%")
    return out


def unique_labels(labels: list[str]) -> list[str]:
    """*labels* made distinct (an xychart draws equal category labels as one): a repeat gets `` (2)``, ..."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return out


def _number(value: float, decimals: int = 2) -> str:
    """*value* as a Mermaid number: fixed point (no exponent), no ``-0``."""
    text = f"{value:.{decimals}f}"
    if decimals > 2:
        text = text.rstrip("0").rstrip(".")
    return text[1:] if text.startswith("-") and float(text) == 0 else text


def xychart(suite: str, bars: list[Bar]) -> str:
    """The Mermaid ``xychart-beta`` (horizontal) of *bars*: their change in %, titled with *suite*."""
    if not bars:
        raise ValueError(f"suite {suite}: a chart needs at least one bar")
    values = [round(b.change * 100, 2) for b in bars]
    ticks = axis_ticks(min(0.0, *values), max(0.0, *values))
    lo, hi = ticks[0], ticks[-1]
    negative = lo < 0
    states = [s for s in STATE_COLORS if any(b.state == s for b in bars)]
    colors = [STATE_COLORS[s] for s in states] + [BACKGROUND] + ([ZERO] if negative else [])
    init = {
        "theme": "base",
        "xyChart": {"width": 860, "height": 150 + 36 * len(bars)},
        "themeVariables": {"xyChart": {
            "backgroundColor": BACKGROUND, "titleColor": TEXT,
            "xAxisLabelColor": TEXT, "xAxisTitleColor": TEXT, "xAxisTickColor": TEXT, "xAxisLineColor": TEXT,
            "yAxisLabelColor": TEXT, "yAxisTitleColor": TEXT, "yAxisTickColor": TEXT, "yAxisLineColor": TEXT,
            "plotColorPalette": ", ".join(colors),
        }},
    }
    labels = ", ".join(f'"{label}"' for label in unique_labels([mermaid_text(b.label) for b in bars]))
    lines = [
        f"%%{{init: {json.dumps(init)}}}%%",
        "xychart-beta horizontal",
        f'    title "{mermaid_text(suite)}: change vs baseline (%)"',
        f"    x-axis [{labels}]",
        f'    y-axis "change (%)" {_number(lo, 6)} --> {_number(hi, 6)}',
    ]
    for state in states:  # Note [mermaid bars from zero]
        drawn = [max(v, 0.0) if b.state == state else lo for b, v in zip(bars, values, strict=True)]
        lines.append(f"    bar [{', '.join(_number(v) for v in drawn)}]")
    lines.append(f"    bar [{', '.join(_number(min(v, 0.0)) for v in values)}]")
    if negative:
        lines.append(f"    line [{', '.join('0.00' for _ in values)}]")
    return "\n".join(lines)


def mermaid_section(data: Report | dict[str, Any], limit: int = MERMAID_BARS) -> list[str]:
    """The markdown lines of the changes of a report: per suite with a changed or failing metric, its chart
    (at most *limit* bars, the others counted); or one line saying that nothing changed."""
    report = as_report(data)
    out: list[str] = []
    suites = by_suite(changed_bars(report))
    for suite, bars in suites.items():
        shown = bars[:limit]
        out += ["```mermaid", xychart(suite, shown), "```", ""]
        if len(bars) > len(shown):
            out += [f"{len(bars) - len(shown)} more changed metric(s) of `{suite}` not drawn (smaller changes; the "
                    "table below lists them).", ""]
    blank = failing_without_change(report)
    if blank:
        names = ", ".join(f"`{r.test.split('::', 1)[-1]}` {r.metric} ({r.verdict_text})" for r in blank[:5])
        more = f" and {len(blank) - 5} more" if len(blank) > 5 else ""
        out += [f"{len(blank)} failing metric(s) have no change to draw: {names}{more}.", ""]
    if not suites and not blank:
        out += ["No metric changed against its baseline: nothing to chart.", ""]
    return out
