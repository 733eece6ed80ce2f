"""What a report is made of, as plain data: the pytest plugin builds a :class:`Summary`, the report renders it.

Paths are given as the text a person reads (relative to the project's root where they lie under it), so that
nothing here needs the session that found them. Also here: the severity order of verdicts and the command that
accepts new baselines, each written once for every renderer.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from vramgate.core.checks import Finding
from vramgate.core.claims import ClaimVerdict
from vramgate.core.kinds import kind_rule
from vramgate.core.verdicts import Judgement
from vramgate.store.moves import Move
from vramgate.store.report_files import AffectedFacts, MovedBaselines

#: Verdicts from the most to the least severe: the order of rows and of the tally.
VERDICT_ORDER = ("regressed", "untrusted", "incompatible", "missing", "outside budget", "improved", "updated", "new",
                 "no baselines", "not compared", "ok")
#: Verdicts a person accepts on purpose by re-recording the baseline.
ACCEPTABLE = ("regressed", "missing", "incompatible")


def verdict_rank(verdict: str, outside_budget: bool = False) -> int:
    """The place of *verdict* in :data:`VERDICT_ORDER` (``ok`` outside its budget ranks as ``outside budget``, any
    other verdict as itself); a verdict not listed ranks last."""
    head = "outside budget" if outside_budget and verdict == "ok" else verdict
    return VERDICT_ORDER.index(head) if head in VERDICT_ORDER else len(VERDICT_ORDER)


def pytest_command(nodeids: list[str], args: list[str]) -> str:
    """The shell command that runs pytest on *nodeids* with *args*."""
    return shlex.join(["python", "-m", "pytest", *nodeids, *args])


def accept_command(nodeids: list[str], accept_args: list[str]) -> str:
    """The command that re-records the baselines of *nodeids* (*accept_args*: :attr:`Summary.accept_args`)."""
    return pytest_command(nodeids, accept_args)


@dataclass(frozen=True)
class CheckedMetric:
    """One finding of a test, with the baseline file it was (or would be) compared against."""

    finding: Finding
    file: str | None
    """The baseline file as a person reads it; None where the metric has none."""
    key: str
    """The key the metric was looked up under (the file's folder: a tier's for portable metrics, else the
    hardware's); empty without a file."""
    key_has_baselines: bool = True
    """Whether that key has any baseline file at all (read for missing metrics only)."""


@dataclass(frozen=True)
class NodeSummary:
    """The findings of one test."""

    nodeid: str
    suite: str
    test_passed: bool
    metrics: list[CheckedMetric]
    baseline_file: str | None
    """The machine-bound metrics' baseline file (hardware key)."""
    mismatches: list[str] = field(default_factory=list)
    """How this run's software differs from the baselines'."""
    conditions: list[dict[str, Any]] = field(default_factory=list)
    """GPU-state readings taken around the test's measurements."""

    @property
    def failed(self) -> bool:
        """Whether a metric of the test falls short."""
        return any(m.finding.failed for m in self.metrics)

    def files_of(self, metrics: list[CheckedMetric]) -> list[str]:
        """The baseline files of *metrics*, each once, portable first."""
        out: list[str] = []
        for m in sorted(metrics, key=lambda m: m.finding.metric.effective_scope != "portable"):
            if m.file is not None and m.file not in out:
                out.append(m.file)
        return out


@dataclass(frozen=True)
class Hardware:
    """The hardware a run compared against."""

    key: str
    tier: str
    source: str
    data: dict[str, Any]
    """The fingerprint as JSON data (``report.json``'s ``hardware``)."""


@dataclass(frozen=True)
class Summary:
    """Everything a session found, for the terminal summary and the report files."""

    hardware: Hardware
    baselines_dir: str
    software: dict[str, str]
    missing_policy: str
    update: bool
    accept_args: list[str]
    """The options after the node ids in the command that re-records baselines on this hardware."""
    nodes: list[NodeSummary]
    claims: list[tuple[str, ClaimVerdict]]
    """(node id, claim) of every claim a test checked."""
    written: list[str] = field(default_factory=list)
    """Baseline files written by this run, in the order of their paths."""
    baselines_ref: str | None = None
    moves: list[Move] | None = None
    """Baseline metrics that differ between ``baselines_ref`` and the tree; None without a ref."""
    report_file: str | None = None
    """The ``report.md`` written by this run, if any."""
    affected: dict[str, Any] | None = None
    """``--gate-affected``: the ref, its merge base, why every test ran (or None), how many were kept and the
    node ids left out; None without the option."""
    errors: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)
    """Seconds per test (setup, call and teardown) of every test run (Note [longest first])."""
    judgements: list[Judgement] = field(default_factory=list)
    """What each ``gate_judges`` case found of its profile (Note [profile verdict] in vramgate.core.verdicts)."""
    profiles: list[str] = field(default_factory=list)
    """The project's profiles: a row each in the profile table (with any other a judgement names)."""

    def mismatch_lines(self) -> list[str]:
        """Every version mismatch of every test, each once, in the order first seen."""
        seen: dict[str, None] = {}
        for node in self.nodes:
            for line in node.mismatches:
                seen.setdefault(line, None)
        return list(seen)

    def moved(self) -> MovedBaselines | None:
        """The baselines this change moves, with this run's figure of each where it ran; None without a ref."""
        if self.moves is None:
            return None
        found = {(m.file or "?", node.nodeid, m.finding.metric.name): m.finding
                 for node in self.nodes for m in node.metrics}
        out = []
        for move in self.moves:
            f = found.get((move.file, move.nodeid, move.metric))  # only a figure compared against that file
            matches = None
            if f is not None and move.new is not None:
                matches = kind_rule(f.metric.kind).confirms(f.metric.value, move.new.value,
                                                           judged_acceptable=f.verdict not in ACCEPTABLE)
            out.append(move.record(f.metric if f else None, matches))
        return MovedBaselines(self.baselines_ref, out)


def affected_line(affected: AffectedFacts | None) -> str | None:
    """The line every summary carries under ``--gate-affected``: what it left out (or why it ran everything), and
    against which base; None without the option."""
    if not affected or not affected.data:
        return None
    base = affected.base[:12]
    if affected.everything:
        return f"ran every test: {affected.everything} (against {affected.ref}, base {base})"
    return (f"left out: {len(affected.left_out)} test(s) whose inputs this change does not touch (base {base}); ran "
            f"{affected.kept}; pushes to main and the nightly run take them all")
