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
from vramgate.report.table import HEAD, cells, coverage_lines, moved_cells, sorted_rows
from vramgate.report.verdict_table import markdown_lines
from vramgate.store.report_files import Report, as_report

#: How a claim's verdict reads in ``report.md``.
CLAIM_MARKS = {"not judged": "⚪ not judged", "held": "✅ held", "not held": "❌ not held"}


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(data: Report | dict[str, Any], plot: str | None) -> str:
    """``report.md`` from a report (its records, or its data read into them); *plot* is the file name of
    ``changes.png``, None where it was not drawn (nothing changed, or no matplotlib)."""
    report = as_report(data)
    rows = report.rows()
    failed = [r for r in rows if r.failed]
    profiles = report.profile_rows()
    moved = report.moved_baselines
    regression = failed or any(p.failed for p in profiles)
    status = "❌ regression" if regression else "⚠️ pass, with moved baselines" if report.moved else "✅ pass"
    hw = report.hardware
    out = [
        f"## vramgate: {status}",
        "",
        f"Hardware `{hw.key}` · tier `{hw.tier or '?'}` · "
        f"{len(report.tests)} test(s) · {len(rows)} metric(s) · {len(failed)} failing",
        "",
    ]
    out += markdown_lines(profiles)
    for line in coverage_lines(rows, report.accept_args, hw.tier or "?", hw.key or "?"):
        out += [f"> **{line[3:]}**" if line.startswith("!!") else line, ""]
    affected = affected_line(report.affected)
    if affected:
        out += [f"> {affected[0].upper()}{affected[1:]}.", ""]
    if moved and moved.metrics:
        # First, above everything: a change that moves its own baselines must be seen by its reviewer.
        out[2:2] = [f"> **{len(moved.metrics)} baseline metric(s) moved against `{moved.ref}`: review them "
                    "below before merging.**", ""]
        out += ["### Baselines this change moves", "",
                "| file | test | metric | at ref | now stored | change | this run |", "|---|---|---|---|---|---|---|"]
        for m in moved.metrics:
            moved_row = list(moved_cells(m))
            moved_row[0], moved_row[1] = f"`{moved_row[0]}`", f"`{m.test}`"
            out.append("| " + " | ".join(_md_escape(c) for c in moved_row) + " |")
        out.append("")
    for line in report.version_mismatches:
        out.append(f"> **Version mismatch with baseline:** {line}")
    if report.version_mismatches:
        out.append("")
    if report.claims:
        out += ["### Claims", "", "| verdict | claim | evidence | test |", "|---|---|---|---|"]
        for c in report.claims:
            out.append(f"| {CLAIM_MARKS[c.verdict]} | {_md_escape(c.statement)} | {_md_escape(c.evidence)} | "
                       f"`{c.test}` |")
        out.append("")
    if failed:
        out += ["### Failing", ""]
        for test in report.tests:
            if test.failed:
                out += [f"<details open><summary><code>{test.nodeid}</code></summary>", "", "```",
                        str(test.message), "```", "</details>", ""]
    out += ["### Changes", "", *mermaid_section(report)]
    out += ["### Metrics", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for row in sorted_rows(rows):
        row_cells = list(cells(row, short=False))
        row_cells[0] = f"`{row_cells[0]}`"
        out.append("| " + " | ".join(_md_escape(c) for c in row_cells) + " |")
    out.append("")
    improved = sorted({r.test for r in rows if r.verdict_text == "improved"})
    if improved:
        out += [f"{len(improved)} test(s) beat their baseline; ratchet with "
                f"`{accept_command(improved, report.accept_args)}`.", ""]
    if plot:
        out += ["<details><summary>The same changes as a picture: <code>changes.png</code> beside this file"
                "</summary>", "", f"![changes]({plot})", "", "</details>", ""]
    elif changed_bars(report):
        out += ["_`changes.png` left out: matplotlib is not installed._", ""]
    return "\n".join(out)
