"""Two gate runs side by side: every metric of one ``report.json`` against the same metric of another.

Metrics pair by (test node id, metric name). The first run plays the baseline and each metric is judged by its
own rule (:func:`vramgate.core.checks.check_baseline`: exact ones one-sided against their tolerance, measured ones
and paired ratios by the U test on their stored samples). Where the runs' hardware keys differ, machine-bound
metrics are not compared (Note [metric scope] in :mod:`vramgate.core.metrics`); where their tiers differ, no
metric is. Different software versions are stated, never refused: comparing two vLLM versions is the point of an
upgrade report.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.core.checks import FAILING, check_baseline
from vramgate.core.kinds import changed_by_kind
from vramgate.core.metrics import Metric, format_change, format_value, relative_change
from vramgate.core.records import read_json
from vramgate.machine.software import COMPARED_VERSIONS
from vramgate.report.table import aligned
from vramgate.store.report_files import Report, ReportError, ReportMetric, read_report

#: The order of a suite's rows: what needs a look first.
ROW_ORDER = ("regressed", "incompatible", "not compared", "removed", "added", "improved", "ok")
#: Versions named in the header when they differ between the runs.
SOFTWARE_SHOWN = (*COMPARED_VERSIONS, "python")


@dataclass(frozen=True)
class ComparedMetric:
    """One metric of the comparison: its figure in both runs (None on the side it is absent from) and the verdict.

    ``verdict`` is the one :func:`~vramgate.core.checks.check_baseline` gives (``ok``, ``regressed``,
    ``improved``, ``incompatible``), or ``not compared`` (``reason`` says why), ``added`` (only in the new run)
    or ``removed`` (only in the old run).
    """

    suite: str
    nodeid: str
    metric: str
    unit: str
    kind: str
    scope: str
    old: float | None
    new: float | None
    change: float | None
    verdict: str
    decided_by: str = ""
    failed: bool = False
    reason: str = ""

    @property
    def changed(self) -> bool:
        """Whether this row is worth showing by default, by its kind's rule (Note [metric kinds]): any verdict but
        ``ok``, or an exact figure that moved within its tolerance (a measured one judged ``ok`` moved within its
        noise)."""
        if self.verdict != "ok" or self.old is None or self.new is None:
            return self.verdict != "ok"
        return changed_by_kind(self.kind, self.verdict, relative_change(self.new, self.old))

    def show(self, value: float | None) -> str:
        """*value* in this metric's unit; ``-`` for a side the metric is absent from."""
        return "-" if value is None else format_value(value, self.unit)

    def to_json(self) -> dict[str, Any]:
        """This row as plain JSON data (an infinite change as the string ``inf``/``-inf``)."""
        out = dataclasses.asdict(self)
        if self.change is not None and not math.isfinite(self.change):
            out["change"] = str(self.change)
        return out


@dataclass(frozen=True)
class RunFacts:
    """What the header says about one run: its label, where it came from (its file; empty for data handed over in
    memory), its hardware and software."""

    label: str
    source: str
    hardware_key: str
    tier: str
    software: dict[str, str]
    tests: int
    failing_tests: tuple[str, ...]

    def line(self) -> str:
        """One header line: label, source, hardware, the versions that matter, failing tests."""
        versions = ", ".join(f"{k} {self.software[k]}" for k in SOFTWARE_SHOWN if self.software.get(k))
        failing = f", {len(self.failing_tests)} failing" if self.failing_tests else ""
        where = f"{self.source}; " if self.source else ""
        return (f"{self.label}: {where}hardware {self.hardware_key} (tier {self.tier}); "
                f"{versions or 'no versions recorded'}; {self.tests} test(s){failing}")


@dataclass
class Comparison:
    """Two runs compared metric by metric (see the module's docstring)."""

    old: RunFacts
    new: RunFacts
    rows: list[ComparedMetric] = field(default_factory=list)
    """The metrics both runs have."""
    added: list[ComparedMetric] = field(default_factory=list)
    """Metrics only the new run has."""
    removed: list[ComparedMetric] = field(default_factory=list)
    """Metrics only the old run has."""

    @property
    def labels(self) -> tuple[str, str]:
        """The two sides' labels, old first."""
        return self.old.label, self.new.label

    @property
    def regressions(self) -> list[ComparedMetric]:
        """The rows whose verdict fails (regressed, incompatible)."""
        return [r for r in self.rows if r.failed]

    @property
    def hardware_differs(self) -> bool:
        """Whether the runs' hardware keys differ (machine-bound metrics are then not compared)."""
        return self.old.hardware_key != self.new.hardware_key

    @property
    def software_changes(self) -> list[str]:
        """One line per version that differs between the runs (``vllm 0.31.0 -> 0.32.0``)."""
        out = []
        for name in SOFTWARE_SHOWN:
            a, b = self.old.software.get(name), self.new.software.get(name)
            if a != b:
                out.append(f"{name} {a or 'absent'} -> {b or 'absent'}")
        return out

    def counts(self) -> dict[str, int]:
        """How many metrics have each verdict (``unchanged``: ``ok`` and not :attr:`ComparedMetric.changed`)."""
        out = {v: 0 for v in ("regressed", "incompatible", "improved", "ok", "unchanged", "not compared")}
        for r in self.rows:
            out[r.verdict] = out.get(r.verdict, 0) + 1
            out["unchanged"] += not r.changed
        return {**out, "added": len(self.added), "removed": len(self.removed)}

    def header_lines(self) -> list[str]:
        """The lines above the table: both runs, what differs between them, the counts."""
        out = [f"vramgate compare: {self.old.label} -> {self.new.label}", self.old.line(), self.new.line()]
        changes = self.software_changes
        out.append(f"Software differs: {'; '.join(changes)}" if changes else "Same software versions")
        if self.old.tier != self.new.tier:
            out.append(f"!! Tiers differ ({self.old.tier} vs {self.new.tier}): no metric is compared")
        elif self.hardware_differs:
            out.append(f"!! Hardware keys differ ({self.old.hardware_key} vs {self.new.hardware_key}): "
                       "machine-bound metrics are not compared, portable ones are")
        c = self.counts()
        out.append(f"{len(self.rows)} metric(s) in both: {c['regressed']} regressed, {c['incompatible']} incompatible, "
                   f"{c['improved']} improved, {c['ok']} ok ({c['unchanged']} unchanged), {c['not compared']} not "
                   f"compared; {c['added']} added, {c['removed']} removed")
        return out

    def by_suite(self, everything: bool = False,
                 one_sided: bool = True) -> Iterator[tuple[str, list[ComparedMetric]]]:
        """Every row (added and removed included, unless not *one_sided*) by suite, in suite order; within a suite
        regressions first, then by :data:`ROW_ORDER`, test and metric. Unchanged rows only with *everything*."""
        groups: dict[str, list[ComparedMetric]] = {}
        for r in (*self.rows, *self.added, *self.removed) if one_sided else self.rows:
            if everything or r.changed:
                groups.setdefault(r.suite, []).append(r)
        for suite in sorted(groups):
            yield suite, sorted(groups[suite], key=lambda r: (ROW_ORDER.index(r.verdict), r.nodeid, r.metric))

    def _cells(self, r: ComparedMetric, short: bool) -> tuple[str, ...]:
        test = r.nodeid.split("::", 1)[-1] if short else r.nodeid
        change = format_change(r.change) if r.change is not None else "-"
        return (test, r.metric, r.show(r.old), r.show(r.new), change, r.verdict, r.reason or r.decided_by)

    def _head(self) -> tuple[str, ...]:
        return ("test", "metric", self.old.label, self.new.label, "change", "verdict", "decided by")

    def _hidden(self, everything: bool) -> int:
        return 0 if everything else sum(1 for r in self.rows if not r.changed)

    def text(self, everything: bool = False) -> str:
        """The header and one aligned table per suite; with *everything* the unchanged rows too."""
        out = self.header_lines()
        for suite, rows in self.by_suite(everything):
            out += ["", f"suite {suite}"]
            out += ["  " + line for line in aligned(self._head(), [self._cells(r, True) for r in rows])]
        hidden = self._hidden(everything)
        if hidden:
            out += ["", f"{hidden} unchanged metric(s) not listed (--all lists them)"]
        return "\n".join(out) + "\n"

    def markdown(self, everything: bool = False, *, one_sided: bool = True, level: int = 2) -> str:
        """GitHub-flavoured markdown: the header, then one table per suite (as :meth:`text`); without *one_sided*
        the added and removed metrics are counted, not listed; *level* is the heading level of the title (the
        suites' one more)."""
        def esc(text: str) -> str:
            return text.replace("|", "\\|")

        regressed = len(self.regressions)
        status = f"❌ {regressed} regression(s)" if regressed else "✅ no regression"
        head, *facts = self.header_lines()
        out = [f"{'#' * level} {head}: {status}", ""]
        out += [f"> **{line[3:]}**" if line.startswith("!!") else f"- {esc(line)}" for line in facts]
        out.append("")
        for suite, rows in self.by_suite(everything, one_sided):
            out += [f"{'#' * (level + 1)} {suite}", "", "| " + " | ".join(map(esc, self._head())) + " |",
                    "|---" * 7 + "|"]
            for r in rows:
                cells = list(self._cells(r, False))
                cells[0] = f"`{cells[0]}`"
                out.append("| " + " | ".join(esc(c) for c in cells) + " |")
            out.append("")
        hidden = self._hidden(everything)
        if hidden:
            out += [f"{hidden} unchanged metric(s) not listed.", ""]
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        """The comparison as plain JSON data: both runs' facts, what differs, the counts and every row."""
        return {
            "old": dataclasses.asdict(self.old),
            "new": dataclasses.asdict(self.new),
            "software_changes": self.software_changes,
            "hardware_differs": self.hardware_differs,
            "counts": self.counts(),
            "rows": [r.to_json() for r in self.rows],
            "added": [r.to_json() for r in self.added],
            "removed": [r.to_json() for r in self.removed],
        }


def _require(cond: bool, source: str, message: str) -> None:
    if not cond:
        raise ReportError(f"{source}: {message}")


def _facts(report: Report, source: str, label: str, from_file: bool) -> RunFacts:
    """The header facts of one run (*source* names it in errors)."""
    key = report.hardware.key
    _require(key is not None, source, "hardware: must be an object with a key")
    assert key is not None
    failing = tuple(t.nodeid for t in report.tests if t.test_passed is False)
    versions = {k: str(v) for k, v in report.software.items()}
    return RunFacts(label, source if from_file else "", key, report.hardware.tier or "?", versions,
                    len(report.tests), failing)


def _entries(report: Report) -> dict[tuple[str, str], ReportMetric]:
    """Every metric of a run by (node id, name)."""
    return {(m.nodeid, m.metric.name): m for m in report.metrics()}


def _judge(old: Metric, new: Metric, hardware: tuple[str, str], tiers: tuple[str, str]) -> tuple[str, float, str, str]:
    """(verdict, change, how decided, why not compared) of one metric both runs have."""
    machine = "machine" in (old.effective_scope, new.effective_scope)
    if not (old.history and new.history):  # Note [budget-only figures] in vramgate.core.metrics
        why = "held to its budgets only: a figure of one run, never compared with another's"
    elif tiers[0] != tiers[1]:
        why = "the tiers differ"
    elif machine and hardware[0] != hardware[1]:
        why = "machine-bound, and the hardware keys differ"
    else:
        verdict, change, how = check_baseline(new, old)
        return verdict, change, how, ""
    return "not compared", relative_change(new.value, old.value), "", why


def _one_side(e: ReportMetric, verdict: str, reason: str) -> ComparedMetric:
    m = e.metric
    old, new = (m.value, None) if verdict == "removed" else (None, m.value)
    return ComparedMetric(e.suite, e.nodeid, m.name, m.unit, m.kind, m.effective_scope, old, new, None, verdict,
                          reason=reason)


def compare_reports(old: Report | dict[str, Any], new: Report | dict[str, Any], *,
                    labels: tuple[str, str] = ("A", "B"), sources: tuple[str, str] | None = None) -> Comparison:
    """Compare two runs' reports (their records, or ``report.json`` as loaded): *old* plays the baseline of *new*.

    *labels* head the two value columns (``"vLLM 0.31.0"``); *sources* name where each came from in the header
    and in errors (errors name the labels without them). :class:`~vramgate.report.data.ReportError` for data
    that is not a report.
    """
    names = sources or labels
    reports = read_report(old, names[0], ReportError), read_report(new, names[1], ReportError)
    result = Comparison(_facts(reports[0], names[0], labels[0], sources is not None),
                        _facts(reports[1], names[1], labels[1], sources is not None))
    before, after = _entries(reports[0]), _entries(reports[1])
    hardware = (result.old.hardware_key, result.new.hardware_key)
    tiers = (result.old.tier, result.new.tier)
    for key in sorted(before.keys() & after.keys()):
        a, b = before[key], after[key]
        verdict, change, how, why = _judge(a.metric, b.metric, hardware, tiers)
        m = b.metric
        result.rows.append(ComparedMetric(b.suite, b.nodeid, m.name, m.unit, m.kind, m.effective_scope, a.metric.value,
                                          m.value, change, verdict, how, verdict in FAILING, why))
    for key in sorted(after.keys() - before.keys()):
        result.added.append(_one_side(after[key], "added", f"not in {labels[0]}"))
    for key in sorted(before.keys() - after.keys()):
        nodeid = key[0]
        why = (f"the test failed in {labels[1]}" if nodeid in result.new.failing_tests
               else f"not in {labels[1]}")
        result.removed.append(_one_side(before[key], "removed", why))
    return result


def load_report(path: Path) -> dict[str, Any]:
    """The data of a ``report.json`` (*path*, or a folder holding one); :class:`ReportError` naming the file
    when it is missing or not JSON."""
    file = path / "report.json" if path.is_dir() else path
    if not file.exists():
        where = f"{path} holds no report.json" if path.is_dir() else f"{file}: no such file"
        raise ReportError(where)
    data = read_json(file, ReportError)
    _require(isinstance(data, dict), str(file), "not a vramgate report.json: the top level must be a JSON object")
    assert isinstance(data, dict)
    return data


def compare_report_files(old: Path, new: Path, *, labels: tuple[str, str] = ("A", "B")) -> Comparison:
    """Compare two ``report.json`` files (or folders holding one): *old* plays the baseline of *new*."""
    def source(p: Path) -> str:
        return str(p / "report.json" if p.is_dir() else p)

    return compare_reports(load_report(old), load_report(new), labels=labels, sources=(source(old), source(new)))
