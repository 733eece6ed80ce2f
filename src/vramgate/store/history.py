"""History: every accepted value of every stored metric, read from git, and the values gate runs measured between.

Baselines live in git, so their history is the history of ``baselines/``: :func:`baseline_history` reads every
committed version of every baseline file, oldest first, along the first-parent line of a revision (default
``HEAD``): one version per merge into that branch, the merge commit naming it. Each (suite, test, metric,
hardware key) becomes a series of :class:`HistoryPoint`; a version that leaves a value as it was adds no point,
so each point is the first commit that set its value. A version that does not parse is skipped with a warning
naming the commit and the file (:attr:`History.warnings`); the rest of the history stands.

Gate runs on the default branch leave ``report.json`` files with the values measured between two accepted ones;
:func:`report_points` reads them (a point per metric of each test that passed its own assertions, dated by the
report's ``date`` and named by its ``commit`` when it has them, else by the file's modification time and path),
and :func:`merge_history` puts both into one history ordered by date.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from vramgate.core.metrics import Better, Kind
from vramgate.core.records import read_json
from vramgate.machine.hardware import TIER_KEYS
from vramgate.machine.software import GitError, git
from vramgate.store.baselines import BaselineError, parse_baseline
from vramgate.store.report_files import Report, read_report

Source = Literal["baseline", "report"]


class HistoryError(ValueError):
    """History that cannot be read (not a git repository, a file that is not a report); names what and where."""


class SeriesKey(NamedTuple):
    """What one series follows: a metric of a test of a suite, stored under a hardware (or tier) key."""

    suite: str
    test: str
    metric: str
    hardware_key: str


@dataclass(frozen=True)
class HistoryPoint:
    """One value of a series: where it was accepted (``baseline``) or measured (``report``), and with what."""

    commit: str
    """The commit that set it (a baseline) or that the run measured (a report; the report's path if unknown)."""
    date: str
    """When, ISO 8601 in UTC: the commit's date for a baseline, the run's for a report."""
    value: float
    unit: str
    source: Source
    software: dict[str, str]
    """The versions the value was recorded with (python, torch, vLLM ...)."""
    hardware_key: str
    better: Better
    kind: Kind
    file: str = ""
    """The baseline file (its path in the repository) or the report it was read from."""

    def to_json(self) -> dict[str, Any]:
        """This point as plain JSON data."""
        return {"commit": self.commit, "date": self.date, "value": self.value, "unit": self.unit,
                "source": self.source, "software": dict(self.software), "hardware_key": self.hardware_key,
                "better": self.better, "kind": self.kind, "file": self.file}


class History(dict[SeriesKey, list[HistoryPoint]]):
    """Series by key, each oldest first, and the warnings about what could not be read."""

    def __init__(self, series: dict[SeriesKey, list[HistoryPoint]] | None = None,
                 warnings: Iterable[str] = ()) -> None:
        super().__init__(series or {})
        self.warnings: list[str] = list(warnings)


def utc_date(text: str) -> str:
    """An ISO 8601 date and time *text* in UTC, to the second (``2025-01-31T12:00:00Z``); a date without a zone is
    taken as UTC. :class:`ValueError` for text that is not one."""
    moment = _dt.datetime.fromisoformat(text)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.UTC)
    return moment.astimezone(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class _Version:
    commit: str
    date: str
    path: str
    text: str | None
    """The file's content at the commit; None where the commit deleted it."""


def _toplevel(root: Path) -> Path:
    try:
        return Path(git(root, "rev-parse", "--show-toplevel").strip())
    except GitError as exc:
        raise HistoryError(f"{root}: not in a git repository, so baselines have no history here ({exc})") from None


def _versions(top: Path, folder: str, rev: str) -> Iterator[_Version]:
    """Every version of the files under *folder* (relative to the repository's top) along *rev*'s first parents,
    oldest first."""
    try:
        log = git(top, "-c", "core.quotePath=false", "log", "--reverse", "--first-parent",
                  "--diff-merges=first-parent", "--no-renames", "--name-status", "--format=commit %H %cI",
                  rev, "--", folder)
    except GitError as exc:
        raise HistoryError(f"{top}: cannot read the history of {folder} at {rev!r} ({exc})") from None
    commit = date = ""
    for line in log.splitlines():
        if line.startswith("commit "):
            _, commit, stamp = line.split(" ", 2)
            date = utc_date(stamp)
        elif "\t" in line:
            status, path = line.split("\t", 1)
            if status.startswith("D"):
                yield _Version(commit, date, path, None)
            else:
                try:
                    text = git(top, "show", f"{commit}:{path}")
                except GitError as exc:
                    raise HistoryError(f"commit {commit[:12]}: {path}: cannot be read ({exc})") from None
                yield _Version(commit, date, path, text)


def _add(history: History, key: SeriesKey, point: HistoryPoint, *, collapse: bool) -> None:
    series = history.setdefault(key, [])
    if collapse and series and series[-1].value == point.value:
        return  # the same value again: the first commit that set it stands
    series.append(point)


def baseline_history(root: Path, baselines_dir: Path | str = "baselines", *, key: str | None = None,
                     suite: str | None = None, rev: str = "HEAD") -> History:
    """Every accepted value of every metric under *baselines_dir* (relative to *root*, or absolute) in the git
    repository *root* is in, along *rev*'s first parents, oldest first; only hardware key *key* and suite *suite*
    when given. A version that does not parse is skipped with a warning naming the commit and the file."""
    top = _toplevel(root)
    folder = Path(baselines_dir) if Path(baselines_dir).is_absolute() else Path(root) / baselines_dir
    try:
        rel = folder.resolve().relative_to(top.resolve()).as_posix()
    except ValueError:
        raise HistoryError(f"{folder}: not inside the git repository at {top}") from None
    history = History()
    for version in _versions(top, rel, rev):
        parts = Path(version.path).relative_to(rel).parts if rel != "." else Path(version.path).parts
        if len(parts) != 2 or not parts[1].endswith(".json") or version.text is None:
            continue
        hardware_key, name = parts[0], parts[1][: -len(".json")]
        if (key is not None and hardware_key != key) or (suite is not None and name != suite):
            continue
        try:
            baseline = parse_baseline(Path(version.path), version.text)
        except BaselineError as exc:
            history.warnings.append(f"commit {version.commit[:12]} ({version.date}): {exc}; this version skipped")
            continue
        for nodeid, entry in sorted(baseline.tests.items()):
            for metric in sorted(entry.metrics.values(), key=lambda m: m.name):
                point = HistoryPoint(version.commit, version.date, metric.value, metric.unit, "baseline",
                                     dict(entry.recorded.software), hardware_key, metric.better, metric.kind,
                                     version.path)
                _add(history, SeriesKey(baseline.suite, nodeid, metric.name, hardware_key), point, collapse=True)
    return history


def _report_files(paths: Iterable[Path | str]) -> list[Path]:
    files: list[Path] = []
    for given in map(Path, paths):
        if given.is_dir():
            found = sorted(given.rglob("report.json"))
            if not found:
                raise HistoryError(f"{given}: no report.json in this folder or below")
            files.extend(found)
        elif given.is_file():
            files.append(given)
        else:
            raise HistoryError(f"{given}: no such file or folder")
    return files


def _need(cond: bool, file: Path, where: str, message: str) -> None:
    if not cond:
        raise HistoryError(f"{file}: {where}: {message}")


def _report(file: Path) -> Report:
    report = read_report(read_json(file, HistoryError), str(file), HistoryError)
    _need(report.hardware.key is not None, file, "hardware.key", "must be a string")
    return report


def report_points(paths: Iterable[Path | str]) -> History:
    """The metrics gate runs measured, from their ``report.json`` files (or folders, searched for them): one point
    per metric of each test that passed its own assertions, under the key its scope stores it by."""
    history = History()
    for file in _report_files(paths):
        report = _report(file)
        hardware = report.hardware
        tier = hardware.tier or (TIER_KEYS[0] if hardware.device == "cuda" else TIER_KEYS[1])
        key = str(hardware.key)
        given = report.extra  # a CI's commit and date beside the gate's own keys
        commit = given["commit"] if isinstance(given.get("commit"), str) and given["commit"] else str(file)
        try:
            date = utc_date(given["date"]) if isinstance(given.get("date"), str) else utc_date(
                _dt.datetime.fromtimestamp(file.stat().st_mtime, _dt.UTC).isoformat())
        except ValueError as exc:
            raise HistoryError(f"{file}: date: not an ISO 8601 date ({exc})") from None
        software = {k: v for k, v in report.software.items() if isinstance(v, str)}
        for m in report.metrics():
            if m.test.test_passed is False:
                continue  # a test that failed its own assertions is never recorded; its figures are not either
            metric = m.metric
            where_stored = tier if metric.effective_scope == "portable" else key
            point = HistoryPoint(commit, date, metric.value, metric.unit, "report", software, where_stored,
                                 metric.better, metric.kind, str(file))
            _add(history, SeriesKey(m.suite, m.nodeid, metric.name, where_stored), point, collapse=False)
    for series in history.values():
        series.sort(key=lambda p: p.date)
    return history


def merge_history(*histories: History) -> History:
    """One history from several (accepted values and measured ones), each series ordered by date; at the same
    date an accepted value comes first. Their warnings are kept."""
    merged = History(warnings=[w for h in histories for w in h.warnings])
    for history in histories:
        for key, points in history.items():
            merged.setdefault(key, []).extend(points)
    for points in merged.values():
        points.sort(key=lambda p: (p.date, p.source != "baseline"))
    return merged


def select(history: History, selector: str | None = None, *, key: str | None = None) -> History:
    """The series whose test node id, metric name or suite contains *selector* (all when None), under hardware key
    *key* when given."""
    picked = History(warnings=history.warnings)
    for k, points in history.items():
        if key is not None and k.hardware_key != key:
            continue
        if selector and not any(selector in part for part in (k.test, k.metric, k.suite)):
            continue
        picked[k] = points
    return picked


def history_json(series: dict[SeriesKey, list[HistoryPoint]]) -> list[dict[str, Any]]:
    """The series as plain JSON for a page to draw: ``{"suite", "test", "metric", "unit", "hardware_key",
    "points": [{"commit", "date", "value", "source"}]}`` per series, ordered by suite, test, metric and key."""
    return [
        {"suite": k.suite, "test": k.test, "metric": k.metric, "unit": points[-1].unit if points else "",
         "hardware_key": k.hardware_key,
         "points": [{"commit": p.commit, "date": p.date, "value": p.value, "source": p.source} for p in points]}
        for k, points in sorted(series.items())
    ]

