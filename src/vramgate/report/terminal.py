"""What the terminal shows: the message of a test whose metrics fall short, and the session's summary."""

from __future__ import annotations

from collections import Counter
from typing import Any

from vramgate.core.metrics import format_change, format_value
from vramgate.core.paired import TOO_NOISY, paired_rule
from vramgate.core.verdicts import profile_rows
from vramgate.report.summary import (
    ACCEPTABLE,
    Hardware,
    NodeSummary,
    Summary,
    accept_command,
    affected_line,
    verdict_rank,
)
from vramgate.report.table import coverage_lines, moved_lines, rows_of, sorted_rows, text_table
from vramgate.report.verdict_table import terminal_lines
from vramgate.store.report_files import AffectedFacts


def failure_message(node: NodeSummary, hardware: Hardware, accept_args: list[str]) -> str:
    """Why *node* fails: one head line, a line per metric that falls short, the baseline it was compared with,
    and, for a change a person may accept, the commands that re-record and stage the baseline."""
    failed = [m for m in node.metrics if m.finding.failed]
    heads = []
    for c in failed:
        f = c.finding
        if f.budget:
            heads.append(f"{f.metric.name} outside budget")
        if f.verdict == "regressed":
            heads.append(f"{f.metric.name} {format_change(f.change or 0.0)} vs baseline")
        elif f.verdict in ("missing", "incompatible"):
            heads.append(f"{f.metric.name} {f.verdict} baseline")
        elif f.untrusted == "too noisy":
            heads.append(f"{f.metric.name} untrusted: {TOO_NOISY}")
        elif f.untrusted is not None:
            heads.append(f"{f.metric.name} measured on a GPU in an untrustworthy state")
    lines = [
        f"vramgate: {'; '.join(heads)} "
        f"({len(failed)} of {len(node.metrics)} metric(s) fall short on hardware {hardware.key}, "
        f"tier {hardware.tier})",
    ]
    for c in failed:
        f = c.finding
        m = f.metric
        if f.budget:
            lines.append(f"- {m.name}: {f.budget} [budget set in the test]")
        if f.verdict == "missing":
            why = ("a gate that compares nothing passes nothing: record one, or run with --gate-missing=record"
                   if c.file is None or c.key_has_baselines else
                   f"--gate-require-hardware is set and {c.key} has no baselines: record them")
            lines.append(f"- {m.name}: now {m.show(precise=True)}; no baseline in {c.file or '?'} "
                         f"({m.effective_scope} metric; {why})")
        elif f.untrusted == "too noisy":
            lines.append(f"- {m.name}: now {m.show(precise=True)}, not judged, neither a red nor a green it could "
                         f"back, and never a baseline: {f.detail} (rerun where the machine is quieter)")
        elif f.untrusted is not None:
            lines.append(f"- {m.name}: now {m.show(precise=True)}, not compared: {f.detail} "
                         f"(rerun on an idle GPU at full clocks)")
        elif f.verdict in ("regressed", "incompatible") and f.baseline is not None:
            change = format_change(f.change or 0.0)
            if m.unit == "B" and f.baseline.value is not None:  # what moved, in bytes: "-4.80% (-66.73 MiB)"
                delta = float(m.value) - float(f.baseline.value)
                change += f" ({'+' if delta >= 0 else '-'}{format_value(abs(delta), 'B')})"
            lines.append(
                f"- {m.name}: now {m.show(precise=True)}, baseline {m.show(f.baseline.value, precise=True)}: "
                f"{change}, {f.verdict} ({f.detail})"
            )
        rule = paired_rule(m)
        if rule is not None:  # Note [second look] in vramgate.engine.looks: what each look found
            lines += [f"    {line}" for line in rule.message_lines()]
    recorded = next((c for c in failed if c.finding.provenance), None)
    if recorded is not None and recorded.finding.provenance is not None:
        lines.append(f"Baseline: {recorded.file or '?'}, {recorded.finding.provenance.describe()}")
    if node.mismatches:
        lines.append("! software differs from the baseline's: " + "; ".join(node.mismatches))
    acceptable = [c for c in failed if c.finding.verdict in ACCEPTABLE]
    if acceptable:
        lines.append("To accept this on purpose, re-record the baseline and commit it for review:")
        lines.append(f"    {accept_command([node.nodeid], accept_args)}")
        lines.append(f"    git add {' '.join(node.files_of(acceptable))}")
    return "\n".join(lines)


def terminal_summary(summary: Summary, tr: Any, verbose: bool = False) -> None:
    """Write the session's summary through the terminal reporter *tr* (*verbose*: every row, not only those
    that are not ok)."""
    rows = rows_of(summary.nodes)
    counts = Counter(r.verdict_text for r in rows)
    tr.write_sep("=", "vramgate")
    for line in moved_lines(summary.moved()):
        tr.write_line(line, red=line.startswith("!!"), bold=line.startswith("!!"))
    hw = summary.hardware
    tr.write_line(f"hardware: {hw.key} ({hw.source}); tier: {hw.tier}; baselines: {summary.baselines_dir}")
    affected = affected_line(AffectedFacts(summary.affected) if summary.affected is not None else None)
    if affected:
        tr.write_line(affected, yellow=True)
    for line in terminal_lines(profile_rows(summary.profiles, summary.judgements) if summary.judgements else [],
                               verbose):
        tr.write_line(line, red=" FAIL" in line or (line.startswith("  [") and "failed by" in line))
    for nodeid, claim in sorted(summary.claims, key=lambda c: (c[0], c[1].statement)):
        mark = claim.verdict.upper()
        tr.write_line(f"claim {mark}: {claim.statement}", green=claim.held, red=claim.judged and not claim.held)
        tr.write_line(f"    {claim.evidence}  [{nodeid}]")
    for line in summary.mismatch_lines():
        tr.write_line(f"!! VERSION MISMATCH with baseline: {line}", red=True, bold=True)
    shown = rows if verbose else [r for r in rows if r.verdict_text != "ok"]
    if shown:
        tr.write_line(text_table(sorted_rows(shown)))
    tally = ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: verdict_rank(kv[0])))
    tr.write_line(f"{len(rows)} metric(s) in {len(summary.nodes)} test(s): {tally}"
                  + ("" if shown is rows else " (-v shows every row)"))
    for line in coverage_lines(rows, summary.accept_args, hw.tier, hw.key):
        tr.write_line(line, yellow=line.startswith("!!"), bold=line.startswith("!!"))
    improved = sorted({r.test for r in rows if r.verdict_text == "improved"})
    if improved and not summary.update:
        tr.write_line(
            f"{len(improved)} test(s) beat their baseline; ratchet it (review, then commit) with: "
            f"{accept_command(improved if len(improved) <= 3 else ['<tests>'], summary.accept_args)}"
        )
    for path in summary.written:
        tr.write_line(f"baseline written: {path} (review the diff and commit it)")
    if summary.report_file is not None:
        tr.write_line(f"report: {summary.report_file}")
    for error in summary.errors:
        tr.write_line(f"ERROR: {error}", red=True)

