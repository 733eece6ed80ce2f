"""``upgrade.json`` as records: what ``vramgate upgrade`` found (its runs, what moved, the serving advice, the
paired latency, each profile's fate), its versioned format and the one reader that turns its data into these
dataclasses; :meth:`Upgrade.to_json` writes them back as the same data.

``vramgate upgrade`` (:mod:`vramgate.tools.upgrade`) builds an :class:`Upgrade` and writes it; ``upgrade.md``
(:func:`vramgate.report.upgrade.upgrade_markdown`) is rendered from the records, never from the data by key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vramgate.core.records import RecordFormat, record_fields
from vramgate.report.compare import ComparedMetric
from vramgate.runtime.engine_env import EngineEnv
from vramgate.store.report_files import ReportError

#: ``upgrade.json``'s format (Note [versioned records] in :mod:`vramgate.core.records`). Schema 1, no earlier one.
UPGRADE_FORMAT = RecordFormat("upgrade.json", current=1)

Error = Callable[[str], Exception]


@dataclass(frozen=True)
class SideRecord:
    """One pytest run of the suites under one engine environment: its outcome and where its files are."""

    label: str
    env: EngineEnv
    folder: str = ""
    status: int = 0
    seconds: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """Each skipped test's reason, by node id."""

    def to_json(self) -> dict[str, Any]:
        """This run as ``upgrade.json`` holds it."""
        return {"label": self.label, "env": self.env.to_json(), "folder": self.folder, "status": self.status,
                "seconds": self.seconds, "outcomes": self.outcomes, "failed": self.failed, "skipped": self.skipped}


@dataclass(frozen=True)
class PairedRow:
    """One metric of the paired latency run: its ratios (new / old per round) and whether it fails."""

    test: str
    metric: str
    median: float | None
    low: float | None
    high: float | None
    rounds: int
    tolerance: float | None
    failed: bool
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        """This row as ``upgrade.json`` holds it."""
        return dataclasses.asdict(self)  # its fields, as they are


@dataclass(frozen=True)
class PairedLatency:
    """The paired latency run of the new version's engine against the old one's."""

    run: SideRecord | None
    rows: list[PairedRow]

    def to_json(self) -> dict[str, Any]:
        """The run as ``upgrade.json`` holds it."""
        return {"run": self.run.to_json() if self.run else None, "rows": [r.to_json() for r in self.rows]}


@dataclass(frozen=True)
class ProfileCheck:
    """A profile checked against one version's sources."""

    status: str
    """``applies``, ``offsets``, ``conflicts`` or ``no-diffs``."""
    in_target: bool = True
    notes: list[str] = field(default_factory=list)
    proposal_files: list[str] | None = None
    """The files of the three-way rebase proposed; None where none was."""

    def to_json(self) -> dict[str, Any]:
        """This check as ``upgrade.json`` holds it."""
        out: dict[str, Any] = {"status": self.status, "in_target": self.in_target, "notes": self.notes}
        if self.proposal_files is not None:
            out["proposal_files"] = self.proposal_files
        return out


@dataclass(frozen=True)
class ProfileRow:
    """One profile's fate on both versions."""

    profile: str
    target: str
    old: ProfileCheck
    new: ProfileCheck

    def to_json(self) -> dict[str, Any]:
        """This row as ``upgrade.json`` holds it."""
        return {"profile": self.profile, "target": self.target, "old": self.old.to_json(), "new": self.new.to_json()}


@dataclass(frozen=True)
class ServingRow:
    """The memory the new version needs to give a serving test the KV cache the old one had."""

    test: str
    old_kv_bytes: float
    new_kv_bytes: float
    old_non_kv_bytes: float
    new_non_kv_bytes: float
    requested_bytes: float
    needed_bytes: float
    factor: float
    """needed / requested: the factor on the team's ``gpu_memory_utilization``."""

    def to_json(self) -> dict[str, Any]:
        """This row as ``upgrade.json`` holds it."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class OneSided:
    """A test whose metrics only one version's run has, and why the other has none."""

    test: str
    metrics: int
    why: str

    def to_json(self) -> dict[str, Any]:
        """This test as ``upgrade.json`` holds it."""
        return dataclasses.asdict(self)  # its fields, as they are


@dataclass(frozen=True)
class Upgrade:
    """What an upgrade run found (``upgrade.json``, read by :func:`read_upgrade`)."""

    from_version: str
    to_version: str
    tier: str
    regressions: int
    runs: list[SideRecord]
    comparison_markdown: str
    comparison: dict[str, Any] = field(default_factory=dict)
    """The comparison's own JSON (:meth:`vramgate.report.compare.Comparison.to_json`), for tools that read it."""
    headline: list[ComparedMetric] = field(default_factory=list)
    serving: list[ServingRow] = field(default_factory=list)
    only_new: list[OneSided] = field(default_factory=list)
    only_old: list[OneSided] = field(default_factory=list)
    unpaired_timings: list[ComparedMetric] = field(default_factory=list)
    paired: PairedLatency | None = None
    """None where the paired run was not asked for."""
    profiles: list[ProfileRow] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """This upgrade as ``upgrade.json`` holds it."""
        return {
            "schema": UPGRADE_FORMAT.current, "from": self.from_version, "to": self.to_version, "tier": self.tier,
            "runs": [r.to_json() for r in self.runs], "comparison": self.comparison,
            "comparison_markdown": self.comparison_markdown, "paired": self.paired.to_json() if self.paired else {},
            "profiles": [p.to_json() for p in self.profiles], "headline": [r.to_json() for r in self.headline],
            "serving": [r.to_json() for r in self.serving], "only_new": [t.to_json() for t in self.only_new],
            "only_old": [t.to_json() for t in self.only_old], "regressions": self.regressions,
            "unpaired_timings": [r.to_json() for r in self.unpaired_timings], "seconds": self.seconds,
        }


def _env(data: Any, where: str, error: Error) -> EngineEnv:
    if not isinstance(data, dict):
        raise error(f"{where}: must be an object")
    return EngineEnv(python=str(data.get("python", "")), python_version=str(data.get("python_version", "")),
                     vllm=data.get("vllm"), vllm_distribution=data.get("vllm_distribution"),
                     vllm_package=data.get("vllm_package"), torch=data.get("torch"))


def _side(data: Any, where: str, error: Error) -> SideRecord:
    fields = record_fields(SideRecord, data, where, error)
    return SideRecord(**{**fields, "env": _env(fields["env"], f"{where}: env", error)})


def _profile(data: Any, where: str, error: Error) -> ProfileRow:
    fields = record_fields(ProfileRow, data, where, error)
    return ProfileRow(**{**fields, **{side: ProfileCheck(**record_fields(ProfileCheck, fields[side], f"{where}: {side}",
                                                                         error)) for side in ("old", "new")}})


def _compared(data: Any, where: str, error: Error) -> ComparedMetric:
    fields = record_fields(ComparedMetric, data, where, error)
    if isinstance(fields.get("change"), str):  # an infinite change, written as text
        fields["change"] = float(fields["change"])
    return ComparedMetric(**fields)


def read_upgrade(data: Any, source: str = "upgrade.json", error: Error = ReportError) -> Upgrade:
    """*data* (``upgrade.json`` as loaded, or an :class:`Upgrade`) as an :class:`Upgrade`, migrated and checked;
    ``error(message)`` naming *source* and the part that is not one."""
    if isinstance(data, Upgrade):
        return data
    raw = UPGRADE_FORMAT.load(data, source, error)
    for key in ("from", "to", "tier", "regressions", "runs", "comparison_markdown"):
        if key not in raw:
            raise error(f"{source}: missing {key!r}")

    def items(key: str) -> list[Any]:
        value = raw.get(key) or []
        if not isinstance(value, list):
            raise error(f"{source}: {key}: must be a list")
        return value

    paired = raw.get("paired") or {}
    if not isinstance(paired, dict):
        raise error(f"{source}: paired: must be an object")
    return Upgrade(
        from_version=str(raw["from"]), to_version=str(raw["to"]), tier=str(raw["tier"]),
        regressions=int(raw["regressions"]),
        runs=[_side(r, f"{source}: runs[{i}]", error) for i, r in enumerate(items("runs"))],
        comparison_markdown=str(raw["comparison_markdown"]), comparison=dict(raw.get("comparison") or {}),
        headline=[_compared(r, f"{source}: headline[{i}]", error) for i, r in enumerate(items("headline"))],
        serving=[ServingRow(**record_fields(ServingRow, r, f"{source}: serving[{i}]", error))
                 for i, r in enumerate(items("serving"))],
        only_new=[OneSided(**record_fields(OneSided, t, f"{source}: only_new[{i}]", error))
                  for i, t in enumerate(items("only_new"))],
        only_old=[OneSided(**record_fields(OneSided, t, f"{source}: only_old[{i}]", error))
                  for i, t in enumerate(items("only_old"))],
        unpaired_timings=[_compared(r, f"{source}: unpaired_timings[{i}]", error)
                          for i, r in enumerate(items("unpaired_timings"))],
        paired=PairedLatency(
            _side(paired["run"], f"{source}: paired: run", error) if paired.get("run") else None,
            [PairedRow(**record_fields(PairedRow, r, f"{source}: paired: rows[{i}]", error))
             for i, r in enumerate(paired.get("rows") or [])]) if paired else None,
        profiles=[_profile(p, f"{source}: profiles[{i}]", error) for i, p in enumerate(items("profiles"))],
        seconds=float(raw.get("seconds", 0.0)),
    )
