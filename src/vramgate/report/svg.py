"""Inline SVG charts drawn from plain numbers: horizontal bars of changes, lines over time, and a memory slope's
samples and fit.

Each function returns one ``<svg>`` element as text, self-contained (no font, image or script it loads), for the
HTML page of :mod:`vramgate.report.html`. Text is escaped here; callers pass plain strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

from vramgate.core.leak import LeakFit

#: Line colours, in the order lines take them.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
#: Average width of a character of the 12 px labels, to size the label column.
CHAR_PX = 6.6
FONT = "font-family=\"system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif\""


def axis_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [*lo*, *hi*]: the smallest step of 1, 2, 2.5 or 5 times a power of ten that
    needs at most *count* intervals; the first tick is at or below *lo*, the last at or above *hi*."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"axis bounds must be finite numbers, not {lo!r} and {hi!r}")
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    power = 10 ** math.floor(math.log10((hi - lo) / count))
    for step in (m * power for m in (1, 2, 2.5, 5, 10, 20)):
        first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
        if last - first <= count:
            break
    return [round(n * step, 12) + 0.0 for n in range(first, last + 1)]


def tick_text(value: float) -> str:
    """A tick value without needless decimals (``5``, ``2.5``, ``-0.25``)."""
    return f"{value:.6g}"


def _opening(css_class: str, width: int, height: int, title: str) -> list[str]:
    """The first parts of a chart: the ``<svg>`` element, its title for screen readers, the title drawn."""
    return [f'<svg class="{css_class}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" {FONT}>',
            f"<title>{escape(title)}</title>",
            _text(8, 20, title, size=14, weight="600")]


def _text(x: float, y: float, text: str, *, anchor: str = "start", size: int = 12, weight: str = "normal",
          color: str = "#24292f", extra: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" font-weight="{weight}" '
            f'fill="{color}"{extra}>{escape(text)}</text>')


@dataclass(frozen=True)
class Line:
    """One line of :func:`line_chart`: its name (the legend) and a value per x position (None: no point)."""

    name: str
    values: list[float | None]
    color: str


def bar_chart(labels: list[str], values: list[float], colors: list[str], *, title: str, unit: str = "%",
              css_class: str = "changes", width: int = 900) -> str:
    """Horizontal bars of *values* (one per label, drawn from zero), each printed at its end with *unit*."""
    if not (len(labels) == len(values) == len(colors)):
        raise ValueError(f"bar_chart: {len(labels)} labels, {len(values)} values and {len(colors)} colours")
    row, top, bottom = 22, 34, 36
    label_w = min(380, max((len(t) for t in labels), default=0) * CHAR_PX + 12)
    left, right = label_w + 8, 70
    plot_w = width - left - right
    height = top + row * len(values) + bottom
    ticks = axis_ticks(min(0.0, *values), max(0.0, *values))
    lo, hi = ticks[0], ticks[-1]

    def x(v: float) -> float:
        return left + (v - lo) / (hi - lo) * plot_w

    parts = _opening(css_class, width, height, title)
    for t in ticks:
        parts.append(f'<line x1="{x(t):.1f}" y1="{top - 4}" x2="{x(t):.1f}" y2="{height - bottom + 4}" '
                     f'stroke="#d0d7de" stroke-width="1"/>')
        parts.append(_text(x(t), height - bottom + 18, tick_text(t) + unit, anchor="middle", size=11,
                           color="#57606a"))
    for i, (label, value, color) in enumerate(zip(labels, values, colors, strict=True)):
        y = top + i * row
        x0, x1 = sorted((x(0.0), x(value)))
        parts.append(f'<rect x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 1.0):.1f}" height="{row - 6}" '
                     f'fill="{color}"><title>{escape(label)}: {value:+.2f}{escape(unit)}</title></rect>')
        parts.append(_text(left - 8, y + row / 2 + 4, label, anchor="end"))
        end, anchor = (x1 + 4, "start") if value >= 0 else (x0 - 4, "end")
        if anchor == "end" and end - 60 < left:
            end, anchor = x1 + 4, "start"
        parts.append(_text(end, y + row / 2 + 4, f"{value:+.2f}{unit}", anchor=anchor, size=11))
    parts.append(f'<line x1="{x(0.0):.1f}" y1="{top - 4}" x2="{x(0.0):.1f}" y2="{height - bottom + 4}" '
                 f'stroke="#24292f" stroke-width="1.2"/>')
    parts.append("</svg>")
    return "\n".join(parts)


def line_chart(x_labels: list[str], lines: list[Line], *, title: str, unit: str = "%", css_class: str = "history",
               width: int = 900, height: int = 300) -> str:
    """*lines* over the x positions *x_labels* (evenly spaced, a few labelled), with a legend under the plot."""
    for line in lines:
        if len(line.values) != len(x_labels):
            raise ValueError(f"line_chart: line {line.name!r} has {len(line.values)} values for "
                             f"{len(x_labels)} x positions")
    values = [v for line in lines for v in line.values if v is not None]
    if not values:
        raise ValueError(f"line_chart: {title!r} has no value to draw")
    ticks = axis_ticks(min(values), max(values))
    lo, hi = ticks[0], ticks[-1]
    left, right, top, plot_h = 64, 24, 34, height - 34 - 46
    plot_w = width - left - right
    legend_top = top + plot_h + 46
    total = legend_top + 20 * len(lines) + 8

    def x(i: int) -> float:
        return left + (plot_w / 2 if len(x_labels) == 1 else i * plot_w / (len(x_labels) - 1))

    def y(v: float) -> float:
        return top + (hi - v) / (hi - lo) * plot_h

    parts = _opening(css_class, width, total, title)
    for t in ticks:
        parts.append(f'<line x1="{left}" y1="{y(t):.1f}" x2="{left + plot_w}" y2="{y(t):.1f}" stroke="#d0d7de" '
                     'stroke-width="1"/>')
        parts.append(_text(left - 6, y(t) + 4, tick_text(t) + unit, anchor="end", size=11, color="#57606a"))
    every = max(1, math.ceil(len(x_labels) / 8))
    for i, label in enumerate(x_labels):
        if i % every == 0 or i == len(x_labels) - 1:
            parts.append(_text(x(i), top + plot_h + 18, label, anchor="middle", size=11, color="#57606a"))
    for n, line in enumerate(lines):
        points = [(x(i), y(v)) for i, v in enumerate(line.values) if v is not None]
        path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{line.color}" stroke-width="2"/>')
        parts += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{line.color}"/>' for px, py in points]
        ly = legend_top + 20 * n
        parts.append(f'<rect x="{left}" y="{ly - 10}" width="14" height="4" fill="{line.color}"/>')
        parts.append(_text(left + 20, ly - 3, line.name, size=12))
    parts.append("</svg>")
    return "\n".join(parts)


def slope_chart(fit: LeakFit, *, title: str, ceiling: float | None = None, width: int = 900,
                height: int = 320) -> str:
    """A memory slope's picture (*fit*: a :class:`~vramgate.core.leak.LeakFit`): memory (MiB) against completed
    requests (tokens), the warm-up's samples in grey, the measured part's in blue, its levels in orange, the
    fitted line in black and, with *ceiling* (bytes per 1,000), the allowance's slope through the levels' centre,
    dashed red."""
    samples, warmup, levels = fit.samples, fit.warmup, fit.levels
    points = [*warmup, *samples, *levels]
    if not points:
        raise ValueError(f"slope_chart: {title!r} has no sample to draw")
    mib = float(1 << 20)
    xs = [p[0] for p in points]
    ys = [p[1] / mib for p in points]
    xt, yt = axis_ticks(min(xs), max(xs), 8), axis_ticks(min(ys), max(ys))
    left, right, top, plot_h = 76, 24, 34, height - 34 - 64
    plot_w = width - left - right

    def x(v: float) -> float:
        return left + (v - xt[0]) / (xt[-1] - xt[0]) * plot_w

    def y(v: float) -> float:
        return top + (yt[-1] - v / mib) / (yt[-1] - yt[0]) * plot_h

    parts = _opening("slope", width, height, title)
    for t in yt:
        parts.append(f'<line x1="{left}" y1="{y(t * mib):.1f}" x2="{left + plot_w}" y2="{y(t * mib):.1f}" '
                     'stroke="#d0d7de" stroke-width="1"/>')
        parts.append(_text(left - 6, y(t * mib) + 4, f"{tick_text(t)} MiB", anchor="end", size=11, color="#57606a"))
    for t in xt:
        parts.append(_text(x(t), top + plot_h + 18, tick_text(t), anchor="middle", size=11, color="#57606a"))
    per = fit.per
    parts.append(_text(left + plot_w / 2, top + plot_h + 36, f"{per}s completed", anchor="middle", size=12))
    for group, color, r in ((warmup, "#8c959f", 1.6), (samples, PALETTE[0], 1.6)):
        parts += [f'<circle cx="{x(px):.1f}" cy="{y(py):.1f}" r="{r}" fill="{color}" fill-opacity="0.6"/>'
                  for px, py in group]
    if levels:
        lx0, lx1 = levels[0][0], levels[-1][0]
        slope, intercept = fit.slope, fit.intercept
        parts.append(f'<line x1="{x(lx0):.1f}" y1="{y(intercept + slope * lx0):.1f}" x2="{x(lx1):.1f}" '
                     f'y2="{y(intercept + slope * lx1):.1f}" stroke="#24292f" stroke-width="2"/>')
        if ceiling is not None:
            cx = sum(p[0] for p in levels) / len(levels)
            cy = sum(p[1] for p in levels) / len(levels)
            allowed = ceiling / 1000.0
            parts.append(f'<line x1="{x(lx0):.1f}" y1="{y(cy + allowed * (lx0 - cx)):.1f}" x2="{x(lx1):.1f}" '
                         f'y2="{y(cy + allowed * (lx1 - cx)):.1f}" stroke="{PALETTE[3]}" stroke-width="1.5" '
                         'stroke-dasharray="6 4"/>')
        parts += [f'<circle cx="{x(px):.1f}" cy="{y(py):.1f}" r="4.5" fill="{PALETTE[1]}" stroke="#24292f" '
                  'stroke-width="0.8"/>' for px, py in levels]
    legend = [("#8c959f", "warm-up"), (PALETTE[0], "measured samples"), (PALETTE[1], "levels (medians)"),
              ("#24292f", "fitted slope")] + ([(PALETTE[3], "allowance (ceiling)")] if ceiling is not None else [])
    lx = left
    for color, name in legend:
        parts.append(f'<rect x="{lx}" y="{height - 16}" width="14" height="4" fill="{color}"/>')
        parts.append(_text(lx + 20, height - 10, name, size=12))
        lx += 40 + int(len(name) * 7.2)
    parts.append("</svg>")
    return "\n".join(parts)
