"""Metric kinds as rule objects (Note [metric kinds] in vramgate.core.kinds): a new kind is one class and one
registration, and the session, ``report compare`` and the report ask it."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from vramgate.core import kinds
from vramgate.core.kinds import Judgement, MetricKind, kind_rule
from vramgate.core.numbers import Better


class AbsoluteKind(MetricKind):
    """A toy kind: a figure judged by its absolute difference from the baseline (tolerance in its own unit)."""

    name = "absolute"
    default_scope = "portable"
    default_tolerance = 2.0

    def judge(self, value: float, samples: Sequence[float], base_value: float, base_samples: Sequence[float],
              *, better: Better, tolerance: float, alpha: float) -> tuple[Judgement, float, str]:
        worse = (value - base_value) if better == "lower" else (base_value - value)
        how = f"absolute, {better} is better, tolerance {tolerance:g} units"
        change = value - base_value
        verdict: Judgement = "regressed" if worse > tolerance else "improved" if worse < -tolerance else "ok"
        return verdict, change, how

    def changed(self, verdict: str, change: float | None) -> bool:
        return verdict != "ok" or bool(change)


TEST = """
import os

def test_toy(gate):
    gate.record("queue_depth", float(os.environ.get("DEPTH", "10")), unit="count", kind="absolute")
"""


def test_a_new_kind_is_one_class_and_one_registration(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """The toy kind runs through the session (judged, stored, failing past its tolerance), ``report compare`` (its
    own rule of what changed) and the report (rendered with its rule's words)."""
    from vramgate.report import markdown
    from vramgate.report.compare import compare_reports

    monkeypatch.setitem(kinds._KINDS, "absolute", AbsoluteKind())
    assert kind_rule("absolute").default_tolerance == 2.0
    pytester.makepyfile(test_toy=TEST)
    args = ["--gate-hardware", "toy-hw", "-p", "no:cacheprovider"]
    pytester.runpytest(*args, "--gate-update").assert_outcomes(passed=1)
    stored = json.loads((pytester.path / "baselines" / "cpu" / "toy.json").read_text())
    entry = stored["tests"]["test_toy.py::test_toy"]["metrics"]["queue_depth"]
    assert (entry["kind"], entry["tolerance"], entry["scope"]) == ("absolute", 2.0, "portable")
    monkeypatch.setenv("DEPTH", "11.5")  # within 2 units: ok
    pytester.runpytest(*args, "--gate-report", "ok").assert_outcomes(passed=1)
    monkeypatch.setenv("DEPTH", "13")  # 3 units worse: regressed by the kind's own rule
    result = pytester.runpytest(*args, "--gate-report", "bad")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*queue_depth*regressed (absolute, lower is better, tolerance 2 units)*"])
    first = json.loads((pytester.path / "ok" / "report.json").read_text())
    second = json.loads((pytester.path / "bad" / "report.json").read_text())
    comparison = compare_reports(first, second)
    (row,) = comparison.rows
    assert row.kind == "absolute" and row.changed
    assert "queue_depth" in markdown(second, None)


def test_an_unknown_kind_is_refused_naming_the_known_ones() -> None:
    from vramgate.core.metrics import Metric

    with pytest.raises(ValueError, match="kind 'fuzzy' is not one of exact, measured"):
        Metric("m", 1, "B", kind="fuzzy")
    with pytest.raises(ValueError, match="already registered"):
        kinds.register_kind(type("Other", (kinds.ExactKind,), {})())
