"""The metrics of a ``report.json`` as a gate run wrote it, read back and checked: one walk for every reader.

``vramgate report compare``, the dashboard exports and the history's unreviewed points all read the same
file; each needs every test's metrics parsed (the ``now`` figure with :func:`~vramgate.store.baselines.parse_metric`,
the same check as a stored baseline's) and an error that names the file, the test and the metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramgate.core.metrics import Metric
from vramgate.core.records import RecordFormat
from vramgate.store.baselines import BaselineError, parse_metric

#: ``report.json``'s format (Note [versioned records] in :mod:`vramgate.core.records`): what the report layer
#: writes and every reader loads through :func:`check_report`. Schema 1, no earlier one.
REPORT_FORMAT = RecordFormat("report.json", current=1)


@dataclass(frozen=True)
class ReportMetric:
    """One metric of a report: its test (node id, suite, the test's whole entry), its entry and its figure."""

    nodeid: str
    suite: str
    test: dict[str, Any]
    entry: dict[str, Any]
    metric: Metric


def check_report(data: Any, source: str, error: Callable[[str], Exception]) -> dict[str, Any]:
    """*data* as the current report.json (an object of a known schema, migrated, with a list of tests); else
    ``error(message)`` naming *source*. The one check of a report's top level: every reader goes through it."""
    report = REPORT_FORMAT.load(data, source, error)
    if not isinstance(report.get("tests"), list):
        raise error(f"{source}: tests: must be a list")
    return report


def report_metrics(data: Any, source: str, error: Callable[[str], Exception]) -> Iterator[ReportMetric]:
    """Every metric of report *data* (:func:`check_report`), in file order; ``error(message)`` naming *source*,
    the test and the metric for an entry that is not one (no node id, suite, name or ``now`` figure, a figure
    :func:`parse_metric` refuses, a metric reported twice)."""
    def require(cond: bool, message: str) -> None:
        if not cond:
            raise error(f"{source}: {message}")

    seen: set[tuple[str, str]] = set()
    for i, test in enumerate(check_report(data, source, error)["tests"]):
        require(isinstance(test, dict), f"tests[{i}]: must be an object")
        nodeid, suite, metrics = test.get("nodeid"), test.get("suite"), test.get("metrics")
        require(isinstance(nodeid, str) and bool(nodeid), f"tests[{i}]: missing its nodeid")
        where = f"test {nodeid}"
        require(isinstance(suite, str), f"{where}: missing its suite")
        require(isinstance(metrics, list), f"{where}: metrics must be a list")
        for j, entry in enumerate(metrics):
            require(isinstance(entry, dict) and isinstance(entry.get("name"), str) and bool(entry.get("name")),
                    f"{where}: metrics[{j}] has no name")
            name = entry["name"]
            require("now" in entry, f"{where}: metric {name!r} has no 'now' figure")
            require((nodeid, name) not in seen, f"{where}: metric {name!r} is reported twice")
            seen.add((nodeid, name))
            try:
                metric = parse_metric(Path(source), f"{where}: metric {name!r}: now", name, entry["now"])
            except BaselineError as exc:
                raise error(str(exc)) from None
            yield ReportMetric(nodeid, suite, test, entry, metric)
