"""Baselines: ``<root>/<hardware key>/<suite>.json``.

One readable JSON file per hardware key and suite, with sorted keys and a
stable layout so that a reviewed update is a small diff. Layout (schema 1)::

    {
      "schema": 1,
      "suite": "kv_cache",
      "hardware": {... fingerprint of the machine that last wrote the file ...},
      "tests": {
        "<node id>": {
          "metrics": {"<name>": {"value": ..., "unit": ..., "kind": ..., "better": ...,
                                 "tolerance": ..., "scope": ..., ["ceiling", "floor", "samples"]}},
          "recorded": {"commit": ..., "date": ..., "software": {...}}
        }
      }
    }

``<hardware key>`` is a machine's key for machine-bound metrics, or a tier's
key (``cpu``, ``cuda``) for portable ones (Note [metric scope] in
:mod:`vramgate.core.metrics`); a test's metrics may be split over both files.

Each test carries its own provenance, because ``--gate-update`` may refresh
one test of a suite and leave the others as they were reviewed.

Writes are atomic (a temporary file in the same folder, then ``os.replace``:
:mod:`vramgate.store.files`) and serialized by an advisory lock, so two gate runs updating the same file
never leave a torn or half-merged file, and a write that fails (a full disk)
leaves the previous file as it was and no temporary file behind. A file that
cannot be parsed is never overwritten: the run stops with an error naming the
file and the field, and the file stays for a person to repair or delete.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vramgate.core.kinds import kind_names, kind_rule
from vramgate.core.leak import LeakFit
from vramgate.core.metrics import BETTER, SCOPES, UNITS, Metric
from vramgate.core.provenance import Provenance
from vramgate.core.records import RecordFormat
from vramgate.store.files import atomic_write_text, locked

#: The baseline file's format (Note [versioned records] in :mod:`vramgate.core.records`): schema 1, no earlier one.
BASELINE_FORMAT = RecordFormat("baseline file", current=1)
SCHEMA_VERSION = BASELINE_FORMAT.current


class BaselineError(Exception):
    """A baseline file that cannot be used; the message names the file and the field."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


@dataclass
class NodeBaseline:
    """The stored metrics of one test, with their provenance."""

    metrics: dict[str, Metric]
    recorded: Provenance

    def to_json(self) -> dict[str, Any]:
        """This test's baseline as the file stores it: metrics by name and where they were recorded."""
        return {
            "metrics": {name: m.to_json() for name, m in sorted(self.metrics.items())},
            "recorded": self.recorded.to_json(),
        }


@dataclass
class BaselineFile:
    """The parsed content of one baseline file."""

    path: Path
    suite: str
    hardware: dict[str, Any]
    tests: dict[str, NodeBaseline] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The whole baseline file as JSON data: schema, suite, hardware and tests by node id."""
        return {
            "schema": SCHEMA_VERSION,
            "suite": self.suite,
            "hardware": self.hardware,
            "tests": {nodeid: t.to_json() for nodeid, t in sorted(self.tests.items())},
        }


def _require(cond: bool, path: Path, where: str, message: str) -> None:
    if not cond:
        raise BaselineError(path, f"{where}: {message}")


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def parse_metric(path: Path, where: str, name: str, raw: object) -> Metric:
    """One stored metric (its JSON object *raw*) validated; :class:`BaselineError` names *path* and *where*."""
    _require(isinstance(raw, dict), path, where, "must be an object")
    assert isinstance(raw, dict)
    for key in ("value", "unit", "kind", "better"):
        _require(key in raw, path, where, f"missing field {key!r}")
    _require(_is_number(raw["value"]), path, f"{where}.value", f"must be a finite number, got {raw['value']!r}")
    _require(raw["unit"] in UNITS, path, f"{where}.unit", f"unknown unit {raw['unit']!r}")
    _require(raw["kind"] in kind_names(), path, f"{where}.kind", f"must be one of {kind_names()}, got {raw['kind']!r}")
    _require(raw["better"] in BETTER, path, f"{where}.better", f"must be one of {BETTER}, got {raw['better']!r}")
    scope = raw.get("scope")
    _require(scope is None or scope in SCOPES, path, f"{where}.scope", f"must be one of {SCOPES}, got {scope!r}")
    for key in ("tolerance", "ceiling", "floor"):
        if raw.get(key) is not None:
            _require(_is_number(raw[key]), path, f"{where}.{key}", f"must be a finite number, got {raw[key]!r}")
    samples = raw.get("samples", [])
    _require(
        isinstance(samples, list) and all(_is_number(s) for s in samples),
        path, f"{where}.samples", "must be a list of finite numbers",
    )
    history = raw.get("history", True)
    _require(isinstance(history, bool), path, f"{where}.history", f"must be true or false, got {history!r}")
    if kind_rule(raw["kind"]).needs_samples:
        _require(bool(samples), path, f"{where}.samples", f"a {raw['kind']} metric needs its samples")
    try:
        fit = LeakFit.from_json(raw["fit"], f"{where}.fit") if raw.get("fit") is not None else None
    except ValueError as exc:
        raise BaselineError(path, str(exc)) from None
    try:
        return Metric(
            name=name,
            value=raw["value"],
            unit=raw["unit"],
            kind=raw["kind"],
            better=raw["better"],
            tolerance=raw.get("tolerance"),
            ceiling=raw.get("ceiling"),
            floor=raw.get("floor"),
            samples=[float(s) for s in samples],
            history=history,
            scope=scope,
            fit=fit,
        )
    except (TypeError, ValueError) as exc:
        raise BaselineError(path, f"{where}: {exc}") from None


def parse_baseline(path: Path, text: str) -> BaselineFile:
    """Parse and validate the text of a baseline file; :class:`BaselineError` if unusable."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BaselineError(path, f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    data: Any = BASELINE_FORMAT.load(raw, "", lambda message: BaselineError(path, message.removeprefix(": ")))
    suite = data.get("suite")
    _require(isinstance(suite, str) and bool(suite), path, "suite", "must be a non-empty string")
    _require(suite == path.stem, path, "suite", f"is {suite!r} but the file is named {path.name!r}")
    hardware = data.get("hardware", {})
    _require(isinstance(hardware, dict), path, "hardware", "must be an object")
    tests_raw = data.get("tests")
    _require(isinstance(tests_raw, dict), path, "tests", "must be an object keyed by test node id")
    tests: dict[str, NodeBaseline] = {}
    for nodeid, entry in tests_raw.items():
        where = f"tests[{nodeid!r}]"
        _require(isinstance(entry, dict), path, where, "must be an object")
        metrics_raw = entry.get("metrics")
        _require(isinstance(metrics_raw, dict), path, f"{where}.metrics", "must be an object")
        rec = entry.get("recorded")
        _require(isinstance(rec, dict), path, f"{where}.recorded", "must be an object")
        _require(isinstance(rec.get("date"), str), path, f"{where}.recorded.date", "must be a string")
        software = rec.get("software", {})
        _require(
            isinstance(software, dict) and all(isinstance(v, str) for v in software.values()),
            path, f"{where}.recorded.software", "must map names to version strings",
        )
        commit = rec.get("commit")
        _require(commit is None or isinstance(commit, str), path, f"{where}.recorded.commit", "must be a string")
        speed = rec.get("machine_speed_s")
        _require(speed is None or (isinstance(speed, int | float) and not isinstance(speed, bool) and speed > 0),
                 path, f"{where}.recorded.machine_speed_s", "must be a positive number of seconds")
        computed_on = rec.get("computed_on")
        _require(computed_on is None or isinstance(computed_on, str), path, f"{where}.recorded.computed_on",
                 "must be a string")
        tests[nodeid] = NodeBaseline(
            metrics={
                name: parse_metric(path, f"{where}.metrics[{name!r}]", name, raw)
                for name, raw in metrics_raw.items()
            },
            recorded=Provenance(commit=commit, date=rec["date"], software=software,
                                machine_speed_s=None if speed is None else float(speed), computed_on=computed_on),
        )
    return BaselineFile(path=path, suite=suite, hardware=hardware, tests=tests)


def dump_baseline(baseline: BaselineFile) -> str:
    """The stable text of *baseline*: two-space indent, sorted keys, final newline."""
    return json.dumps(baseline.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


class BaselineStorage(Protocol):
    """Where baselines live. The plugin talks to storage only through this."""

    def load(self, key: str, suite: str) -> BaselineFile | None:
        """The baseline of *suite* on hardware *key*, or None when there is none."""

    def update(self, key: str, suite: str, hardware: dict[str, Any], tests: dict[str, NodeBaseline]) -> Path:
        """Merge *tests* into the stored baseline (replacing those node ids) and save it."""

    def validate_all(self) -> list[Path]:
        """Parse every stored baseline; raise :class:`BaselineError` on the first bad one."""


class DirectoryStorage:
    """Baselines as JSON files under a folder (the default storage)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[Path, BaselineFile | None] = {}

    def path_for(self, key: str, suite: str) -> Path:
        """The file of *suite*'s baseline on hardware *key*: ``<root>/<key>/<suite>.json``."""
        return self.root / key / f"{suite}.json"

    def _read(self, path: Path) -> BaselineFile | None:
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise BaselineError(path, f"cannot be read: {exc}") from None
        return parse_baseline(path, text)

    def load(self, key: str, suite: str) -> BaselineFile | None:
        """The baseline of *suite* on hardware *key* (read once, then cached), or None when there is none."""
        path = self.path_for(key, suite)
        if path not in self._cache:
            self._cache[path] = self._read(path)
        return self._cache[path]

    def update(self, key: str, suite: str, hardware: dict[str, Any], tests: dict[str, NodeBaseline]) -> Path:
        """Merge *tests* into the stored baseline under a lock (dropping tests left without metrics) and write it
        atomically; returns its path."""
        path = self.path_for(key, suite)
        with locked(path.parent / f".{suite}.lock"):
            current = self._read(path) or BaselineFile(path=path, suite=suite, hardware=hardware)
            current.hardware = hardware
            current.tests.update(tests)
            for nodeid in [n for n, t in current.tests.items() if not t.metrics]:
                del current.tests[nodeid]  # a test with no metric of this file's scope any more
            atomic_write_text(path, dump_baseline(current))
        self._cache[path] = current
        return path

    def validate_all(self) -> list[Path]:
        """Parse every stored baseline and return their paths; :class:`BaselineError` on the first bad one."""
        if not self.root.is_dir():
            return []
        paths = sorted(p for p in self.root.glob("*/*.json") if p.is_file())
        for path in paths:
            self._cache[path] = self._read(path)
        return paths


def combine_shards(root: Path, shards: Sequence[Path]) -> list[str]:
    """Merge into the baselines folder *root* what each shard of a sharded ``--gate-update`` re-recorded into its
    own copy of *root* (a shard folder holds ``<key>/<suite>.json`` as *root* does); a line per file and shard
    saying how many tests it took.

    The shards partition the node ids and a suite's file holds tests of every shard, so no shard's copy may replace
    a whole file: a test is taken from the shard whose copy changed or dropped it, and merged in by node id through
    :meth:`DirectoryStorage.update`, as a ``--gate-update`` run merges its own tests. :class:`BaselineError` naming
    the file and the test when two shards changed the same one."""
    storage = DirectoryStorage(root)
    files = [(shard, path.relative_to(shard)) for shard in shards for path in sorted(shard.glob("*/*.json"))]
    base = {name: storage._read(root / name) for _, name in files}  # every shard's copy began as these
    taken: dict[tuple[Path, str], str] = {}
    changes = []
    for shard, name in files:  # every change found, and every conflict refused, before anything is written
        new, old = storage._read(shard / name), base[name]
        if new is None:
            continue
        before = old.tests if old else {}
        moved = {n: t for n, t in new.tests.items() if n not in before or before[n].to_json() != t.to_json()}
        moved |= {n: NodeBaseline({}, t.recorded) for n, t in before.items() if n not in new.tests}
        for nodeid in moved:
            other = taken.setdefault((name, nodeid), shard.name)
            if other != shard.name:
                raise BaselineError(root / name, f"{nodeid} re-recorded by both {other} and {shard.name}")
        if moved:
            changes.append((shard, name, new.hardware, moved))
    lines = []
    for shard, name, hardware, moved in changes:
        storage.update(name.parent.name, name.stem, hardware, moved)
        lines.append(f"{name}: {len(moved)} test(s) from {shard.name}")
    return lines
