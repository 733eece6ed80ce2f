"""``report.json`` as records: the one reader that turns a gate run's report data into dataclasses (a test, its
rows, its metrics, the claims, the moved baselines), checked, and writes them back as the same JSON.

Longer than 400 lines: the report's format is one concept with one owner, and every record of it (with its
reading and its JSON) is here, so that no renderer reads a report's data by key.

``vramgate report compare``, the dashboard exports, the HTML page, ``report.md`` and the history's unreviewed
points all read the same file through :func:`read_report`: every test's metrics parsed (the ``now`` figure with
:func:`~vramgate.store.baselines.parse_metric`, the same check as a stored baseline's), an error that names the
file, the test and the metric, and each verdict with whether it is outside its budget and why it is untrusted as
fields, never as text (:func:`~vramgate.core.checks.verdict_text` makes the text once).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from vramgate.core.checks import Untrusted, Verdict, verdict_text
from vramgate.core.metrics import Metric
from vramgate.core.paired import TOO_NOISY
from vramgate.core.records import RecordFormat
from vramgate.core.verdicts import Judgement, ProfileRow, profile_rows
from vramgate.store.baselines import BaselineError, parse_metric


def _untrusted_reasons(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 -> 2: each metric says why an ``untrusted`` verdict was not judged (``untrusted``: ``too noisy``
    or ``gpu state``; None for every other verdict). Schema 1 kept the reason only in the text of ``decided_by``,
    read here once for the files written before."""
    tests = []
    for test in data.get("tests") or []:
        if isinstance(test, dict) and isinstance(test.get("metrics"), list):
            test = {**test, "metrics": [
                {**m, "untrusted": ("too noisy" if str(m.get("decided_by") or "").startswith(TOO_NOISY)
                                    else "gpu state") if m.get("verdict") == "untrusted" else None}
                if isinstance(m, dict) else m for m in test["metrics"]]}
        tests.append(test)
    return {**data, "tests": tests} if "tests" in data else data


def _profile_table(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 2 -> 3: the profile table's data (Note [profile verdict] in :mod:`vramgate.core.verdicts`): the
    project's ``profiles`` and each judging case's ``judgements``; a report written before had none."""
    return {**data, "profiles": [], "judgements": []}


#: ``report.json``'s format (Note [versioned records] in :mod:`vramgate.core.records`): what the report layer
#: writes and every reader loads through :func:`check_report`. Schema 2: each metric's ``untrusted`` reason.
#: Schema 3: the profiles and their judgements.
REPORT_FORMAT = RecordFormat("report.json", current=3, migrations={1: _untrusted_reasons, 2: _profile_table})

#: The verdicts a report's metric may hold.
VERDICTS: frozenset[str] = frozenset(get_args(Verdict))
#: Why a report's ``untrusted`` verdict was not judged.
UNTRUSTED: frozenset[str] = frozenset(get_args(Untrusted))

Error = Callable[[str], Exception]


@dataclass(frozen=True)
class Row:
    """One line of the metric table: a metric's cells as text, its verdict and whether it is outside its budget
    as fields (:attr:`verdict_text` is what the table shows)."""

    test: str
    suite: str
    metric: str
    baseline: str
    now: str
    change: str
    limit: str
    verdict: Verdict
    change_value: float | None
    failed: bool
    scope: str = ""
    key: str = ""
    """The baseline key the metric was looked up under (a tier's for portable metrics, else the hardware's)."""
    outside_budget: bool = False
    """Whether the figure breaks its ceiling or floor (whatever :attr:`verdict` says)."""

    @property
    def verdict_text(self) -> str:
        """The verdict as the tables show it (:func:`~vramgate.core.checks.verdict_text`)."""
        return verdict_text(self.verdict, self.outside_budget)

    def to_json(self) -> dict[str, Any]:
        """This row as ``report.json`` holds it (the verdict as its text)."""
        return {"test": self.test, "suite": self.suite, "metric": self.metric, "baseline": self.baseline,
                "now": self.now, "change": self.change, "limit": self.limit, "verdict": self.verdict_text,
                "change_value": self.change_value, "failed": self.failed, "scope": self.scope, "key": self.key}


@dataclass(frozen=True)
class MetricRecord:
    """One metric of a test in a report: its figure now, the baseline's, the verdict and how it was reached."""

    name: str
    now: Metric
    verdict: Verdict | None = None
    """None only in report data written by hand without one."""
    failed: bool = False
    baseline: Metric | None = None
    baseline_recorded: dict[str, Any] | None = None
    """When, where and with what the baseline was recorded (:meth:`~vramgate.core.provenance.Provenance.to_json`)."""
    change: float | None = None
    """The relative change against the baseline (an infinite one as a float)."""
    budget: str | None = None
    """Why the figure breaks its ceiling or floor; None within budget."""
    decided_by: str = ""
    untrusted: Untrusted | None = None
    """Why an ``untrusted`` verdict was not judged; None for every other verdict."""

    @property
    def outside_budget(self) -> bool:
        """Whether the figure breaks its ceiling or floor."""
        return bool(self.budget)

    @property
    def verdict_text(self) -> str:
        """The verdict as the tables show it."""
        return verdict_text(self.verdict or "", self.outside_budget)

    def to_json(self) -> dict[str, Any]:
        """This metric as ``report.json`` holds it."""
        change: float | str | None = self.change
        if self.change is not None and not math.isfinite(self.change):
            change = str(self.change)
        return {"name": self.name, "verdict": self.verdict, "failed": self.failed, "now": self.now.to_json(),
                "baseline": self.baseline.to_json() if self.baseline else None,
                "baseline_recorded": self.baseline_recorded, "change": change, "budget": self.budget,
                "decided_by": self.decided_by, "untrusted": self.untrusted}


@dataclass(frozen=True)
class TestRecord:
    """One test of a report: its outcome, its failure message, its table rows and its metrics."""

    nodeid: str
    suite: str
    metrics: list[MetricRecord]
    rows: list[Row] = field(default_factory=list)
    test_passed: bool | None = None
    """Whether the test passed its own assertions; None where the data does not say."""
    failed: bool = False
    """Whether a metric of the test falls short."""
    message: str | None = None
    baseline_file: str = "?"
    version_mismatches: list[str] = field(default_factory=list)
    gpu_conditions: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """This test as ``report.json`` holds it."""
        return {"nodeid": self.nodeid, "suite": self.suite, "test_passed": self.test_passed, "failed": self.failed,
                "message": self.message, "baseline_file": self.baseline_file,
                "version_mismatches": list(self.version_mismatches), "gpu_conditions": list(self.gpu_conditions),
                "rows": [r.to_json() for r in self.rows], "metrics": [m.to_json() for m in self.metrics]}


@dataclass(frozen=True)
class Claim:
    """A claim a test settled (or could not settle) by measurement."""

    test: str
    statement: str
    held: bool
    evidence: str
    source: str = ""
    judged: bool = True
    """False: the claim could not be settled in this run; ``held`` is then False."""

    @property
    def verdict(self) -> str:
        """``held``, ``not held`` or ``not judged``."""
        return "not judged" if not self.judged else "held" if self.held else "not held"

    def to_json(self) -> dict[str, Any]:
        """This claim as ``report.json`` holds it (``judged`` only when it is False)."""
        return {"test": self.test, "statement": self.statement, "held": self.held, "evidence": self.evidence,
                "source": self.source, **({} if self.judged else {"judged": False})}


@dataclass(frozen=True)
class MovedMetric:
    """One stored metric a change moves (Note in :mod:`vramgate.store.moves`), with this run's figure of it."""

    file: str
    test: str
    metric: str
    old: float | None
    new: float | None
    unit: str
    change: str
    now: float | None = None
    """This run's figure; None where it did not run here."""
    matches_new: bool | None = None

    def to_json(self) -> dict[str, Any]:
        """This move as ``report.json`` holds it."""
        return dataclasses.asdict(self)  # its fields, as they are


@dataclass(frozen=True)
class MovedBaselines:
    """The baselines a change moves against a ref."""

    ref: str | None
    metrics: list[MovedMetric]

    def to_json(self) -> dict[str, Any]:
        """These moves as ``report.json`` holds them."""
        return {"ref": self.ref, "metrics": [m.to_json() for m in self.metrics]}


@dataclass(frozen=True)
class Gpu:
    """One GPU of a report's hardware."""

    name: str | None
    """None where the data names none."""
    memory_bytes: Any


@dataclass(frozen=True)
class HardwareFacts:
    """A report's ``hardware``: the fingerprint's data as written, and the facts a renderer shows."""

    data: dict[str, Any]

    def _text(self, name: str) -> str:
        value = self.data.get(name)
        return str(value) if value else ""

    @property
    def key(self) -> str | None:
        """The hardware key; None where the data has none."""
        key = self.data.get("key")
        return key if isinstance(key, str) else None

    @property
    def tier(self) -> str | None:
        """The tier; None where the data has none."""
        tier = self.data.get("tier")
        return None if tier is None else str(tier)

    @property
    def device(self) -> str:
        """``cuda``, ``cpu``, ...; empty where unknown."""
        return self._text("device")

    @property
    def cpu_model(self) -> str:
        """The CPU's model name; empty where unknown."""
        return self._text("cpu_model")

    @property
    def cpu_count(self) -> int:
        """The CPU cores; 0 where unknown."""
        return int(self.data.get("cpu_count") or 0)

    @property
    def memory_bytes(self) -> float | None:
        """The host memory; None where unknown."""
        value = self.data.get("memory_bytes")
        return value if isinstance(value, int | float) and value else None

    @property
    def gpus(self) -> list[Gpu]:
        """The GPUs, in the data's order."""
        return [Gpu(None if g.get("name") is None else str(g["name"]), g.get("memory_bytes", 0))
                for g in self.data.get("gpus") or [] if isinstance(g, dict)]

    @property
    def extra(self) -> dict[str, str]:
        """The architecture, ISA, driver and CUDA version where known."""
        return {k: str(self.data[k]) for k in ("arch", "isa", "driver", "cuda") if self.data.get(k)}

    def fact(self, name: str) -> str:
        """The fact *name* (``cuda``, ``driver``, ...) as text; empty where unknown."""
        return self._text(name)


@dataclass(frozen=True)
class AffectedFacts:
    """``--gate-affected``'s facts as written: the ref, its merge base, why every test ran (or None), how many
    tests were kept and the node ids left out."""

    data: dict[str, Any]

    @property
    def ref(self) -> str | None:
        """The ref the change was compared against."""
        ref = self.data.get("ref")
        return None if ref is None else str(ref)

    @property
    def base(self) -> str:
        """The merge base; ``?`` where unknown."""
        return str(self.data.get("base") or "?")

    @property
    def everything(self) -> str | None:
        """Why every test ran; None where the change left some out."""
        why = self.data.get("everything")
        return str(why) if why else None

    @property
    def kept(self) -> int:
        """How many tests ran."""
        return int(self.data.get("kept", 0))

    @property
    def left_out(self) -> list[str]:
        """The node ids left out."""
        return list(self.data.get("left_out") or [])


@dataclass(frozen=True)
class Report:
    """A gate run's ``report.json``, read (:func:`read_report`); :meth:`to_json` gives the same data back."""

    tests: list[TestRecord]
    hardware: HardwareFacts = field(default_factory=lambda: HardwareFacts({}))
    software: dict[str, Any] = field(default_factory=dict)
    missing_policy: str | None = None
    update: bool | None = None
    accept_args: list[str] = field(default_factory=list)
    version_mismatches: list[str] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    baselines_written: list[str] = field(default_factory=list)
    moved_baselines: MovedBaselines | None = None
    affected: AffectedFacts | None = None
    """``--gate-affected``'s facts (:attr:`vramgate.report.summary.Summary.affected`); None without it."""
    durations: dict[str, float] = field(default_factory=dict)
    profiles: list[str] = field(default_factory=list)
    """The project's profiles (Note [profile verdict] in :mod:`vramgate.core.verdicts`): a row each."""
    judgements: list[Judgement] = field(default_factory=list)
    """What each ``gate_judges`` case found of its profile."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of the data the gate does not write itself (a CI's ``commit`` and ``date``), kept as they are."""

    @property
    def moved(self) -> list[MovedMetric]:
        """The moved baseline metrics; empty without a ref."""
        return self.moved_baselines.metrics if self.moved_baselines else []

    def version(self, name: str) -> str | None:
        """The version of *name* (``vllm``, ``torch``, ...) the run recorded; None where it did not."""
        value = self.software.get(name)
        return str(value) if value else None

    def profile_rows(self) -> list[ProfileRow]:
        """The profile table: one row per profile, a cell per check (empty when no test judged a profile)."""
        return profile_rows(self.profiles, self.judgements) if self.judgements else []

    def rows(self) -> list[Row]:
        """Every test's table rows, test by test."""
        return [r for t in self.tests for r in t.rows]

    def metrics(self) -> Iterator[ReportMetric]:
        """Every metric with its test, in file order."""
        for test in self.tests:
            for record in test.metrics:
                yield ReportMetric(test, record)

    def to_json(self) -> dict[str, Any]:
        """This report as ``report.json`` holds it."""
        return {
            **self.extra,
            "schema": REPORT_FORMAT.current,
            "hardware": self.hardware.data,
            "software": self.software,
            "missing_policy": self.missing_policy,
            "update": self.update,
            "accept_args": list(self.accept_args),
            "version_mismatches": list(self.version_mismatches),
            "tests": [t.to_json() for t in self.tests],
            "claims": [c.to_json() for c in self.claims],
            "baselines_written": list(self.baselines_written),
            "moved_baselines": self.moved_baselines.to_json() if self.moved_baselines else None,
            **({"affected": self.affected.data} if self.affected is not None else {}),
            "durations": dict(self.durations),
            "profiles": list(self.profiles),
            "judgements": [j.to_json() for j in self.judgements],
        }


@dataclass(frozen=True)
class ReportMetric:
    """One metric of a report with its test."""

    test: TestRecord
    record: MetricRecord

    @property
    def nodeid(self) -> str:
        """The test's node id."""
        return self.test.nodeid

    @property
    def suite(self) -> str:
        """The test's suite."""
        return self.test.suite

    @property
    def metric(self) -> Metric:
        """The figure now."""
        return self.record.now


#: The keys of report data :class:`Report` reads into its fields (the others are kept in :attr:`Report.extra`).
_KNOWN = frozenset({"schema", "hardware", "software", "missing_policy", "update", "accept_args",
                    "version_mismatches", "tests", "claims", "baselines_written", "moved_baselines", "affected",
                    "durations", "profiles", "judgements"})


class ReportError(ValueError):
    """Report data that cannot be read, or reports that cannot be merged (unreadable, or from different hardware
    or settings)."""


def check_report(data: Any, source: str, error: Error) -> dict[str, Any]:
    """*data* as the current report.json (an object of a known schema, migrated, with a list of tests); else
    ``error(message)`` naming *source*. The top level's check, the first step of :func:`read_report`."""
    report = REPORT_FORMAT.load(data, source, error)
    if not isinstance(report.get("tests"), list):
        raise error(f"{source}: tests: must be a list")
    return report


class _Reader:
    """The walk of one report's data: every check names *source*."""

    def __init__(self, source: str, error: Error) -> None:
        self.source, self.error = source, error

    def require(self, cond: bool, message: str) -> None:
        if not cond:
            raise self.error(f"{self.source}: {message}")

    def metric(self, where: str, name: str, field_name: str, raw: Any) -> Metric:
        try:
            return parse_metric(Path(self.source), f"{where}: metric {name!r}: {field_name}", name, raw)
        except BaselineError as exc:
            raise self.error(str(exc)) from None

    def entry(self, where: str, j: int, entry: Any) -> MetricRecord:
        self.require(isinstance(entry, dict) and isinstance(entry.get("name"), str) and bool(entry.get("name")),
                     f"{where}: metrics[{j}] has no name")
        name = entry["name"]
        self.require("now" in entry, f"{where}: metric {name!r} has no 'now' figure")
        now = self.metric(where, name, "now", entry["now"])
        verdict = entry.get("verdict")
        self.require(verdict is None or verdict in VERDICTS, f"{where}: metric {name!r}: verdict {verdict!r}")
        base = entry.get("baseline")
        baseline = self.metric(where, name, "baseline", base) if base is not None else None
        change = entry.get("change")
        if isinstance(change, str):  # an infinite change, written as text
            try:
                change = float(change)
            except ValueError:
                change = None
        self.require(change is None or (isinstance(change, int | float) and not isinstance(change, bool)),
                     f"{where}: metric {name!r}: change {change!r}")
        decided = str(entry.get("decided_by") or "")
        untrusted = entry.get("untrusted")
        self.require(untrusted in UNTRUSTED if verdict == "untrusted" else untrusted is None,
                     f"{where}: metric {name!r}: untrusted {untrusted!r} with the verdict {verdict!r}")
        return MetricRecord(name, now, verdict, bool(entry.get("failed", False)), baseline,
                            entry.get("baseline_recorded"), change, entry.get("budget"), decided, untrusted)

    def row(self, where: str, raw: Any, metrics: dict[str, MetricRecord]) -> Row:
        self.require(isinstance(raw, dict) and isinstance(raw.get("metric"), str), f"{where}: a row has no metric")
        m = metrics.get(raw["metric"])
        self.require(m is not None and m.verdict is not None,
                     f"{where}: row {raw['metric']!r} has no metric entry with a verdict")
        assert m is not None and m.verdict is not None
        self.require(raw.get("verdict") == m.verdict_text,
                     f"{where}: row {m.name!r}: verdict {raw.get('verdict')!r} is not its metric's "
                     f"({m.verdict_text!r})")
        value = raw.get("change_value")
        def text(key: str) -> str:
            return str(raw.get(key, ""))

        return Row(test=text("test"), suite=text("suite"), metric=m.name, baseline=text("baseline"), now=text("now"),
                   change=text("change"), limit=text("limit"), verdict=m.verdict, change_value=value,
                   failed=bool(raw.get("failed", False)), scope=text("scope"), key=text("key"),
                   outside_budget=m.outside_budget)

    def test(self, i: int, test: Any, seen: set[tuple[str, str]]) -> TestRecord:
        self.require(isinstance(test, dict), f"tests[{i}]: must be an object")
        nodeid, suite, metrics = test.get("nodeid"), test.get("suite"), test.get("metrics")
        self.require(isinstance(nodeid, str) and bool(nodeid), f"tests[{i}]: missing its nodeid")
        where = f"test {nodeid}"
        self.require(isinstance(suite, str), f"{where}: missing its suite")
        self.require(isinstance(metrics, list), f"{where}: metrics must be a list")
        records = []
        for j, entry in enumerate(metrics):
            record = self.entry(where, j, entry)
            self.require((nodeid, record.name) not in seen, f"{where}: metric {record.name!r} is reported twice")
            seen.add((nodeid, record.name))
            records.append(record)
        by_name = {m.name: m for m in records}
        rows = [self.row(where, r, by_name) for r in test.get("rows") or []]
        passed = test.get("test_passed")
        return TestRecord(nodeid, suite, records, rows, passed if isinstance(passed, bool) else None,
                          bool(test.get("failed", False)), test.get("message"), str(test.get("baseline_file", "?")),
                          list(test.get("version_mismatches") or []), list(test.get("gpu_conditions") or []))

    def claim(self, raw: Any) -> Claim:
        self.require(isinstance(raw, dict) and all(isinstance(raw.get(k), str) for k in ("test", "statement")),
                     "claims: a claim needs its test and statement")
        return Claim(raw["test"], raw["statement"], bool(raw.get("held")), str(raw.get("evidence", "")),
                     str(raw.get("source") or ""), bool(raw.get("judged", True)))

    def judgement(self, raw: Any) -> Judgement:
        try:
            return Judgement.from_json(raw)
        except ValueError as exc:
            raise self.error(f"{self.source}: judgements: {exc}") from None

    def moved(self, raw: Any) -> MovedBaselines | None:
        if raw is None:
            return None
        self.require(isinstance(raw, dict) and isinstance(raw.get("metrics"), list),
                     "moved_baselines: must be an object with a list of metrics")
        out = []
        for m in raw["metrics"]:
            self.require(isinstance(m, dict) and all(k in m for k in ("file", "test", "metric", "unit", "change")),
                         "moved_baselines: a metric needs its file, test, metric, unit and change")
            out.append(MovedMetric(m["file"], m["test"], m["metric"], m.get("old"), m.get("new"), m["unit"],
                                   m["change"], m.get("now"), m.get("matches_new")))
        return MovedBaselines(raw.get("ref"), out)


def read_report(data: Any, source: str, error: Error) -> Report:
    """Report *data* (``report.json`` as loaded) as a :class:`Report`, migrated and checked (:func:`check_report`);
    ``error(message)`` naming *source*, the test and the metric for an entry that is not one (no node id, suite,
    name or ``now`` figure, a figure :func:`parse_metric` refuses, a metric reported twice, a row whose verdict is
    not its metric's). The one reader of a report: every renderer takes its records."""
    if isinstance(data, Report):
        return data
    raw = check_report(data, source, error)
    reader = _Reader(source, error)
    seen: set[tuple[str, str]] = set()
    tests = [reader.test(i, t, seen) for i, t in enumerate(raw["tests"])]
    hardware = raw.get("hardware", {})
    reader.require(isinstance(hardware, dict), "hardware: must be an object")
    software = raw.get("software", {})
    reader.require(isinstance(software, dict), "software: must be an object")
    affected = raw.get("affected")
    return Report(
        tests=tests, hardware=HardwareFacts(hardware), software=software,
        missing_policy=raw.get("missing_policy"), update=raw.get("update"),
        accept_args=list(raw.get("accept_args") or []), version_mismatches=list(raw.get("version_mismatches") or []),
        claims=[reader.claim(c) for c in raw.get("claims") or []],
        baselines_written=list(raw.get("baselines_written") or []),
        moved_baselines=reader.moved(raw.get("moved_baselines")),
        affected=AffectedFacts(affected) if isinstance(affected, dict) else None,
        durations=dict(raw.get("durations") or {}),
        profiles=[str(p) for p in raw.get("profiles") or []],
        judgements=[reader.judgement(j) for j in raw.get("judgements") or []],
        extra={k: v for k, v in raw.items() if k not in _KNOWN},
    )


def as_report(data: Any, source: str = "report") -> Report:
    """*data* as a :class:`Report`: itself when it is one, else read (:func:`read_report`), :class:`ReportError`
    naming *source*. What every renderer takes its report through."""
    return read_report(data, source, ReportError)


def report_metrics(data: Any, source: str, error: Error) -> Iterator[ReportMetric]:
    """Every metric of report *data* (:func:`read_report`), in file order."""
    yield from read_report(data, source, error).metrics()
