"""``report.md``: GitHub-flavoured markdown, fit for a job summary (``$GITHUB_STEP_SUMMARY``) and a PR comment,
made from ``report.json``'s data (:func:`vramgate.report.data.report_data`).

Its pictures are Mermaid charts GitHub draws in place (:mod:`vramgate.report.mermaid`); ``changes.png`` is linked
only for the file read beside it, folded away, since neither a job summary nor a PR comment can show it.
"""

from __future__ import annotations

from typing import Any

from vramgate.report.chart import changed_bars
from vramgate.report.mermaid import mermaid_section
from vramgate.report.summary import accept_command, affected_line
from vramgate.report.table import HEAD, Row, cells, coverage_lines, moved_cells, sorted_rows


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def data_rows(data: dict[str, Any]) -> list[Row]:
    """The metric rows of report data (``report.json``), test by test."""
    return [Row(**r) for t in data["tests"] for r in t["rows"]]


def markdown(data: dict[str, Any], plot: str | None) -> str:
    """``report.md`` from report data; *plot* is the file name of ``changes.png``, None where it was not drawn
    (nothing changed, or no matplotlib)."""
    rows = data_rows(data)
    failed = [r for r in rows if r.failed]
    moved_count = len((data.get("moved_baselines") or {}).get("metrics") or [])
    status = "❌ regression" if failed else "⚠️ pass, with moved baselines" if moved_count else "✅ pass"
    out = [
        f"## vramgate: {status}",
        "",
        f"Hardware `{data['hardware']['key']}` · tier `{data['hardware'].get('tier', '?')}` · "
        f"{len(data['tests'])} test(s) · {len(rows)} metric(s) · {len(failed)} failing",
        "",
    ]
    hw = data["hardware"]
    for line in coverage_lines(rows, data["accept_args"], hw.get("tier", "?"), hw.get("key", "?")):
        out += [f"> **{line[3:]}**" if line.startswith("!!") else line, ""]
    affected = affected_line(data.get("affected"))
    if affected:
        out += [f"> {affected[0].upper()}{affected[1:]}.", ""]
    moved = data.get("moved_baselines")
    if moved and moved["metrics"]:
        # First, above everything: a change that moves its own baselines must be seen by its reviewer.
        out[2:2] = [f"> **{len(moved['metrics'])} baseline metric(s) moved against `{moved['ref']}`: review them "
                    "below before merging.**", ""]
        out += ["### Baselines this change moves", "",
                "| file | test | metric | at ref | now stored | change | this run |", "|---|---|---|---|---|---|---|"]
        for m in moved["metrics"]:
            moved_row = list(moved_cells(m))
            moved_row[0], moved_row[1] = f"`{moved_row[0]}`", f"`{m['test']}`"
            out.append("| " + " | ".join(_md_escape(c) for c in moved_row) + " |")
        out.append("")
    for line in data["version_mismatches"]:
        out.append(f"> **Version mismatch with baseline:** {line}")
    if data["version_mismatches"]:
        out.append("")
    if data["claims"]:
        out += ["### Claims", "", "| verdict | claim | evidence | test |", "|---|---|---|---|"]
        for c in data["claims"]:
            verdict = "⚪ not judged" if not c.get("judged", True) else "✅ held" if c["held"] else "❌ not held"
            out.append(f"| {verdict} | {_md_escape(c['statement'])} | {_md_escape(c['evidence'])} | `{c['test']}` |")
        out.append("")
    if failed:
        out += ["### Failing", ""]
        for test in data["tests"]:
            if test["failed"]:
                out += [f"<details open><summary><code>{test['nodeid']}</code></summary>", "", "```",
                        test["message"], "```", "</details>", ""]
    out += ["### Changes", "", *mermaid_section(data)]
    out += ["### Metrics", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for row in sorted_rows(rows):
        row_cells = list(cells(row, short=False))
        row_cells[0] = f"`{row_cells[0]}`"
        out.append("| " + " | ".join(_md_escape(c) for c in row_cells) + " |")
    out.append("")
    improved = sorted({r.test for r in rows if r.verdict == "improved"})
    if improved:
        out += [f"{len(improved)} test(s) beat their baseline; ratchet with "
                f"`{accept_command(improved, data['accept_args'])}`.", ""]
    if plot:
        out += ["<details><summary>The same changes as a picture: <code>changes.png</code> beside this file"
                "</summary>", "", f"![changes]({plot})", "", "</details>", ""]
    elif changed_bars(data):
        out += ["_`changes.png` left out: matplotlib is not installed._", ""]
    return "\n".join(out)
