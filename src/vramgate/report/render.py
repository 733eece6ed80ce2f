"""Reports: the terminal table, ``report.md``, ``report.json`` and ``changes.png``.

``report.md`` is GitHub-flavoured markdown, fit for a job summary
(``$GITHUB_STEP_SUMMARY``) and a PR comment. The plot needs matplotlib, which
is imported only here and only when a report is written; without it the
report says the plot was left out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shlex
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramgate.core.metrics import format_change, format_value
from vramgate.store.files import new_file_mode, stage_text

if TYPE_CHECKING:
    from vramgate.pytest_plugin.plugin import GateSession, NodeResult

VERDICT_ORDER = ("regressed", "untrusted", "incompatible", "missing", "outside budget", "improved", "updated", "new",
                 "no baselines", "not compared", "ok")


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
    scope: str = ""
    key: str = ""
    """The baseline key the metric was looked up under (a tier's for portable metrics, else the hardware's)."""


def _limit(finding: Any) -> str:
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


def rows_of(results: list[NodeResult]) -> list[Row]:
    rows = []
    for result in results:
        for f in result.findings:
            path = result.path_of(f)
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
                    scope=f.metric.effective_scope,
                    key=path.parent.name if path is not None else "",
                )
            )
    return rows


_HEAD = ("test", "metric", "baseline", "now", "change", "limit", "verdict")


def _cells(row: Row, short: bool = True) -> tuple[str, ...]:
    test = row.test.split("::", 1)[-1] if short else row.test
    return (test, row.metric, row.baseline, row.now, row.change, row.limit, row.verdict)


def aligned(head: tuple[str, ...], cells: list[tuple[str, ...]], rule: bool = True) -> list[str]:
    """*head* and *cells* as left-aligned text columns (with a rule under the head)."""
    table = [head, *cells]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def text_table(rows: list[Row]) -> str:
    return "\n".join(aligned(_HEAD, [_cells(r) for r in rows]))


def _sorted_rows(rows: list[Row]) -> list[Row]:
    def rank(r: Row) -> int:
        head = r.verdict.split(",")[0]
        return VERDICT_ORDER.index(head) if head in VERDICT_ORDER else len(VERDICT_ORDER)

    return sorted(rows, key=lambda r: (not r.failed, rank(r), r.test, r.metric))


def _moved_cells(m: dict[str, Any]) -> tuple[str, ...]:
    def show(v: Any) -> str:
        return "(none)" if v is None else format_value(v, m["unit"], precise=True)

    if m["now"] is None:
        run = "not run here"
    else:
        run = f"{show(m['now'])}, " + ("matches the new" if m["matches_new"] else "differs from the new")
    return (m["file"], m["test"].split("::", 1)[-1], m["metric"], show(m["old"]), show(m["new"]), m["change"], run)


def moved_lines(moved: dict[str, Any] | None) -> list[str]:
    """The terminal lines of the baselines a change moves; none when none moved.

    Note in :mod:`vramgate.store.moves`.
    """
    if not moved or not moved["metrics"]:
        return []
    metrics = moved["metrics"]
    files = {m["file"] for m in metrics}
    head = ("file", "test", "metric", "at ref", "now stored", "change", "this run")
    lines = [f"!! BASELINES THIS CHANGE MOVES (against {moved['ref']}): {len(metrics)} metric(s) in "
             f"{len(files)} file(s); review each before merging"]
    return lines + ["  " + line for line in aligned(head, [_moved_cells(m) for m in metrics], rule=False)]


def coverage_lines(rows: list[Row], accept_args: list[str], tier: str, key: str) -> list[str]:
    """What was compared where: portable metrics under the tier, machine-bound ones under the hardware key, and
    one prominent line for the metrics of keys that have no baselines at all, with the command that records them."""
    compared = [r for r in rows if r.verdict.split(",")[0] not in ("no baselines", "not compared", "missing", "new")]
    by_scope = Counter(r.scope for r in compared)
    parts = [f"{by_scope.get('portable', 0)} portable metric(s) compared under tier {tier}",
             f"{by_scope.get('machine', 0)} machine-bound under hardware {key}"]
    out = ["; ".join(parts)]
    absent = [r for r in rows if r.verdict.split(",")[0] == "no baselines"]
    if absent:
        tests = sorted({r.test for r in absent})
        where = ", ".join(sorted({r.key for r in absent}))
        args = [a for a in accept_args if a != "--gate-update"]
        command = shlex.join(["python", "-m", "pytest", *(tests if len(tests) <= 3 else ["suites"]),
                              "--gate-missing", "record", *args])
        out.append(f"!! NOT COMPARED: {len(absent)} machine-bound metric(s) in "
                   f"{len(tests)} test(s): {where} has no baselines. Record them on this machine (then review and "
                   f"commit) with: {command}; --gate-require-hardware makes this a failure")
    return out


def plan_lines(plan: list[tuple[str, str, str | None]], fp: Any, visible: Any, verbose: bool = False) -> list[str]:
    """``--gate-plan``: per hardware need, how many tests carry it and whether they run on this machine."""
    gpus = ", ".join(f"{g.name} ({g.memory_bytes / 2**30:.0f} GiB, capability "
                     f"{'.'.join(map(str, g.capability)) if g.capability else '?'})" for g in visible) or "none"
    out = [f"vramgate plan: hardware {fp.key} (tier {fp.tier}); GPUs visible: {gpus}"]
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
    for line in moved_lines(session.moved_json()):
        tr.write_line(line, red=line.startswith("!!"), bold=line.startswith("!!"))
    fp = session.fingerprint
    tr.write_line(f"hardware: {fp.key} ({fp.source}); tier: {fp.tier}; baselines: {session.baselines_dir}")
    for nodeid, claim in sorted(session.claims, key=lambda c: (c[0], c[1].statement)):
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
    for line in coverage_lines(rows, session.accept_args(), fp.tier, fp.key):
        tr.write_line(line, yellow=line.startswith("!!"), bold=line.startswith("!!"))
    improved = sorted({r.test for r in rows if r.verdict == "improved"})
    if improved and not session.update:
        tr.write_line(
            f"{len(improved)} test(s) beat their baseline; ratchet it (review, then commit) with: "
            f"{session.accept_command(improved) if len(improved) <= 3 else session.accept_command(['<tests>'])}"
        )
    for path in sorted(set(session.written)):
        tr.write_line(f"baseline written: {session._rel(path)} (review the diff and commit it)")
    if session.report_dir is not None and session.report_written:
        tr.write_line(f"report: {session.report_dir / 'report.md'}")
    for error in session.errors:
        tr.write_line(f"ERROR: {error}", red=True)


def report_data(session: GateSession) -> dict[str, Any]:
    """Everything the gate found, as plain JSON data (what ``report.md`` is made from; shards merge it)."""
    tests = []
    for result in sorted(session.results, key=lambda r: r.nodeid):
        tests.append({
            "nodeid": result.nodeid,
            "suite": result.suite,
            "test_passed": result.test_passed,
            "failed": result.failed,
            "message": session.failure_message(result) if result.failed else None,
            "baseline_file": session._rel(result.baseline_path),
            "version_mismatches": result.mismatches,
            "gpu_conditions": result.conditions,
            "rows": [dataclasses.asdict(r) for r in rows_of([result])],
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
        "schema": 1,
        "hardware": session.fingerprint.to_json(),
        "software": session.software,
        "missing_policy": session.missing,
        "update": session.update,
        "accept_args": session.accept_args(),
        "version_mismatches": sorted(_mismatch_lines(session)),
        "tests": tests,
        "claims": sorted(
            ({"test": nodeid, "statement": c.statement, "held": c.held, "evidence": c.evidence, "source": c.source}
             for nodeid, c in session.claims),
            key=lambda c: (c["test"], c["statement"]),
        ),
        "baselines_written": sorted({session._rel(p) for p in session.written}),
        "moved_baselines": session.moved_json(),
    }


class ReportError(ValueError):
    """Reports that cannot be merged (unreadable, or from different hardware or settings)."""


def merge_reports(parts: list[dict[str, Any]], names: list[str] | None = None) -> dict[str, Any]:
    """One report from the reports of several shards of one run (same hardware key and settings)."""
    if not parts:
        raise ReportError("no reports to merge")
    names = names or [f"report {i + 1}" for i in range(len(parts))]
    first = parts[0]
    for name, part in zip(names, parts, strict=True):
        if part.get("schema") != 1 or not isinstance(part.get("tests"), list):
            raise ReportError(f"{name}: not a vramgate report.json (schema 1)")
        if part["hardware"].get("key") != first["hardware"].get("key"):
            raise ReportError(f"{name}: hardware key {part['hardware'].get('key')!r} differs from {names[0]}'s "
                              f"{first['hardware'].get('key')!r}; shards of one run share a key")
        for key in ("missing_policy", "update", "accept_args"):
            if part.get(key) != first.get(key):
                raise ReportError(f"{name}: {key} {part.get(key)!r} differs from {names[0]}'s {first.get(key)!r}")
    tests = sorted((t for p in parts for t in p["tests"]), key=lambda t: t["nodeid"])
    seen = [t["nodeid"] for t in tests]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise ReportError(f"test(s) reported by more than one shard: {', '.join(duplicates[:5])}")
    return {
        **first,
        "version_mismatches": sorted({m for p in parts for m in p["version_mismatches"]}),
        "tests": tests,
        "claims": sorted((c for p in parts for c in p["claims"]), key=lambda c: (c["test"], c["statement"])),
        "baselines_written": sorted({b for p in parts for b in p["baselines_written"]}),
        "moved_baselines": _merge_moved([p.get("moved_baselines") for p in parts]),
    }


def _merge_moved(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The shards' moved baselines: the same list from every shard, with this run's figure where a shard ran it."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for part in present:
        for m in part["metrics"]:
            key = (m["file"], m["test"], m["metric"])
            if key not in merged or merged[key]["now"] is None:
                merged[key] = m
    return {"ref": present[0]["ref"], "metrics": [merged[k] for k in sorted(merged)]}


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _rows(data: dict[str, Any]) -> list[Row]:
    return [Row(**r) for t in data["tests"] for r in t["rows"]]


def accept_command(data: dict[str, Any], nodeids: list[str]) -> str:
    return shlex.join(["python", "-m", "pytest", *nodeids, *data["accept_args"]])


def markdown(data: dict[str, Any], plot: str | None) -> str:
    """``report.md`` (GitHub-flavoured: job summary, PR comment) from :func:`report_data`."""
    rows = _rows(data)
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
    moved = data.get("moved_baselines")
    if moved and moved["metrics"]:
        # First, above everything: a change that moves its own baselines must be seen by its reviewer.
        out[2:2] = [f"> **{len(moved['metrics'])} baseline metric(s) moved against `{moved['ref']}`: review them "
                    "below before merging.**", ""]
        out += ["### Baselines this change moves", "",
                "| file | test | metric | at ref | now stored | change | this run |", "|---|---|---|---|---|---|---|"]
        for m in moved["metrics"]:
            cells = list(_moved_cells(m))
            cells[0], cells[1] = f"`{cells[0]}`", f"`{m['test']}`"
            out.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
        out.append("")
    for line in data["version_mismatches"]:
        out.append(f"> **Version mismatch with baseline:** {line}")
    if data["version_mismatches"]:
        out.append("")
    if data["claims"]:
        out += ["### Claims", "", "| verdict | claim | evidence | test |", "|---|---|---|---|"]
        for c in data["claims"]:
            verdict = "✅ held" if c["held"] else "❌ not held"
            out.append(f"| {verdict} | {_md_escape(c['statement'])} | {_md_escape(c['evidence'])} | `{c['test']}` |")
        out.append("")
    if failed:
        out += ["### Failing", ""]
        for test in data["tests"]:
            if test["failed"]:
                out += [f"<details open><summary><code>{test['nodeid']}</code></summary>", "", "```",
                        test["message"], "```", "</details>", ""]
    out += ["### Metrics", "", "| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    for row in _sorted_rows(rows):
        cells = list(_cells(row, short=False))
        cells[0] = f"`{cells[0]}`"
        out.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    out.append("")
    improved = sorted({r.test for r in rows if r.verdict == "improved"})
    if improved:
        out += [f"{len(improved)} test(s) beat their baseline; ratchet with `{accept_command(data, improved)}`.", ""]
    out.append(f"![changes]({plot})" if plot else "_Plot left out: matplotlib is not installed._")
    out.append("")
    return "\n".join(out)


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


def write_report_data(data: dict[str, Any], directory: Path) -> None:
    """Write ``report.json``, ``changes.png`` (when matplotlib is there) and ``report.md`` into *directory*.

    Note [report all or nothing]: every file is first written in full to a
    temporary file in *directory*; only when all are written are they renamed
    into place. A write that fails (a full disk) removes the temporary files
    and leaves the previous report as it was, never a truncated file or a
    new ``report.json`` beside an old ``report.md``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        staged.append((stage_text(directory / "report.json", json.dumps(data, indent=2, sort_keys=True) + "\n"),
                       directory / "report.json"))
        fd, name = tempfile.mkstemp(prefix=".changes.png.", suffix=".tmp", dir=directory)
        os.close(fd)
        png = Path(name)
        staged.append((png, directory / "changes.png"))
        plot = "changes.png" if plot_changes(_rows(data), png) else None
        if plot is None:
            staged.pop()
            png.unlink()
        else:
            os.chmod(png, new_file_mode(directory / "changes.png"))
        staged.append((stage_text(directory / "report.md", markdown(data, plot)), directory / "report.md"))
        for tmp, final in staged:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise


def write_report(session: GateSession, directory: Path) -> None:
    """The session's report into *directory* (see :func:`write_report_data`)."""
    write_report_data(report_data(session), directory)


def merge_report_files(paths: list[Path], directory: Path) -> dict[str, Any]:
    """Merge the ``report.json`` of several shards and write the merged report into *directory*."""
    parts = []
    for path in paths:
        try:
            parts.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as exc:
            raise ReportError(f"{path}: cannot be read as a report ({exc})") from None
    merged = merge_reports(parts, [str(p) for p in paths])
    write_report_data(merged, directory)
    return merged
