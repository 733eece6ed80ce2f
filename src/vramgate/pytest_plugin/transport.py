"""A gate session's findings as plain JSON, and back: how pytest-xdist workers hand theirs to the controller.

Note [xdist]: under ``pytest -n N`` each worker runs its tests and checks their metrics (and, with
``--gate-update``, writes their baselines: writes are locked and merged, see :mod:`vramgate.store.baselines`). At its
end a worker puts its results into ``workeroutput``; the controller, which runs no test, reads each worker's as
it goes down and writes the one summary and the one report, the same as a serial run's.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from vramgate.core.checks import Finding
from vramgate.core.claims import ClaimVerdict
from vramgate.core.metrics import Metric, Paired
from vramgate.core.provenance import Provenance
from vramgate.store.baselines import parse_metric


def _metric(m: Metric) -> dict[str, Any]:
    """A metric as a worker hands it over: what a baseline stores, and a paired measurement's two sides and looks
    (which a baseline does not keep, and the controller's failure messages and report show)."""
    paired = None if m.paired is None else {**dataclasses.asdict(m.paired), "looks": list(m.paired.looks),
                                            "reference": list(m.paired.reference),
                                            "candidate": list(m.paired.candidate)}
    return {"name": m.name, **m.to_json(), **({"paired": paired} if paired is not None else {})}


def _unmetric(data: dict[str, Any]) -> Metric:
    stored = {k: v for k, v in data.items() if k not in ("name", "paired")}
    metric = parse_metric(Path("<worker>"), data["name"], data["name"], stored)
    paired = data.get("paired")
    if paired is None:
        return metric
    return dataclasses.replace(metric, paired=Paired(
        tuple(paired["reference"]), tuple(paired["candidate"]), paired["tolerance"], paired["alpha"],
        tuple(paired["looks"]), paired["noise_in_looks"]))


def _number(v: float | None) -> Any:
    return v if v is None or math.isfinite(v) else str(v)


def _unnumber(v: Any) -> float | None:
    return float(v) if isinstance(v, str) else v


def finding_json(f: Finding) -> dict[str, Any]:
    """A :class:`~vramgate.core.checks.Finding` as JSON data (non-finite numbers as strings)."""
    return {"metric": _metric(f.metric), "verdict": f.verdict,
            "baseline": _metric(f.baseline) if f.baseline is not None else None,
            "provenance": f.provenance.to_json() if f.provenance else None, "change": _number(f.change),
            "budget": f.budget, "detail": f.detail, "untrusted": f.untrusted}


def finding_from(data: dict[str, Any]) -> Finding:
    """The :class:`~vramgate.core.checks.Finding` that :func:`finding_json` wrote as *data*."""
    prov = data["provenance"]
    return Finding(_unmetric(data["metric"]), data["verdict"],
                   _unmetric(data["baseline"]) if data["baseline"] else None,
                   Provenance.from_json(prov) if prov else None,
                   _unnumber(data["change"]), data["budget"], data["detail"], data.get("untrusted"))


def results_json(results: list[Any], claims: list[tuple[str, ClaimVerdict]], written: list[Path],
                 errors: list[str]) -> dict[str, Any]:
    """A worker's findings (``NodeResult`` objects), claims, written baselines and errors as JSON data."""
    return {
        "results": [{"nodeid": r.nodeid, "suite": r.suite, "test_passed": r.test_passed,
                     "baseline_path": str(r.baseline_path) if r.baseline_path else None,
                     "portable_path": str(r.portable_path) if r.portable_path else None,
                     "mismatches": r.mismatches, "conditions": r.conditions,
                     "findings": [finding_json(f) for f in r.findings]} for r in results],
        "claims": [{"test": nodeid, "statement": c.statement, "held": c.held, "evidence": c.evidence,
                    "source": c.source, "judged": c.judged} for nodeid, c in claims],
        "written": [str(p) for p in written],
        "errors": list(errors),
    }


def results_from(
    data: dict[str, Any], node_result: type
) -> tuple[list[Any], list[tuple[str, ClaimVerdict]], list[Path], list[str]]:
    """The inverse of :func:`results_json`; *node_result* is the plugin's ``NodeResult`` class."""
    results = [node_result(r["nodeid"], r["suite"], [finding_from(f) for f in r["findings"]], r["test_passed"],
                           Path(r["baseline_path"]) if r["baseline_path"] else None, list(r["mismatches"]),
                           conditions=list(r["conditions"]),
                           portable_path=Path(r["portable_path"]) if r["portable_path"] else None)
               for r in data["results"]]
    claims = [(c["test"], ClaimVerdict(c["statement"], c["held"], c["evidence"], c["source"], c.get("judged", True)))
              for c in data["claims"]]
    return results, claims, [Path(p) for p in data["written"]], list(data["errors"])
