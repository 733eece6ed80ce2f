"""Aligned text tables: the metric rows every report shows, the terminal's table, and the lines around it
(moved baselines, what was compared where, the ``--gate-plan`` dry run)."""

from __future__ import annotations

from collections import Counter

from vramgate.core.checks import Finding
from vramgate.core.metrics import format_change, format_value
from vramgate.machine.hardware import Fingerprint, GPUInfo
from vramgate.report.summary import NodeSummary, pytest_command, verdict_rank
from vramgate.store.report_files import MovedBaselines, MovedMetric, Row


def _limit(finding: Finding) -> str:
    m = finding.metric
    parts = []
    if m.ceiling is not None:
        parts.append(f"<= {m.show(m.ceiling)}")
    if m.floor is not None:
        parts.append(f">= {m.show(m.floor)}")
    if finding.baseline is not None:
        # Tolerances are ratio terms (metrics.worse_change): higher-is-better fails below old / (1 + t).
        tol = m.effective_tolerance
        allowed = tol if m.better == "lower" else 1.0 / (1.0 + tol) - 1.0
        parts.append(f"{allowed:+.1%} vs baseline")
    return ", ".join(parts) or "-"


def rows_of(nodes: list[NodeSummary]) -> list[Row]:
    """The table rows of the metrics of *nodes*, in the order recorded."""
    rows = []
    for node in nodes:
        for checked in node.metrics:
            f = checked.finding
            rows.append(
                Row(
                    test=node.nodeid,
                    suite=node.suite,
                    metric=f.metric.name,
                    baseline=f.metric.show(f.baseline.value) if f.baseline else "-",
                    now=f.metric.show(),
                    change=format_change(f.change) if f.change is not None else "-",
                    limit=_limit(f),
                    verdict=f.verdict,
                    change_value=f.change,
                    failed=f.failed,
                    scope=f.metric.effective_scope,
                    key=checked.key,
                    outside_budget=bool(f.budget),
                )
            )
    return rows


HEAD = ("test", "metric", "baseline", "now", "change", "limit", "verdict")


def cells(row: Row, short: bool = True) -> tuple[str, ...]:
    """The cells of *row* under :data:`HEAD` (*short*: the test without its file)."""
    test = row.test.split("::", 1)[-1] if short else row.test
    return (test, row.metric, row.baseline, row.now, row.change, row.limit, row.verdict_text)


def aligned(head: tuple[str, ...], cells: list[tuple[str, ...]], rule: bool = True) -> list[str]:
    """*head* and *cells* as left-aligned text columns (with a rule under the head)."""
    table = [head, *cells]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def text_table(rows: list[Row]) -> str:
    """*rows* as an aligned text table."""
    return "\n".join(aligned(HEAD, [cells(r) for r in rows]))


def sorted_rows(rows: list[Row]) -> list[Row]:
    """Failing rows first, then by the severity of the verdict, the test and the metric."""
    return sorted(rows, key=lambda r: (not r.failed, verdict_rank(r.verdict, r.outside_budget), r.test, r.metric))


def moved_cells(m: MovedMetric) -> tuple[str, ...]:
    """The cells of one moved baseline metric."""
    def show(v: float | None) -> str:
        return "(none)" if v is None else format_value(v, m.unit, precise=True)

    if m.now is None:
        run = "not run here"
    else:
        run = f"{show(m.now)}, " + ("matches the new" if m.matches_new else "differs from the new")
    return (m.file, m.test.split("::", 1)[-1], m.metric, show(m.old), show(m.new), m.change, run)


def moved_lines(moved: MovedBaselines | None) -> list[str]:
    """The terminal lines of the baselines a change moves; none when none moved.

    Note in :mod:`vramgate.store.moves`.
    """
    if not moved or not moved.metrics:
        return []
    metrics = moved.metrics
    files = {m.file for m in metrics}
    head = ("file", "test", "metric", "at ref", "now stored", "change", "this run")
    lines = [f"!! BASELINES THIS CHANGE MOVES (against {moved.ref}): {len(metrics)} metric(s) in "
             f"{len(files)} file(s); review each before merging"]
    return lines + ["  " + line for line in aligned(head, [moved_cells(m) for m in metrics], rule=False)]


def coverage_lines(rows: list[Row], accept_args: list[str], tier: str, key: str) -> list[str]:
    """What was compared where: portable metrics under the tier, machine-bound ones under the hardware key, and
    one prominent line for the metrics of keys that have no baselines at all, with the command that records them."""
    compared = [r for r in rows if r.verdict not in ("no baselines", "not compared", "missing", "new")]
    by_scope = Counter(r.scope for r in compared)
    parts = [f"{by_scope.get('portable', 0)} portable metric(s) compared under tier {tier}",
             f"{by_scope.get('machine', 0)} machine-bound under hardware {key}"]
    out = ["; ".join(parts)]
    absent = [r for r in rows if r.verdict == "no baselines"]
    if absent:
        tests = sorted({r.test for r in absent})
        where = ", ".join(sorted({r.key for r in absent}))
        args = [a for a in accept_args if a != "--gate-update"]
        command = pytest_command(tests if len(tests) <= 3 else ["suites"], ["--gate-missing", "record", *args])
        out.append(f"!! NOT COMPARED: {len(absent)} machine-bound metric(s) in "
                   f"{len(tests)} test(s): {where} has no baselines. Record them on this machine (then review and "
                   f"commit) with: {command}; --gate-require-hardware makes this a failure")
    return out


def plan_baseline_lines(rows: list[tuple[str, str, str, str, list[str], list[str]]], key: str,
                        verbose: bool = False) -> list[str]:
    """``--gate-plan``: per suite, the machine-bound keys its gated tests read (a test's key counts the GPUs it uses),
    how many compare stored metrics and how many would record theirs (first run on a machine); with *verbose*, per
    test: its key, the files, the metrics compared and those recorded."""
    by_suite: dict[str, list[tuple[str, str, str, list[str], list[str]]]] = {}
    for suite, nodeid, test_key, files, compared, records in rows:
        by_suite.setdefault(suite, []).append((nodeid, test_key, files, compared, records))
    out = [f"baselines under {key} (machine-bound; a GPU test's key counts the GPUs it uses) and the tier's key "
           "(portable):"]
    for suite, tests in sorted(by_suite.items()):
        compare = sum(1 for *_, c, _ in tests if c)
        names = sorted({m for *_, r in tests for m in r})
        keys = sorted({k for _, k, *_ in tests})
        line = (f"  {suite}: {len(tests)} test(s) under {', '.join(keys)}, {compare} compare stored metrics, "
                f"{len(tests) - compare} have none")
        out.append(line + (f"; would record {', '.join(names)}" if names else ""))
        if verbose:
            for nodeid, test_key, files, compared, records in tests:
                out.append(f"         {nodeid} [{test_key}]: compares {', '.join(compared) or 'nothing'} ({files})"
                           + (f"; records {', '.join(records)}" if records else ""))
    return out


def plan_lines(plan: list[tuple[str, str, str | None]], fp: Fingerprint, visible: tuple[GPUInfo, ...],
               verbose: bool = False) -> list[str]:
    """``--gate-plan``: per hardware need, how many tests carry it and whether they run on this machine."""
    gpus = ", ".join(f"{g.name} ({g.memory_bytes / 2**30:.0f} GiB, capability "
                     f"{'.'.join(map(str, g.capability)) if g.capability else '?'})" for g in visible) or "none"
    out = [f"vramgate plan: hardware {fp.key} (tier {fp.portable_key}); GPUs visible: {gpus}"]
    groups: dict[tuple[str, str | None], list[str]] = {}
    for nodeid, needs, reason in plan:
        groups.setdefault((needs, reason), []).append(nodeid)
    runs = sum(len(v) for (_, reason), v in groups.items() if reason is None)
    out.append(f"{len(plan)} test(s) need a GPU: {runs} would run here, {len(plan) - runs} would skip")
    for (needs, reason), nodeids in sorted(groups.items(), key=lambda kv: (kv[0][1] is None, kv[0][0])):
        verdict = "runs" if reason is None else f"skips: {reason}"
        out.append(f"  {len(nodeids):4d} x {needs}: {verdict}")
        if verbose:
            out += [f"         {n}" for n in nodeids]
    return out
