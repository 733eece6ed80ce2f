"""``report.json``: everything a session found as plain JSON data, the report files written from it, and the
merge of several shards' reports into one; also the per-metric junit properties."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from vramgate.core.checks import Finding, verdict_text
from vramgate.report.chart import plot_changes
from vramgate.report.markdown import markdown
from vramgate.report.summary import Summary
from vramgate.report.table import rows_of
from vramgate.report.terminal import failure_message
from vramgate.store.files import new_file_mode, stage_text
from vramgate.store.report_files import (
    AffectedFacts,
    Claim,
    HardwareFacts,
    MetricRecord,
    MovedBaselines,
    MovedMetric,
    Report,
    ReportError,
    TestRecord,
    as_report,
    read_report,
)


def junit_properties(findings: list[Finding]) -> list[tuple[str, str]]:
    """One junit ``<property>`` per metric: ``vramgate.<metric>`` = value, baseline, verdict and how it is judged."""
    def num(v: float) -> str:
        return str(int(v)) if float(v).is_integer() else f"{v:.6g}"

    out = []
    for f in findings:
        m = f.metric
        base = f"{num(f.baseline.value)} {m.unit}" if f.baseline is not None else "none"
        verdict = verdict_text(f.verdict, bool(f.budget), name_ok=True)
        out.append((f"vramgate.{m.name}", f"{num(m.value)} {m.unit}; baseline {base}; verdict {verdict}; "
                    f"{m.kind}, {m.better} is better, {m.effective_scope}, tolerance {m.effective_tolerance:g}"))
    return out


def report_record(summary: Summary) -> Report:
    """Everything the gate found, as the report's records (:class:`~vramgate.store.report_files.Report`)."""
    tests = []
    for node in sorted(summary.nodes, key=lambda n: n.nodeid):
        tests.append(TestRecord(
            nodeid=node.nodeid,
            suite=node.suite,
            test_passed=node.test_passed,
            failed=node.failed,
            message=failure_message(node, summary.hardware, summary.accept_args) if node.failed else None,
            baseline_file=node.baseline_file or "?",
            version_mismatches=node.mismatches,
            gpu_conditions=node.conditions,
            rows=rows_of([node]),
            metrics=[
                MetricRecord(name=f.metric.name, now=f.metric, verdict=f.verdict, failed=f.failed,
                             baseline=f.baseline, baseline_recorded=f.provenance.to_json() if f.provenance else None,
                             change=f.change, budget=f.budget, decided_by=f.detail, untrusted=f.untrusted)
                for f in (m.finding for m in node.metrics)
            ],
        ))
    return Report(
        tests=tests,
        hardware=HardwareFacts(summary.hardware.data),
        software=summary.software,
        missing_policy=summary.missing_policy,
        update=summary.update,
        accept_args=summary.accept_args,
        version_mismatches=sorted(summary.mismatch_lines()),
        claims=sorted((Claim(nodeid, c.statement, c.held, c.evidence, c.source, c.judged)
                       for nodeid, c in summary.claims), key=lambda c: (c.test, c.statement)),
        baselines_written=sorted(set(summary.written)),
        moved_baselines=summary.moved(),
        affected=AffectedFacts(summary.affected) if summary.affected is not None else None,
        durations={k: round(v, 3) for k, v in sorted(summary.durations.items())},
        profiles=sorted(summary.profiles),
        judgements=sorted(summary.judgements, key=lambda j: (j.profile, j.check, j.test, j.state)),
    )


def report_data(summary: Summary) -> dict[str, Any]:
    """Everything the gate found, as plain JSON data (what ``report.md`` is made from; shards merge it)."""
    return report_record(summary).to_json()


def merge_reports(parts: list[Any], names: list[str] | None = None) -> Report:
    """One report from the reports of several shards of one run (same hardware key and settings)."""
    if not parts:
        raise ReportError("no reports to merge")
    names = names or [f"report {i + 1}" for i in range(len(parts))]
    reports = [read_report(part, name, ReportError) for name, part in zip(names, parts, strict=True)]
    first = reports[0]
    for name, part in zip(names, reports, strict=True):
        if part.hardware.key != first.hardware.key:
            raise ReportError(f"{name}: hardware key {part.hardware.key!r} differs from {names[0]}'s "
                              f"{first.hardware.key!r}; shards of one run share a key")
        for key, mine, theirs in (("missing_policy", part.missing_policy, first.missing_policy),
                                  ("update", part.update, first.update),
                                  ("accept_args", part.accept_args, first.accept_args)):
            if mine != theirs:
                raise ReportError(f"{name}: {key} {mine!r} differs from {names[0]}'s {theirs!r}")
    tests = sorted((t for p in reports for t in p.tests), key=lambda t: t.nodeid)
    seen = [t.nodeid for t in tests]
    duplicates = sorted({n for n in seen if seen.count(n) > 1})
    if duplicates:
        raise ReportError(f"test(s) reported by more than one shard: {', '.join(duplicates[:5])}")
    return dataclasses.replace(
        first,
        version_mismatches=sorted({m for p in reports for m in p.version_mismatches}),
        tests=tests,
        claims=sorted((c for p in reports for c in p.claims), key=lambda c: (c.test, c.statement)),
        baselines_written=sorted({b for p in reports for b in p.baselines_written}),
        moved_baselines=_merge_moved([p.moved_baselines for p in reports]),
        durations=dict(sorted({k: v for p in reports for k, v in p.durations.items()}.items())),
        profiles=sorted({name for p in reports for name in p.profiles}),
        judgements=sorted((j for p in reports for j in p.judgements),
                          key=lambda j: (j.profile, j.check, j.test, j.state)),
    )


def _merge_moved(parts: list[MovedBaselines | None]) -> MovedBaselines | None:
    """The shards' moved baselines: the same list from every shard, with this run's figure where a shard ran it."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    merged: dict[tuple[str, str, str], MovedMetric] = {}
    for part in present:
        for m in part.metrics:
            key = (m.file, m.test, m.metric)
            if key not in merged or merged[key].now is None:
                merged[key] = m
    return MovedBaselines(present[0].ref, [merged[k] for k in sorted(merged)])


def write_report_data(data: Report | dict[str, Any], directory: Path) -> None:
    """Write ``report.json``, ``changes.png`` (when a metric changed and matplotlib is there) and ``report.md``
    into *directory*.

    Note [report all or nothing]: every file is first written in full to a
    temporary file in *directory*; only when all are written are they renamed
    into place. A write that fails (a full disk) removes the temporary files
    and leaves the previous report as it was, never a truncated file or a
    new ``report.json`` beside an old ``report.md``.
    """
    report = as_report(data)
    raw = report.to_json() if isinstance(data, Report) else data
    directory.mkdir(parents=True, exist_ok=True)
    staged: list[tuple[Path, Path]] = []
    try:
        staged.append((stage_text(directory / "report.json", json.dumps(raw, indent=2, sort_keys=True) + "\n"),
                       directory / "report.json"))
        fd, name = tempfile.mkstemp(prefix=".changes.png.", suffix=".tmp", dir=directory)
        os.close(fd)
        png = Path(name)
        staged.append((png, directory / "changes.png"))
        plot = "changes.png" if plot_changes(report, png) else None
        if plot is None:
            staged.pop()
            png.unlink()
        else:
            os.chmod(png, new_file_mode(directory / "changes.png"))
        staged.append((stage_text(directory / "report.md", markdown(report, plot)), directory / "report.md"))
        for tmp, final in staged:
            os.replace(tmp, final)
        if plot is None:  # nothing changed this time: the previous run's picture would mislead
            with contextlib.suppress(FileNotFoundError):
                (directory / "changes.png").unlink()
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise


def write_report(summary: Summary, directory: Path) -> None:
    """The session's report into *directory* (see :func:`write_report_data`)."""
    write_report_data(report_record(summary), directory)


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
    return merged.to_json()
