"""Note [noise guard] and Note [second look] through pytester: a paired check too noisy to detect its tolerance is
``untrusted`` (neither a red nor a green, never a baseline), and a failing paired check's message shows its looks
and the run's noise."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from vramgate.core.stats import detectable_pair_shift, robust_log_spread

HW = ("--gate-hardware", "testkey", "--gate-baselines", "stored", "--gate-report", "out")
NODE = "test_paired.py::test_ratio"

# SIGMA: the per-round noise (lognormal) of both sides; SHIFT: the candidate's slowdown.
TEST_FILE = """
import os
import random


def test_ratio(gate):
    rng = random.Random(int(os.environ.get("SEED", "1")))
    sigma, shift = float(os.environ["SIGMA"]), float(os.environ.get("SHIFT", "0"))
    ref = [0.01 * rng.lognormvariate(0, sigma) for _ in range(30)]
    cand = [0.01 * (1 + shift) * rng.lognormvariate(0, sigma) for _ in range(30)]
    for line, bad in gate.paired_checks("step_ratio", ref, cand, tolerance=0.075, alpha=0.05,
                                        history_tolerance=float(os.environ.get("HTOL", "0.1"))):
        print("CHECK", bad, line)
    gate.record_paired("step_ratio", ref, cand, tolerance=0.075, alpha=0.05,
                       history_tolerance=float(os.environ.get("HTOL", "0.1")),
                       looks=["first look: made up", "second look: made up too"])
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str, **env: str) -> pytest.RunResult:
    from vramgate.machine import speed

    monkeypatch.setattr(speed, "machine_speed_s", lambda: 0.2)  # one machine, however busy (Note [machine speed])
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return pytester.runpytest(*HW, "-p", "no:cacheprovider", "-s", *args)


def _baseline(pytester: pytest.Pytester) -> Path:
    return pytester.path / "stored" / "testkey" / "paired.json"


def _metric(pytester: pytest.Pytester) -> dict[str, object]:
    data = json.loads((pytester.path / "out" / "report.json").read_text())
    (test,) = [t for t in data["tests"] if t["nodeid"] == NODE]
    (metric,) = test["metrics"]
    return dict(metric)


def test_the_detectable_shift_follows_the_noise_and_the_rounds() -> None:
    rng = random.Random(5)

    def sides(sigma: float, n: int) -> tuple[list[float], list[float]]:
        return ([rng.lognormvariate(0, sigma) for _ in range(n)], [rng.lognormvariate(0, sigma) for _ in range(n)])

    quiet = detectable_pair_shift(*sides(0.02, 30), alpha=0.05)
    noisy = detectable_pair_shift(*sides(0.6, 30), alpha=0.05)
    assert 0.002 < quiet < 0.02 < 0.15 < noisy
    # The spread is robust: one wild round moves it little.
    values = [math.exp(0.02 * rng.gauss(0, 1)) for _ in range(30)]
    assert robust_log_spread([*values[:-1], 50.0]) < 2 * robust_log_spread(values)
    # More rounds see smaller shifts; a stricter level needs larger ones.
    many = sides(0.05, 120)
    assert detectable_pair_shift(*many, alpha=0.05) < detectable_pair_shift(many[0][:30], many[1][:30], alpha=0.05)
    assert detectable_pair_shift(*many, alpha=0.01) > detectable_pair_shift(*many, alpha=0.05)
    with pytest.raises(ValueError, match="at least 2 pairs"):
        detectable_pair_shift([1.0], [1.0])


def test_a_paired_check_too_noisy_for_its_tolerance_is_untrusted_and_never_a_baseline(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The example of a check that cannot fail: 30 rounds of lognormal noise at sigma 0.6 on both sides and a 7.5%
    tolerance. It no longer passes: it fails as untrusted, says why, and records nothing even under update."""
    pytester.makepyfile(test_paired=TEST_FILE)
    result = _run(pytester, monkeypatch, "--gate-update", SIGMA="0.6")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "step_ratio untrusted: too noisy to judge" in out
    assert "not judged, neither a red nor a green it could back, and never a baseline" in out
    assert "CHECK True noise: on this run's samples the in-run check detects a shift of" in out
    assert "its tolerance is 7.5%: too noisy to judge" in out
    assert "    first look: made up" in out and "    second look: made up too" in out  # the looks, in the message
    assert not _baseline(pytester).exists()
    metric = _metric(pytester)
    assert metric["verdict"] == "untrusted" and str(metric["decided_by"]).startswith("too noisy to judge: noise:")


def test_a_quiet_run_is_judged_and_recorded_and_its_checks_see_the_stored_baseline(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_paired=TEST_FILE)
    first = _run(pytester, monkeypatch, "--gate-update", SIGMA="0.02")
    first.assert_outcomes(passed=1)
    assert "CHECK False noise:" in first.stdout.str() and _baseline(pytester).exists()
    assert "CHECK False against the baseline: step_ratio" in first.stdout.str()

    # The same engines 20% slower on the candidate side: in-run and history both fail, with the looks and noise.
    slow = _run(pytester, monkeypatch, SIGMA="0.02", SHIFT="0.2", SEED="2")
    slow.assert_outcomes(failed=1)
    out = slow.stdout.str()
    assert "CHECK True against the baseline: step_ratio 1.18" in out and "regressed" in out
    assert "the candidate is worse than its reference in this run" in out
    assert "    first look: made up" in out and "    noise: on this run's samples" in out
    assert _metric(pytester)["verdict"] == "regressed"

    # An unchanged rerun: the checks (and the end of the test) find nothing.
    same = _run(pytester, monkeypatch, SIGMA="0.02", SHIFT="0", SEED="3")
    same.assert_outcomes(passed=1)
    assert "CHECK False against the baseline: step_ratio" in same.stdout.str()
    assert ": ok" in same.stdout.str()


WRITES_FILE = """
def test_ratio(gate):
    ref, cand = [0.01, 0.0101, 0.0099] * 10, [0.0101, 0.01, 0.01] * 10
    print("WRITES", gate.writes_paired_baseline("step_ratio", ref, cand, tolerance=0.075, alpha=0.05,
                                                history_tolerance=0.1))
    gate.record_paired("step_ratio", ref, cand, tolerance=0.075, alpha=0.05, history_tolerance=0.1)
"""


def test_a_paired_test_knows_when_its_rounds_become_the_baseline(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [baselines of two engine pairs]: ``writes_paired_baseline`` says whether the end of the test writes the
    metric as a baseline: under --gate-update, and under --gate-missing record where none is stored."""
    pytester.makepyfile(test_paired=WRITES_FILE)
    assert "WRITES False" in _run(pytester, monkeypatch, "--gate-missing", "skip").stdout.str()
    assert not _baseline(pytester).exists()
    assert "WRITES True" in _run(pytester, monkeypatch, "--gate-missing", "record").stdout.str()
    assert _baseline(pytester).exists()
    assert "WRITES False" in _run(pytester, monkeypatch, "--gate-missing", "record").stdout.str()  # stored now
    assert "WRITES True" in _run(pytester, monkeypatch, "--gate-update").stdout.str()
    assert "WRITES False" in _run(pytester, monkeypatch, "--gate-update", "--gate-update-scope",
                                  "portable").stdout.str()  # a machine-bound ratio is not written then
