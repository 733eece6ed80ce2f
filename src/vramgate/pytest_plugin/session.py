"""The gate's session: options, this machine's facts, every test's metrics checked against budgets and
baselines, the baselines to write, and the plain :class:`~vramgate.report.summary.Summary` reports render.

Longer than 400 lines: the order in which a metric's rules apply (untrusted: the GPU-state guard, then the noise
guard; budget-only, missing, another machine's speed, the baseline) is one function (``GateSession._finding``),
kept in one place so that it reads as one decision."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from vramgate.core.checks import Finding, Verdict, check_baseline, check_budget, check_noise, leak_detail
from vramgate.core.claims import ClaimVerdict
from vramgate.core.kinds import kind_rule
from vramgate.core.metrics import Metric, relative_change
from vramgate.core.provenance import Provenance
from vramgate.core.verdicts import Judgement
from vramgate.machine import hardware, speed
from vramgate.machine.software import git_commit, now_utc, software_versions, version_mismatches
from vramgate.pytest_plugin.fixture import Gate
from vramgate.pytest_plugin.marks import HARDWARE_MARKERS, MARKERS, HardwareNeed, marker_value
from vramgate.pytest_plugin.options import read_options
from vramgate.runtime import engine_env
from vramgate.store.baselines import BaselineError, DirectoryStorage, NodeBaseline
from vramgate.store.moves import Move

if TYPE_CHECKING:  # the report's types are imported only when a summary is made (Note [inert until asked])
    from vramgate.report.summary import Hardware, NodeSummary, Summary

MISSING_VERDICTS: dict[str, Verdict] = {"fail": "missing", "record": "new", "skip": "not compared"}


@dataclass
class NodeResult:
    """The findings of one test, kept for the summary and the report."""

    nodeid: str
    suite: str
    findings: list[Finding]
    test_passed: bool
    baseline_path: Path | None = None
    """The machine-bound metrics' baseline file (hardware key)."""
    mismatches: list[str] = field(default_factory=list)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    """GPU-state readings taken around the test's measurements."""

    portable_path: Path | None = None
    """The portable metrics' baseline file (tier key)."""

    @property
    def failed(self) -> bool:
        """Whether a metric of the test falls short."""
        return any(f.failed for f in self.findings)

    def path_of(self, finding: Finding) -> Path | None:
        """The baseline file that holds (or would hold) *finding*'s metric."""
        return self.portable_path if finding.metric.effective_scope == "portable" else self.baseline_path


class GateSession:
    """Session state of the gate: options, hardware, baselines, findings.

    Registered with the plugin manager under the plugin's ``SESSION_NAME``: tests reach it there (its
    :attr:`gpus`, its :attr:`report_dir`).
    """

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.options = read_options(config)
        options = self.options
        self.baselines_dir = options.baselines_dir
        self.storage = DirectoryStorage(self.baselines_dir)
        self.hardware_override = options.hardware_override
        self.missing = options.missing
        self.report_dir = options.report_dir
        self.update = options.update
        self.update_scope = options.update_scope
        self.baselines_ref = options.baselines_ref
        self.require_hardware = options.require_hardware
        self.computed_tier = options.compute_tier
        """The tier whose portable figures this session computes here (Note [a tier's portable figures computed on
        CPU] in :mod:`vramgate.machine.hardware`), or None."""
        self.moves: list[Move] | None = None
        self.affected: dict[str, Any] | None = None
        """``--gate-affected``'s selection as ``report.json``'s ``affected`` (from this process's collection or an
        xdist worker's), None without the option."""
        """Baseline metrics that differ between ``baselines_ref`` and the tree (:mod:`vramgate.store.moves`)."""
        self.active = bool(options.asked)
        """Note [inert until asked]: the gate reads baselines, probes hardware, checks hygiene and writes a
        summary or report only in a session that sets a ``--gate-*`` option or ini value, or whose tests use the
        ``gate`` fixture, an engine fixture (``gate_engine_fixtures``) or a vramgate marker. Installed, it does
        nothing to other projects."""
        self._has_baselines: dict[str, bool] = {}
        self.results: list[NodeResult] = []
        self.claims: list[tuple[str, ClaimVerdict]] = []
        self.judgements: list[Judgement] = []
        """What each ``gate_judges`` case found of its profile (Note [profile verdict] in vramgate.core.verdicts)."""
        self.pending: dict[tuple[str, str], dict[str, NodeBaseline]] = {}
        """Baselines to write at the end: per (key, suite), the node ids' entries."""
        self._pending_gpus: dict[str, int] = {}
        """The GPUs the tests of each pending key use (their baseline file's hardware names those)."""
        self.written: list[Path] = []
        self.report_written = False
        self.errors: list[str] = []
        self.durations: dict[str, float] = {}
        """Seconds per test (setup, call and teardown), from the reports of this process (Note [longest first])."""
        self._fingerprint: hardware.Fingerprint | None = None
        self._gpus: tuple[hardware.GPUInfo, ...] | None = None
        self._software: dict[str, str] | None = None
        self._commit: str | bool | None = False

    # -- lazily probed facts -------------------------------------------------

    @property
    def fingerprint(self) -> hardware.Fingerprint:
        """This machine's fingerprint, the one every layer of a session reads (probed on first use;
        ``--gate-hardware`` overrides the key; a project's ``pytest_vramgate_machine_info`` adds facts)."""
        if self._fingerprint is None:
            try:
                fp = hardware.detect()
            except ValueError as exc:  # a bad VRAMGATE_CPU_ISA
                raise pytest.UsageError(f"hardware: {exc}") from None
            if self.hardware_override:
                try:
                    fp = hardware.with_key(fp, self.hardware_override)
                except ValueError as exc:
                    raise pytest.UsageError(f"--gate-hardware: {exc}") from None
            added: dict[str, str] = {}
            self.config.hook.pytest_vramgate_machine_info(config=self.config, machine_info=added)
            wrong = sorted(k for k, v in added.items() if not isinstance(k, str) or not isinstance(v, str))
            if wrong:
                raise pytest.UsageError(f"pytest_vramgate_machine_info: facts must map names to text; not: {wrong}")
            if added:
                fp = dataclasses.replace(fp, extra={**added, **fp.extra})
            self._fingerprint = fp
        return self._fingerprint

    @property
    def gpus(self) -> tuple[hardware.GPUInfo, ...]:
        """The GPUs this process sees (probed on first use)."""
        if self._gpus is None:
            self._gpus = hardware.visible_gpus()
        return self._gpus

    @property
    def software(self) -> dict[str, str]:
        """The versions of the software a baseline records (read on first use)."""
        if self._software is None:
            self._software = software_versions()
            if self.options.engine_python:  # what is measured is the engine environment's (vramgate.runtime.engine_env)
                env = engine_env.probe(self.options.engine_python)
                if not env.is_gate_interpreter:
                    self._software.update({**env.versions(), "engine_python": env.python})
        return self._software

    def provenance(self, scope: str = "portable") -> Provenance:
        """Where a baseline written now comes from: this commit, now, this software, and for machine-bound
        figures this machine's speed (Note [machine speed] in :mod:`vramgate.machine.speed`)."""
        if self._commit is False:
            self._commit = git_commit(self.config.rootpath)
        commit = self._commit if isinstance(self._commit, str) else None
        computed_on = None
        if self.computed_tier and scope == "portable":
            vllm = " ".join(v for v in (self.software.get("vllm_distribution"), self.software.get("vllm")) if v)
            computed_on = f"CPU from vLLM's own classes ({vllm or 'vLLM'}), no {self.computed_tier} device"
        return Provenance(commit=commit, date=now_utc(), software=self.software,
                          machine_speed_s=speed.machine_speed_s() if self._speed_checked(scope) else None,
                          computed_on=computed_on)

    def _speed_checked(self, scope: str) -> bool:
        """Whether *scope*'s timings carry the host's speed probe: machine-bound, CPU key (Note [machine speed])."""
        return scope == "machine" and self.fingerprint.tier == "cpu"

    # -- collection ------------------------------------------------------------

    def suite_for(self, item: pytest.Item) -> str:
        """The suite (baseline file) of *item*: its ``gate_suite`` mark, else its folder under ``suites/``."""
        mark = item.get_closest_marker("gate_suite")
        if mark is not None:
            return str(marker_value(mark, item.nodeid))
        path = Path(item.nodeid.split("::", 1)[0])
        parts = path.parts
        if "suites" in parts[:-1]:
            i = parts.index("suites")
            if i + 2 < len(parts):
                return parts[i + 1]
        if len(parts) > 1:
            return parts[-2]
        stem = path.stem
        return stem[5:] if stem.startswith("test_") else stem

    @staticmethod
    def gpus_used(item: pytest.Item) -> int:
        """How many GPUs *item* uses: its closest ``requires_gpus(n)``, else 1 (Note [GPUs a test uses] in
        :mod:`vramgate.machine.hardware`)."""
        mark = item.get_closest_marker("requires_gpus")
        if mark is None:
            return 1
        value = marker_value(mark, item.nodeid)
        return value if isinstance(value, int) else 1

    def uses_gate(self, item: pytest.Item) -> bool:
        """Whether *item* uses the gate: its fixtures or a vramgate marker (Note [inert until asked])."""
        names = getattr(item, "fixturenames", ())
        return any(f in names for f in ("gate", *self.options.engine_fixtures)) or any(
            mark.name in MARKERS for mark in item.iter_markers())

    def plan(self, items: list[pytest.Item]) -> list[tuple[str, str, str | None]]:
        """(node id, what it needs, why it would skip here or None) for each test with a ``requires_*`` mark."""
        out = []
        for item in items:
            needs = [HardwareNeed(m.name, marker_value(m, item.nodeid)) for m in item.iter_markers()
                     if m.name in HARDWARE_MARKERS]
            if not needs:
                continue
            reasons = [r for r in (n.unmet(self.gpus) for n in needs) if r]
            out.append((item.nodeid, ", ".join(n.describe() for n in needs), reasons[0] if reasons else None))
        return out

    def plan_baselines(self, items: list[pytest.Item]) -> list[tuple[str, str, str, str, list[str], list[str]]]:
        """(suite, node id, its machine-bound key, files read, metrics stored there, the rest of its suite's metrics
        per the matrix, which this machine would record) for each gated test (``--gate-plan``)."""
        from vramgate.matrix.suites import suite_rules  # Note [matrix suites]: what the suites declared

        out = []
        for item in (i for i in items if self.uses_gate(i)):
            suite = self.suite_for(item)
            gpus = self.gpus_used(item)
            compared, files = [], []
            for scope in ("portable", "machine"):
                key = self.key_for(scope, gpus)
                entry = self._entry(key, suite, item.nodeid)
                if entry is not None:
                    compared += sorted(entry.metrics)
                    files.append(str(self.storage.path_for(key, suite)))
            rule = suite_rules().get(suite)
            records = [m for m in (rule.metrics if rule else ()) if m not in compared]
            out.append((suite, item.nodeid, self.key_for("machine", gpus), ", ".join(files) or "-", compared,
                        records))
        return out

    # -- checking ----------------------------------------------------------------

    def key_for(self, scope: str, gpus: int = 1) -> str:
        """The key a metric of *scope* of a test that uses *gpus* GPUs is stored under: the tier's for portable,
        the hardware key of those GPUs otherwise (Note [GPUs a test uses] in :mod:`vramgate.machine.hardware`)."""
        fp = self.fingerprint
        if scope == "portable":
            return self.computed_tier or fp.portable_key
        return fp.for_gpus(gpus).key

    def has_baselines(self, key: str) -> bool:
        """Whether *key* has any baseline file at all (a machine the gate has seen before)."""
        if key not in self._has_baselines:
            folder = self.baselines_dir / key
            self._has_baselines[key] = folder.is_dir() and any(folder.glob("*.json"))
        return self._has_baselines[key]

    def _entry(self, key: str, suite: str, nodeid: str) -> NodeBaseline | None:
        try:
            stored = self.storage.load(key, suite)
        except BaselineError as exc:
            raise pytest.UsageError(f"unusable baseline file {exc}") from None
        return stored.tests.get(nodeid) if stored else None

    def evaluate(self, recorder: Gate, test_passed: bool) -> NodeResult:
        """Check every metric of *recorder* against budget and baseline.

        Note [metric scope]: a portable metric is looked up under the tier's
        key, a machine-bound one under the hardware key. Where the hardware key
        has no baselines at all (a machine of a kind the gate has not seen),
        its machine-bound metrics are "no baselines": reported, not compared,
        not failing, unless ``--gate-require-hardware``. Any other missing
        metric (a portable one; a machine-bound one on a key that has
        baselines) follows ``--gate-missing`` (fail by default).
        """
        entries = {scope: self._entry(self.key_for(scope, recorder.gpus), recorder.suite, recorder.nodeid)
                   for scope in ("portable", "machine")}
        findings: list[Finding] = []
        mismatches: list[str] = []
        for entry in entries.values():
            for line in version_mismatches(entry.recorded.software, self.software) if entry else []:
                if line not in mismatches:
                    mismatches.append(line)
        # Only a passing test whose measurements can be trusted records anything (see _queue_update).
        untrusted = ((bool(recorder.untrusted) and any(kind_rule(m.kind).timed for m in recorder.metrics.values()))
                     or any(check_noise(m) for m in recorder.metrics.values()))
        recordable = test_passed and not untrusted
        findings = [self._finding(metric, recorder, entries, recordable) for metric in recorder.metrics.values()]
        result = NodeResult(recorder.nodeid, recorder.suite, findings, test_passed,
                            self.storage.path_for(self.key_for("machine", recorder.gpus), recorder.suite), mismatches,
                            conditions=list(recorder.conditions),
                            portable_path=self.storage.path_for(self.key_for("portable"), recorder.suite))
        self.results.append(result)
        for scope, entry in entries.items():
            self._queue_update(result, scope, entry, recorder.gpus)
        return result

    def writes_baseline(self, recorder: Gate, metric: Metric) -> bool:
        """Whether the end of *recorder*'s test, if it passes, writes *metric* as a baseline (``--gate-update``, or
        ``--gate-missing record`` where none is stored): a paired test then pools two engine pairs' looks into it
        (Note [baselines of two engine pairs] in :mod:`vramgate.engine.looks`)."""
        if not metric.history or (self.computed_tier and metric.effective_scope == "machine"):
            return False
        if self.update_scope not in ("all", metric.effective_scope):
            return False
        if self.update:
            return True
        entry = self._entry(self.key_for(metric.effective_scope, recorder.gpus), recorder.suite, recorder.nodeid)
        return self.missing == "record" and (entry is None or metric.name not in entry.metrics)

    def preview(self, recorder: Gate, metric: Metric) -> Finding:
        """What the end of the test would find of *metric* now, against the stored baseline, recording nothing:
        how a test takes a second look before the history check fails it (Note [second look] in
        :mod:`vramgate.engine.looks`). Under ``--gate-update`` nothing is compared: the run records."""
        if self.update:
            return Finding(metric, "not compared", detail="--gate-update records this run's figures")
        entries = {scope: self._entry(self.key_for(scope, recorder.gpus), recorder.suite, recorder.nodeid)
                   for scope in ("portable", "machine")}
        return self._finding(metric, recorder, entries, recordable=False)

    def _finding(self, metric: Metric, recorder: Gate, entries: dict[str, NodeBaseline | None],
                 recordable: bool) -> Finding:
        """What the gate finds of one *metric* of *recorder*: the rules in the order the module's docstring
        gives."""
        budget = check_budget(metric)
        key = self.key_for(metric.effective_scope, recorder.gpus)
        entry = entries[metric.effective_scope]
        base = entry.metrics.get(metric.name) if entry else None
        provenance = entry.recorded if entry else None
        if kind_rule(metric.kind).timed and recorder.untrusted:
            return Finding(metric, "untrusted", base, provenance, None, budget, "; ".join(recorder.untrusted),
                           untrusted="gpu state")
        noise = check_noise(metric)  # Note [noise guard] in vramgate.core.stats
        if noise:
            return Finding(metric, "untrusted", base, provenance, None, None, noise, untrusted="too noisy")
        if self.computed_tier and metric.effective_scope == "machine":
            return Finding(metric, "not compared", budget=budget,
                           detail=f"machine-bound: this session computes the {self.computed_tier} tier's portable "
                                  "figures")
        if not metric.history:  # Note [budget-only figures] in vramgate.core.metrics
            return Finding(metric, "not compared", budget=budget,
                           detail=leak_detail(metric) or "held to its budgets only: never compared with a baseline")
        writes = self.update_scope in ("all", metric.effective_scope)
        if base is None:
            missing: Verdict = "new" if self.update and recordable and writes else MISSING_VERDICTS[self.missing]
            if missing == "new" and not (recordable and writes):
                missing = "not compared"  # nothing will be recorded for this test
            elif (missing == "missing" and metric.effective_scope == "machine" and not self.has_baselines(key)
                  and not self.require_hardware):
                missing = "no baselines"
            return Finding(metric, missing, budget=budget,
                           detail=f"{key} has no baselines" if missing == "no baselines" else "")
        timed = kind_rule(metric.kind).timed and self._speed_checked(metric.effective_scope)
        slower = speed.mismatch_here(entry.recorded.machine_speed_s) if entry and timed else None
        if entry and slower is not None:  # Note [machine speed]: a timing of another machine is not compared
            unjudged: Verdict = "updated" if self.update and recordable and writes else "not compared"
            return Finding(metric, unjudged, base, entry.recorded, relative_change(metric.value, base.value), budget,
                           slower)
        verdict, change, how = check_baseline(metric, base)
        if self.update and recordable and writes and verdict != "ok":
            verdict = "updated"
        return Finding(metric, verdict, base, provenance, change, budget, how)

    def _queue_update(self, result: NodeResult, scope: str, entry: NodeBaseline | None, gpus: int = 1) -> None:
        """Queue the metrics of *scope* of *result* for its baseline file, under ``--gate-update`` or
        ``--gate-missing record``."""
        if not result.test_passed or any(f.budget or f.verdict == "untrusted" for f in result.findings):
            return  # a failing test's (or an untrusted measurement's) figures never become a baseline
        if self.update_scope not in ("all", scope):
            return
        findings = [f for f in result.findings if f.metric.effective_scope == scope and f.metric.history]
        if self.update:
            metrics = {f.metric.name: f.metric for f in findings}
            if not metrics and entry is None:
                return
        elif self.missing == "record" and any(f.verdict == "new" for f in findings):
            metrics = dict(entry.metrics) if entry else {}
            metrics.update({f.metric.name: f.metric for f in findings if f.verdict == "new"})
        else:
            return
        key = self.key_for(scope, gpus)
        self._pending_gpus[key] = gpus if scope == "machine" else len(self.fingerprint.gpus)
        self.pending.setdefault((key, result.suite), {})[result.nodeid] = NodeBaseline(metrics, self.provenance(scope))

    def write_baselines(self) -> None:
        """Write the queued baselines; what cannot be written becomes an error of the session."""
        fp = self.fingerprint
        for (key, suite), tests in sorted(self.pending.items()):
            hardware_json = fp.for_gpus(self._pending_gpus.get(key, len(fp.gpus))).to_json()
            try:
                self.written.append(self.storage.update(key, suite, hardware_json, tests))
            except BaselineError as exc:
                self.errors.append(f"could not update the baseline of suite {suite!r}: {exc} "
                                   "(left as it is: repair or delete it, then rerun with --gate-update)")
            except OSError as exc:
                path = self.rel(self.storage.path_for(key, suite))
                self.errors.append(f"could not write the baseline of suite {suite!r} to {path}: {exc} "
                                   "(the previous file, if any, is unchanged)")

    # -- what the report is made of ------------------------------------------------

    def accept_args(self) -> list[str]:
        """The options after the node ids in the command that re-records baselines on this hardware."""
        args = ["--gate-update"]
        if self.update_scope != "all":
            args += ["--gate-update-scope", self.update_scope]
        if self.hardware_override:
            args += ["--gate-hardware", self.hardware_override]
        default = (self.config.rootpath / "baselines").resolve()
        if self.baselines_dir != default:
            args += ["--gate-baselines", str(self.baselines_dir)]
        return args

    def accept_command(self, nodeids: list[str]) -> str:
        """The command that re-records the baselines of *nodeids* on this hardware."""
        from vramgate.report.summary import accept_command

        return accept_command(nodeids, self.accept_args())

    def rel(self, path: Path | None) -> str:
        """*path* as a person reads it: relative to the project's root where it lies under it; ``?`` for none."""
        if path is None:
            return "?"
        try:
            return str(path.relative_to(self.config.rootpath))
        except ValueError:
            return str(path)

    def hardware(self) -> Hardware:
        """The hardware compared against, as the report names it."""
        from vramgate.report.summary import Hardware

        fp = self.fingerprint
        return Hardware(fp.key, self.computed_tier or fp.portable_key, fp.source, fp.to_json())

    def node_summary(self, result: NodeResult) -> NodeSummary:
        """*result* as plain data, its baseline files as a person reads them."""
        from vramgate.report.summary import CheckedMetric, NodeSummary

        metrics = []
        for f in result.findings:
            path = result.path_of(f)
            key = path.parent.name if path is not None else ""
            metrics.append(CheckedMetric(
                f, self.rel(path) if path is not None else None, key,
                # Only a missing metric's message asks (the answer is cached: the same all session).
                path is None or f.verdict != "missing" or self.has_baselines(key)))
        return NodeSummary(result.nodeid, result.suite, result.test_passed, metrics,
                           self.rel(result.baseline_path) if result.baseline_path else None, result.mismatches,
                           result.conditions)

    def version_problem(self) -> str | None:
        """Note [vLLM mismatch in CI]: baselines recorded with another vLLM version than the one measured are a
        prominent line everywhere; in CI (``CI`` set true, as GitHub Actions sets it) they fail the run, unless
        it is an upgrade run (``--gate-upgrade-from``) or re-records the baselines (``--gate-update``). Only the
        version counts, not the distribution: the CPU build's portable baselines serve the GPU tier too."""
        if os.environ.get("CI", "").lower() not in ("1", "true", "yes") or self.update or self.options.upgrade_from:
            return None
        lines = sorted({m for r in self.results for m in r.mismatches if m.startswith("vllm:")})
        if not lines:
            return None
        return (f"the baselines were recorded with another vLLM than the one measured ({'; '.join(lines)}): in CI "
                "this fails the run unless it is an upgrade run (vramgate upgrade, or --gate-upgrade-from) or it "
                "re-records the baselines (--gate-update)")

    def summary(self) -> Summary:
        """Everything the session found, for the terminal summary and the report files."""
        from vramgate.report.summary import Summary

        return Summary(
            hardware=self.hardware(),
            baselines_dir=str(self.baselines_dir),
            software=self.software,
            missing_policy=self.missing,
            update=self.update,
            accept_args=self.accept_args(),
            nodes=[self.node_summary(r) for r in self.results],
            claims=list(self.claims),
            written=[self.rel(p) for p in sorted(set(self.written))],
            baselines_ref=self.baselines_ref,
            moves=self.moves,
            affected=self.affected,
            report_file=str(self.report_dir / "report.md") if self.report_dir and self.report_written else None,
            errors=list(self.errors),
            durations=dict(self.durations),
            judgements=list(self.judgements),
            profiles=self.profile_names() if self.judgements else [],
        )

    def profile_names(self) -> list[str]:
        """The project's profiles, each a row of the report's profile table (Note [profile verdict])."""
        from vramgate.pytest_plugin.verdicts import project_profiles

        return project_profiles(self.config.rootpath, self.errors)
