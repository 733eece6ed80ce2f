"""``vramgate report html``: one self-contained HTML page of a run, to look at rather than read.

The page holds the run's header (hardware, tier, software), the claims with their verdicts, the failing tests'
messages and, per suite, a chart of its changed and failing metrics (:func:`vramgate.report.chart.changed_bars`),
its history when one is given, and its table of metrics. Everything is inline: CSS in a ``<style>`` element, the
charts as SVG drawn here (:mod:`vramgate.report.svg`); the page loads no script, font, style sheet or image, so
it opens from a file, offline, as a CI artifact.

A history is a list of series, one per metric, as ``vramgate history`` writes it::

    [{"suite": "kv_cache", "test": "suites/...::test_x", "metric": "page_bytes", "unit": "B",
      "points": [{"commit": "1a2b3c4", "date": "2026-11-02T10:00:00Z", "value": 65536, "source": "baseline"}]}]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from html import escape
from pathlib import Path
from typing import Any

from vramgate.core.metrics import format_value, unit_of
from vramgate.core.records import read_json
from vramgate.report.chart import Bar, by_suite, changed_bars, is_changed, metric_kinds, short_label
from vramgate.report.svg import PALETTE, Line, bar_chart, line_chart, slope_chart
from vramgate.report.table import HEAD, cells, sorted_rows
from vramgate.report.verdict_table import html_lines
from vramgate.store.report_files import Claim, Report, ReportError, Row, as_report

#: The most bars of one suite's chart of changes, and the most lines of one suite's history chart.
HTML_BARS = 40
HISTORY_LINES = 8
#: Suites whose table has more rows than this start folded (unless a metric of theirs fails); so do more claims
#: than OPEN_CLAIMS.
OPEN_ROWS = 30
OPEN_CLAIMS = 8

CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; color: #24292f;
       margin: 0 auto; max-width: 1100px; padding: 16px 24px 48px; line-height: 1.45; }
h1 { font-size: 26px; margin: 8px 0 4px; } h2 { font-size: 20px; margin: 32px 0 8px;
     border-bottom: 1px solid #d0d7de; padding-bottom: 4px; } h3 { font-size: 15px; margin: 18px 0 6px; }
.status { display: inline-block; padding: 2px 10px; border-radius: 12px; font-size: 15px; font-weight: 600;
          color: #fff; vertical-align: middle; margin-left: 8px; }
.pass { background: #1a7f37; } .fail { background: #cf222e; } .warn { background: #9a6700; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0 12px; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; } td.num { text-align: right; white-space: nowrap; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 8px 0; font-size: 14px; }
dl.facts dt { color: #57606a; } dl.facts dd { margin: 0; }
tr.failing td { background: #ffebe9; } tr.improved td { background: #dafbe1; } tr.changed td { background: #ddf4ff; }
.held { color: #1a7f37; font-weight: 600; white-space: nowrap; }
.not-held { color: #cf222e; font-weight: 600; white-space: nowrap; }
pre { background: #f6f8fa; padding: 10px; overflow-x: auto; font-size: 12px; border-radius: 6px; }
.note { color: #57606a; font-size: 13px; } nav a { margin-right: 12px; } svg { display: block; margin: 6px 0; }
code { font-size: 12px; } .mismatch { color: #9a6700; font-weight: 600; }
.columns { display: flex; gap: 64px; flex-wrap: wrap; } summary { cursor: pointer; }
table.profiles td { text-align: center; white-space: nowrap; } table.profiles td:first-child { text-align: left; }
table.profiles td.failed { background: #ffebe9; } table.profiles td.passed { background: #dafbe1; }
table.profiles tr.failed td:first-child { background: #ffebe9; } ol.notes { font-size: 13px; color: #57606a; }
.legend { font-size: 13px; color: #57606a; }
"""


@dataclass(frozen=True)
class SeriesPoint:
    """One value of a history's series: the commit and date it was accepted (or measured) at, and where from."""

    commit: str
    date: str
    value: float
    source: str


@dataclass(frozen=True)
class Series:
    """One metric's history, as ``vramgate history`` writes it (see the module)."""

    suite: str
    test: str
    metric: str
    unit: str
    points: tuple[SeriesPoint, ...]
    hardware_key: str | None = None
    """The key it is stored under; None: taken as this run's."""


def _series_error(where: str, what: str) -> ReportError:
    return ReportError(f"{where}: {what}")


def check_history(series: Any, source: str = "history") -> list[dict[str, Any]]:
    """*series* (a history's JSON data) checked: a list of series with ``suite``, ``test``, ``metric``, ``unit``
    and ``points`` (each with ``commit``, ``date``, a finite ``value`` and ``source``); :class:`ReportError`
    naming *source*, the series and the field otherwise."""
    if not isinstance(series, list):
        raise _series_error(source, "a history must be a JSON list of series")
    for i, s in enumerate(series):
        where = f"{source}: series {i}"
        if not isinstance(s, dict):
            raise _series_error(where, "must be a JSON object")
        for key in ("suite", "test", "metric", "unit"):
            if not isinstance(s.get(key), str) or not s[key]:
                raise _series_error(where, f"needs {key!r} (a non-empty string)")
        where = f"{where} ({s['test']} {s['metric']})"
        try:
            unit_of(s["unit"])
        except ValueError as exc:
            raise _series_error(where, str(exc)) from None
        if not isinstance(s.get("points"), list):
            raise _series_error(where, "needs 'points' (a list)")
        for j, p in enumerate(s["points"]):
            if not isinstance(p, dict):
                raise _series_error(f"{where}, point {j}", "must be a JSON object")
            for key in ("commit", "date", "source"):
                if not isinstance(p.get(key), str):
                    raise _series_error(f"{where}, point {j}", f"needs {key!r} (a string)")
            value = p.get("value")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _series_error(f"{where}, point {j}", f"'value' must be a finite number, not {value!r}")
    return series


def history_series(series: Any, source: str = "history") -> list[Series]:
    """A history's JSON data (:func:`check_history`) as its records."""
    return [Series(s["suite"], s["test"], s["metric"], s["unit"],
                   tuple(SeriesPoint(p["commit"], p["date"], p["value"], p["source"]) for p in s["points"]),
                   s.get("hardware_key"))
            for s in check_history(series, source)]


def load_history(path: Path) -> list[dict[str, Any]]:
    """The series of a history file (:func:`check_history`): a list of series, or what ``vramgate history
    --json`` prints (an object whose ``series`` is that list); :class:`ReportError` naming the file."""
    data = read_json(path, ReportError)
    if isinstance(data, dict) and "series" in data:
        data = data["series"]
    return check_history(data, str(path))


def _status(report: Report, rows: list[Row]) -> tuple[str, str]:
    if any(r.failed for r in rows) or any(p.failed for p in report.profile_rows()):
        return "regression", "fail"
    if report.moved:
        return "pass, with moved baselines", "warn"
    return "pass", "pass"


def _facts(pairs: list[tuple[str, str]]) -> str:
    body = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in pairs if v)
    return f'<dl class="facts">{body}</dl>'


def _header(report: Report, rows: list[Row], bars: list[Bar]) -> list[str]:
    hw = report.hardware
    status, css = _status(report, rows)
    gpus = ", ".join(f"{g.name or '?'} ({g.memory_bytes / 2**30:.0f} GiB)" for g in hw.gpus)
    memory = f"{hw.memory_bytes / 2**30:.1f} GiB" if hw.memory_bytes else ""
    failing = sum(1 for r in rows if r.failed)
    out = [f'<h1>vramgate report <span class="status {css}">{escape(status)}</span></h1>',
           f'<p class="note">{len(report.tests)} test(s), {len(rows)} metric(s): {failing} failing, '
           f"{len(bars)} changed or failing with a change to draw</p>",
           '<div class="columns"><div>', "<h3>Hardware</h3>",
           _facts([("key", str(hw.key or "?")), ("tier", str(hw.tier or "?")),
                   ("device", hw.device), ("CPU", hw.cpu_model),
                   ("CPU cores", str(hw.cpu_count or "")), ("memory", memory), ("GPUs", gpus),
                   ("CUDA", hw.fact("cuda")), ("driver", hw.fact("driver"))]),
           "</div><div>", "<h3>Software</h3>",
           _facts([(k, str(v)) for k, v in sorted(report.software.items())]), "</div></div>"]
    out += [f'<p class="mismatch">Version mismatch with baseline: {escape(m)}</p>'
            for m in report.version_mismatches]
    if report.moved_baselines and report.moved:
        out.append(f'<p class="mismatch">{len(report.moved)} baseline metric(s) moved against '
                   f'<code>{escape(str(report.moved_baselines.ref))}</code>: review them before merging.</p>')
    return out


def _claims(report: Report) -> list[str]:
    claims = report.claims
    if not claims:
        return []
    held = [c for c in claims if c.held]
    unjudged = [c for c in claims if not c.judged]
    not_held = [c for c in claims if not c.held and c not in unjudged]
    opened = " open" if len(claims) <= OPEN_CLAIMS else ""
    also = f", {len(unjudged)} not judged" if unjudged else ""
    return ['<h2 id="claims">Claims</h2>',
            f"<details{opened}><summary>{len(not_held)} not held, {len(held)} held{also}</summary>",
            *_claim_table(not_held + held + unjudged), "</details>"]


#: How a claim's verdict reads on the page.
CLAIM_MARKS = {"not judged": '<span class="note">not judged</span>', "held": '<span class="held">held</span>',
               "not held": '<span class="not-held">not held</span>'}


def _claim_table(claims: list[Claim]) -> list[str]:
    out = ["<table><tr><th>verdict</th><th>claim</th><th>evidence</th><th>test</th></tr>"]
    for c in sorted(claims, key=lambda c: (not c.judged, c.held, c.test, c.statement)):
        source = f'<br><span class="note">{escape(c.source)}</span>' if c.source else ""
        test = c.test.split("::", 1)[-1]
        out.append(f"<tr><td>{CLAIM_MARKS[c.verdict]}</td><td>{escape(c.statement)}{source}</td>"
                   f"<td>{escape(c.evidence)}</td><td><code title=\"{escape(c.test)}\">{escape(test)}</code></td></tr>")
    return [*out, "</table>"]


def _failing(report: Report) -> list[str]:
    failed = [t for t in report.tests if t.failed]
    if not failed:
        return []
    out = ["<h2 id=\"failing\">Failing</h2>"]
    for t in failed:
        out += [f"<details open><summary><code>{escape(t.nodeid)}</code></summary>",
                f"<pre>{escape(t.message or '')}</pre>"]
        for m in t.metrics:  # a memory slope's samples and fit (Note [leak fit] in vramgate.core.leak)
            fit = m.now.fit
            if fit and (fit.samples or fit.levels):
                out.append(slope_chart(fit, title=f"{m.name}: memory against {fit.per}s completed",
                                       ceiling=m.now.ceiling))
                if m.decided_by:
                    out.append(f'<p class="note">{escape(m.decided_by)}</p>')
        out.append("</details>")
    return out


def change_chart(suite: str, bars: list[Bar], limit: int = HTML_BARS) -> str:
    """The SVG chart of one suite's changed and failing metrics (at most *limit* bars; a note counts the others)."""
    shown = bars[:limit]
    chart = bar_chart([b.label for b in shown], [b.change * 100 for b in shown], [b.color for b in shown],
                      title=f"{suite}: change vs baseline (red failing, green improved, blue changed)")
    if len(bars) > len(shown):
        chart += f'\n<p class="note">{len(bars) - len(shown)} smaller change(s) not drawn.</p>'
    return chart


def _relative(values: list[float]) -> list[float] | None:
    base = next((v for v in values if v != 0), None)
    return None if base is None else [(v - base) / abs(base) * 100 for v in values]


def history_chart(suite: str, series: list[Series], limit: int = HISTORY_LINES) -> str | None:
    """The SVG line chart of one suite's history: each series as its change since its first point (%), the
    ones that moved most first (at most *limit* lines; a note counts the others); None when no series moved."""
    points = sorted({(p.date, p.commit) for s in series for p in s.points})
    if not points:
        return None
    where = {key: i for i, key in enumerate(points)}
    drawn: list[tuple[float, Series, list[float | None]]] = []
    for s in series:
        ordered = sorted(s.points, key=lambda p: (p.date, p.commit))
        relative = _relative([float(p.value) for p in ordered])
        if relative is None:
            continue
        values: list[float | None] = [None] * len(points)
        for p, r in zip(ordered, relative, strict=True):
            values[where[(p.date, p.commit)]] = r
        drawn.append((max(abs(r) for r in relative), s, values))
    if not drawn or all(d[0] == 0 for d in drawn):
        return None
    drawn.sort(key=lambda d: (-d[0], d[1].test, d[1].metric))
    lines = []
    for n, (_, s, values) in enumerate(drawn[:limit]):
        ordered = sorted(s.points, key=lambda p: (p.date, p.commit))
        first, last = ordered[0].value, ordered[-1].value
        name = (f"{short_label(s.test.split('::', 1)[-1] + ' · ' + s.metric, 64)}: "
                f"{format_value(first, s.unit)} → {format_value(last, s.unit)}")
        lines.append(Line(name=name, values=values, color=PALETTE[n % len(PALETTE)]))
    dates = [date for date, commit in points if commit != RUN_POINT] or [points[0][0]]
    span = f"{dates[0][:10]} to {dates[-1][:10]}" + (", then this run" if points[-1][1] == RUN_POINT else "")
    chart = line_chart([commit[:7] for _, commit in points], lines,
                       title=f"{suite}: history {span}, change since the first point (%)")
    if len(drawn) > limit:
        chart += f'\n<p class="note">{len(drawn) - limit} series that moved less not drawn.</p>'
    return chart


def _row_class(row: Row, kind: str) -> str:
    if row.failed:
        return "failing"
    if not is_changed(row, kind):
        return ""
    return "improved" if row.verdict == "improved" else "changed"


def _table(rows: list[Row], kinds: dict[tuple[str, str], str]) -> list[str]:
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in HEAD) + "</tr>"]
    for row in sorted_rows(rows):
        css = _row_class(row, kinds.get((row.test, row.metric), ""))
        tds = "".join(f'<td class="num">{escape(c)}</td>' if 2 <= i <= 4 else f"<td>{escape(c)}</td>"
                      for i, c in enumerate(cells(row)))
        out.append(f'<tr class="{css}">{tds}</tr>' if css else f"<tr>{tds}</tr>")
    return [*out, "</table>"]


#: The commit label, and the date that sorts after every commit, of this run's own value at the end of a history.
RUN_POINT, RUN_DATE = "run", "9999-12-31T23:59:59Z"


def with_this_run(series: Series, report: Report) -> Series:
    """*series* with this run's value of its metric as a last point (labelled ``run``): the accepted values, then
    where the run stands. Unchanged when the run did not record the metric."""
    for m in report.metrics():
        if m.nodeid == series.test and m.metric.name == series.metric:
            return replace(series, points=(*series.points, SeriesPoint(RUN_POINT, RUN_DATE, m.metric.value, "report")))
    return series


def html_page(data: Report | dict[str, Any], history: list[Series] | list[dict[str, Any]] | None = None) -> str:
    """The HTML page of a report (its records, or its data read into them), with the history charts of *history*
    (see the module): the series of this run's hardware key and tier (a series without ``hardware_key`` is taken
    as it is)."""
    report = as_report(data)
    rows = report.rows()
    bars = changed_bars(report)
    charts = by_suite(bars)
    kinds = metric_kinds(report)
    series_of: dict[str, list[Series]] = {}
    # Only this run's own keys: its hardware key (machine-bound series) and its tier (portable ones); another
    # machine's history is not this run's.
    keys = {str(report.hardware.key), str(report.hardware.tier)}
    records = [s for s in history or [] if isinstance(s, Series)]
    if history and len(records) < len(history):
        records = history_series(history)
    for s in records:
        if s.hardware_key in (None, *keys):
            series_of.setdefault(s.suite, []).append(with_this_run(s, report))
    suites = sorted({t.suite for t in report.tests} | set(series_of))
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>vramgate report: {escape(str(report.hardware.key or '?'))}</title>",
           f"<style>{CSS}</style></head><body>"]
    out += _header(report, rows, bars)
    out += html_lines(report.profile_rows())
    out.append("<nav>" + " ".join(f'<a href="#suite-{escape(s)}">{escape(s)}</a>' for s in suites) + "</nav>")
    out += _claims(report)
    out += _failing(report)
    for suite in suites:
        suite_rows = [r for r in rows if r.suite == suite]
        failing = sum(1 for r in suite_rows if r.failed)
        out.append(f'<h2 id="suite-{escape(suite)}">{escape(suite)}</h2>')
        out.append(f'<p class="note">{len({r.test for r in suite_rows})} test(s), {len(suite_rows)} metric(s), '
                   f"{failing} failing, {len(charts.get(suite, []))} changed</p>")
        if suite in charts:
            out.append(change_chart(suite, charts[suite]))
        elif suite_rows:
            out.append('<p class="note">No metric of this suite changed against its baseline.</p>')
        if suite in series_of:
            chart = history_chart(suite, series_of[suite])
            out.append(chart or f'<p class="note">History: none of the {len(series_of[suite])} series of this '
                       "suite moved.</p>")
        if suite_rows:
            opened = " open" if failing or len(suite_rows) <= OPEN_ROWS else ""
            out += [f"<details{opened}><summary>{len(suite_rows)} metric(s)</summary>",
                    *_table(suite_rows, kinds), "</details>"]
    out += ["</body></html>", ""]
    return "\n".join(out)
