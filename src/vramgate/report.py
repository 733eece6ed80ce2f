"""Reports: the terminal table, ``report.md``, ``report.json`` and ``changes.png``.

``report.md`` is GitHub-flavoured markdown, fit for a job summary
(``$GITHUB_STEP_SUMMARY``) and a PR comment. The plot needs matplotlib, which
is imported only here and only when a report is written; without it the
report says the plot was left out.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramgate.baselines import atomic_write_text
from vramgate.metrics import format_change

if TYPE_CHECKING:
    from vramgate.plugin import GateSession, NodeResult

VERDICT_ORDER = ("regressed", "incompatible", "missing", "outside budget", "improved", "updated", "new",
                 "not compared", "ok")


@dataclass(frozen=True)
class Row:
    """One line of the metric table."""

    test: str
    suite: str
    metric: str
    baseline: str
    now: str
    change: str
    limit: str
    verdict: str
    change_value: float | None
    failed: bool


def _limit(finding: Any) -> str:
    m = finding.metric
    parts = []
    if m.ceiling is not None:
        parts.append(f"<= {m.show(m.ceiling)}")
    if m.floor is not None:
        parts.append(f">= {m.show(m.floor)}")
    if finding.baseline is not None:
        sign = "+" if m.better == "lower" else "-"
        parts.append(f"{sign}{m.effective_tolerance:.1%} vs baseline")
    return ", ".join(parts) or "-"


def rows_of(results: list[NodeResult]) -> list[Row]:
    rows = []
    for result in results:
        for f in result.findings:
            verdict: str = "outside budget" if f.budget and f.verdict == "ok" else f.verdict
            if f.budget and f.verdict != "ok":
                verdict = f"{f.verdict}, outside budget"
            rows.append(
                Row(
                    test=result.nodeid,
                    suite=result.suite,
                    metric=f.metric.name,
                    baseline=f.metric.show(f.baseline.value) if f.baseline else "-",
                    now=f.metric.show(),
                    change=format_change(f.change) if f.change is not None else "-",
                    limit=_limit(f),
                    verdict=verdict,
                    change_value=f.change,
                    failed=f.failed,
                )
            )
    return rows


_HEAD = ("test", "metric", "baseline", "now", "change", "limit", "verdict")


def _cells(row: Row, short: bool = True) -> tuple[str, ...]:
    test = row.test.split("::", 1)[-1] if short else row.test
    return (test, row.metric, row.baseline, row.now, row.change, row.limit, row.verdict)


def text_table(rows: list[Row]) -> str:
    table = [_HEAD, *(_cells(r) for r in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(_HEAD))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _sorted_rows(rows: list[Row]) -> list[Row]:
    def rank(r: Row) -> int:
        head = r.verdict.split(",")[0]
        return VERDICT_ORDER.index(head) if head in VERDICT_ORDER else len(VERDICT_ORDER)

    return sorted(rows, key=lambda r: (not r.failed, rank(r), r.test, r.metric))


def _mismatch_lines(session: GateSession) -> list[str]:
    seen: dict[str, None] = {}
    for result in session.results:
        for line in result.mismatches:
            seen.setdefault(line, None)
    return list(seen)


def terminal_summary(session: GateSession, tr: Any) -> None:
    rows = rows_of(session.results)
    counts = Counter(r.verdict for r in rows)
    tr.write_sep("=", "vramgate")
    fp = session.fingerprint
    tr.write_line(f"hardware: {fp.key} ({fp.source}); baselines: {session.baselines_dir}")
    for nodeid, claim in session.claims:
        mark = "HELD" if claim.held else "NOT HELD"
        tr.write_line(f"claim {mark}: {claim.statement}", green=claim.held, red=not claim.held)
        tr.write_line(f"    {claim.evidence}  [{nodeid}]")
    for line in _mismatch_lines(session):
        tr.write_line(f"!! VERSION MISMATCH with baseline: {line}", red=True, bold=True)
    shown = rows if tr.config.option.verbose > 0 else [r for r in rows if r.verdict != "ok"]
    if shown:
        tr.write_line(text_table(_sorted_rows(shown)))
    tests = len(session.results)
    tally = ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: VERDICT_ORDER.index(
        kv[0].split(",")[0]) if kv[0].split(",")[0] in VERDICT_ORDER else 99))
    tr.write_line(f"{len(rows)} metric(s) in {tests} test(s): {tally}"
                  + ("" if shown is rows else " (-v shows every row)"))
    improved = sorted({r.test for r in rows if r.verdict == "improved"})
    if improved and not session.update:
        tr.write_line(
            f"{len(improved)} test(s) beat their baseline; ratchet it (review, then commit) with: "
            f"{session.accept_command(improved) if len(improved) <= 3 else session.accept_command(['<tests>'])}"
        )
    for path in session.written:
        tr.write_line(f"baseline written: {session._rel(path)} (review the diff and commit it)")
    if session.report_dir is not None:
        tr.write_line(f"report: {session.report_dir / 'report.md'}")
    for error in session.errors:
        tr.write_line(f"ERROR: {error}", red=True)


def report_data(session: GateSession) -> dict[str, Any]:
    """Everything the gate found, as plain JSON data."""
    tests = []
    for result in session.results:
        tests.append({
            "nodeid": result.nodeid,
            "suite": result.suite,
            "test_passed": result.test_passed,
            "failed": result.failed,
            "baseline_file": session._rel(result.baseline_path),
            "version_mismatches": result.mismatches,
            "metrics": [
                {
                    "name": f.metric.name,
                    "verdict": f.verdict,
                    "failed": f.failed,
                    "now": f.metric.to_json(),
                    "baseline": f.baseline.to_json() if f.baseline else None,
                    "baseline_recorded": f.provenance.to_json() if f.provenance else None,
                    "change": f.change if f.change is None or math.isfinite(f.change) else str(f.change),
                    "budget": f.budget,
                    "decided_by": f.detail,
                }
                for f in result.findings
            ],
        })
    return {
        "hardware": session.fingerprint.to_json(),
        "software": session.software,
        "baselines": str(session.baselines_dir),
        "missing_policy": session.missing,
        "update": session.update,
        "version_mismatches": _mismatch_lines(session),
        "tests": tests,
        "claims": [
            {"test": nodeid, "statement": c.statement, "held": c.held, "evidence": c.evidence, "source": c.source}
            for nodeid, c in session.claims
        ],
        "baselines_written": [session._rel(p) for p in session.written],
    }


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(session: GateSession, plot: str | None) -> str:
    rows = rows_of(session.results)
    failed = [r for r in rows if r.failed]
    fp = session.fingerprint
    status = "❌ regression" if failed else "✅ pass"
    out = [
        f"## vramgate: {status}",
        "",
        f"Hardware `{fp.key}` · {len(session.results)} test(s) · {len(rows)} metric(s) · "
        f"{len(failed)} failing",
        "",
    ]
    for line in _mismatch_lines(session):
        out.append(f"> **Version mismatch with baseline:** {line}")
    if _mismatch_lines(session):
        out.append("")
    if session.claims:
        out += ["### Claims", "", "| verdict | claim | evidence | test |", "|---|---|---|---|"]
        for nodeid, c in session.claims:
            verdict = "✅ held" if c.held else "❌ not held"
            out.append(f"| {verdict} | {_md_escape(c.statement)} | {_md_escape(c.evidence)} | `{nodeid}` |")
        out.append("")
    if failed:
        out += ["### Failing", ""]
        for result in session.results:
            if result.failed:
                out += [f"<details open><summary><code>{result.nodeid}</code></summary>", "", "```",
                        session.failure_message(result), "```", "</details>", ""]
    out += ["### Metrics", "", "| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    for row in _sorted_rows(rows):
        cells = list(_cells(row, short=False))
        cells[0] = f"`{cells[0]}`"
        out.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    out.append("")
    improved = sorted({r.test for r in rows if r.verdict == "improved"})
    if improved:
        out += [f"{len(improved)} test(s) beat their baseline; ratchet with "
                f"`{session.accept_command(improved)}`.", ""]
    out.append(f"![changes]({plot})" if plot else "_Plot left out: matplotlib is not installed._")
    out.append("")
    return "\n".join(out)


def plot_changes(rows: list[Row], path: Path) -> bool:
    """Bar chart of the relative change of every compared metric; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    data = [r for r in rows if r.change_value is not None and math.isfinite(r.change_value)]
    height = max(2.5, 0.25 * len(data) + 1.0)
    fig, ax = plt.subplots(figsize=(9, height))
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(session: GateSession, directory: Path) -> None:
    """Write ``report.json``, ``changes.png`` (when matplotlib is there) and ``report.md`` into *directory*."""
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / "report.json",
                      json.dumps(report_data(session), indent=2, sort_keys=True) + "\n")
    plot = "changes.png" if plot_changes(rows_of(session.results), directory / "changes.png") else None
    atomic_write_text(directory / "report.md", markdown(session, plot))
