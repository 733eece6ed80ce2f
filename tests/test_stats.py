"""The measured-metric rule: exact U distribution, false alarms and power by simulation."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from vramgate.core.stats import DEFAULT_SAMPLES, compare_samples, mann_whitney_greater


def brute_force_p(x: list[float], y: list[float]) -> float:
    """P(U >= u_obs) under H0 by enumerating every split of the pooled values."""
    pooled = x + y
    u_obs = sum(1 for a in x for b in y if a > b) + 0.5 * sum(1 for a in x for b in y if a == b)
    hits = total = 0
    for idx in combinations(range(len(pooled)), len(x)):
        xs = [pooled[i] for i in idx]
        ys = [pooled[i] for i in range(len(pooled)) if i not in idx]
        u = sum(1 for a in xs for b in ys if a > b) + 0.5 * sum(1 for a in xs for b in ys if a == b)
        hits += u >= u_obs - 1e-12
        total += 1
    return hits / total


@pytest.mark.parametrize("seed", range(5))
def test_exact_p_matches_enumeration(seed: int) -> None:
    rng = random.Random(seed)
    x = [rng.gauss(0.3, 1) for _ in range(5)]
    y = [rng.gauss(0, 1) for _ in range(6)]
    assert mann_whitney_greater(x, y) == pytest.approx(brute_force_p(x, y), abs=1e-12)


def test_complete_separation() -> None:
    assert mann_whitney_greater([4, 5, 6], [1, 2, 3]) == pytest.approx(1 / 20)
    assert mann_whitney_greater([1, 2, 3], [4, 5, 6]) == pytest.approx(1.0)


def test_ties_use_the_normal_approximation() -> None:
    p = mann_whitney_greater([2, 2, 3, 3, 3], [1, 1, 2, 2, 2])
    assert 0.0 < p < 0.05


def draw(rng: random.Random, scale: float, cv: float, n: int) -> list[float]:
    return [scale * rng.lognormvariate(0.0, cv) for _ in range(n)]


NOISE_CV = 0.05
"""Coefficient of variation of the simulated samples: at the high end of what GPU timers show."""


def test_false_alarm_rate_on_unchanged_distributions() -> None:
    rng = random.Random(20261129)
    trials = 200
    alarms = sum(
        compare_samples(
            draw(rng, 1.0, NOISE_CV, DEFAULT_SAMPLES), draw(rng, 1.0, NOISE_CV, DEFAULT_SAMPLES),
            better="lower", tolerance=0.05,
        ).regressed
        for _ in range(trials)
    )
    assert alarms / trials <= 0.01, f"{alarms} false alarms in {trials} unchanged comparisons"


def test_power_for_a_ten_percent_shift() -> None:
    rng = random.Random(7)
    trials = 200
    detected = sum(
        compare_samples(
            draw(rng, 1.0, NOISE_CV, DEFAULT_SAMPLES), draw(rng, 1.10, NOISE_CV, DEFAULT_SAMPLES),
            better="lower", tolerance=0.05,
        ).regressed
        for _ in range(trials)
    )
    assert detected / trials >= 0.95, f"detected {detected} of {trials} 10% shifts"


def test_direction_of_higher_is_better() -> None:
    rng = random.Random(3)
    base = draw(rng, 100.0, 0.02, 10)
    lower = draw(rng, 80.0, 0.02, 10)
    result = compare_samples(base, lower, better="higher", tolerance=0.05)
    assert result.regressed and not result.improved and result.change < -0.15
    result = compare_samples(base, lower, better="lower", tolerance=0.05)
    assert result.improved and not result.regressed


def test_a_clear_but_small_shift_is_within_tolerance() -> None:
    base = [1.00 + i * 1e-4 for i in range(10)]
    cand = [1.02 + i * 1e-4 for i in range(10)]
    result = compare_samples(base, cand, better="lower", tolerance=0.05)
    assert result.p_worse < 1e-4 and not result.regressed
