"""The memory slope's fit and its bound (Note [leak fit] in vramgate.core.leak), and how a slope metric is judged."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from vramgate.core.checks import check_budget, leak_detail
from vramgate.core.leak import ALPHA, LeakFit, fit_leak, t_quantile
from vramgate.core.metrics import Metric
from vramgate.matrix.loader import MatrixError, parse_budget
from vramgate.report import html_page
from vramgate.store.baselines import BaselineError, parse_metric


@pytest.mark.parametrize(("p", "df", "exact"), [(0.999, 6, 5.2076), (0.99, 6, 3.1427), (0.95, 10, 1.8125),
                                                (0.999, 14, 3.7874), (0.975, 4, 2.7764)])
def test_t_quantile_matches_the_tables(p: float, df: int, exact: float) -> None:
    assert t_quantile(p, df) == pytest.approx(exact, rel=0.004)


def _load(slope: float, *, n: int = 400, noise: float = 0.0, steps: tuple[tuple[int, float], ...] = (),
          seed: int = 0) -> list[tuple[float, float]]:
    """A load's samples: 5 per completed request, memory at 1 GiB plus *slope* per request, Gaussian noise, and
    *steps* (at request, bytes) that stay."""
    rng = random.Random(seed)
    out = []
    for k in range(5 * n):
        x = k / 5
        y = (1 << 30) + slope * x + rng.gauss(0, noise) + sum(b for at, b in steps if x >= at)
        out.append((float(int(x)), y))
    return out


def test_an_exact_line_is_recovered_with_a_tight_bound() -> None:
    fit = fit_leak(_load(64 * 1024))
    assert fit.slope == pytest.approx(64 * 1024, rel=1e-3)
    assert fit.lower == pytest.approx(64 * 1024, rel=1e-2)
    assert fit.shows_leak(16 * 1024) and not fit.shows_leak(80 * 1024)
    assert fit.df == 10 and len(fit.levels) == 12 and fit.span == 399


def test_a_step_in_the_middle_widens_the_bound_instead_of_failing() -> None:
    """An allocator's step of 8 MiB in the middle of 400 requests reads as 20 KiB per request by least squares; the
    levels' scatter around the line widens the bound, so the run does not show a leak of 16 KiB."""
    fit = fit_leak(_load(0.0, noise=256 * 1024, steps=((200, 8 << 20),)))
    assert fit.slope > 16 * 1024
    assert not fit.shows_leak(16 * 1024)
    assert fit.floor(16 * 1024) > fit.slope


def test_false_alarms_and_detections_under_level_noise() -> None:
    """With independent noise, an unchanged server's lower bound crosses the allowance at about ALPHA, and a leak
    at the floor (at the slopes' true spread) is caught at about 95%."""
    allowance, trials = 8 * 1024, 1500
    alarms = sum(fit_leak(_load(allowance, noise=2 << 20, n=80, seed=s)).shows_leak(allowance) for s in range(trials))
    assert alarms / trials < 4 * ALPHA
    fits = [fit_leak(_load(allowance, noise=2 << 20, n=80, seed=s)) for s in range(400)]
    true_se = statistics.stdev(f.slope for f in fits)
    per_se = (fits[0].floor(allowance) - allowance) / fits[0].stderr  # the floor's distance, in standard errors
    floor = allowance + per_se * true_se
    caught = sum(fit_leak(_load(floor, noise=2 << 20, n=80, seed=s)).shows_leak(allowance) for s in range(400))
    assert 0.88 < caught / 400 < 1.0


def test_too_few_samples_or_levels_say_so() -> None:
    with pytest.raises(ValueError, match="at least 24 samples"):
        fit_leak([(float(i), 1.0) for i in range(10)])
    bursts = [(0.0, 1.0)] * 20 + [(100.0, 2.0)] * 20
    with pytest.raises(ValueError, match="at least 8 of its 12 spans"):
        fit_leak(bursts)
    with pytest.raises(ValueError, match="per request or per token"):
        fit_leak(_load(0), per="step")


def test_the_fit_round_trips_and_a_malformed_one_is_named() -> None:
    fit = fit_leak(_load(4096, noise=1e5), per="token", warmup=_load(0, n=40))
    again = LeakFit.from_json(fit.to_json())
    assert again == fit and len(again.samples) <= 240 and again.warmup
    with pytest.raises(ValueError, match=r"report\.fit: not a memory slope's fit"):
        LeakFit.from_json({"per": "request"}, "report.fit")
    bad = {**fit.to_json(), "per": "step"}
    with pytest.raises(ValueError, match="per 'step'"):
        LeakFit.from_json(bad)


def _slope_metric(fit: LeakFit, ceiling: float) -> Metric:
    return Metric("memory_slope", round(fit.slope * 1000), "B/1k requests", ceiling=ceiling, history=False,
                  scope="machine", fit=fit)


def test_the_budget_holds_the_bound_not_the_slope() -> None:
    ceiling = 32 << 20  # 32 KiB per request
    leak = _slope_metric(fit_leak(_load(64 * 1024, noise=1 << 20)), ceiling)
    message = check_budget(leak)
    assert message is not None and "99.9% lower bound" in message and "above its ceiling 32.00 MiB" in message
    assert "or more with 95% detection" in message
    noisy = _slope_metric(fit_leak(_load(0.0, noise=256 * 1024, steps=((200, 16 << 20),))), ceiling)
    assert noisy.value > ceiling and check_budget(noisy) is None  # the slope is above, the bound is not
    detail = leak_detail(noisy)
    assert "lower bound" in detail and "this run's floor" in detail and "over 399 requests (12 levels)" in detail
    assert leak_detail(Metric("x", 1.0, "B")) == ""


def test_a_slope_metric_with_its_fit_round_trips_through_a_worker() -> None:
    metric = _slope_metric(fit_leak(_load(1024, noise=1e5)), 32 << 20)
    again = parse_metric(Path("<worker>"), "m", "memory_slope", metric.to_json())
    assert again.fit == metric.fit and again.ceiling == metric.ceiling
    raw = {**metric.to_json(), "fit": {"per": "request", "slope": "x"}}
    with pytest.raises(BaselineError, match=r"m\.fit: not a memory slope's fit"):
        parse_metric(Path("report.json"), "m", "memory_slope", raw)


def test_slope_budgets_say_what_they_are_per() -> None:
    assert parse_budget("m.toml", "entries[0].budgets", "memory_slope_per_token",
                        "<= 512 KiB per 1000 tokens").unit == "B/1k tokens"
    assert parse_budget("m.toml", "entries[0].budgets", "memory_slope", "<= 16 MiB per 1000 requests").value == 16 << 20
    with pytest.raises(MatrixError, match="per 1000 requests, not per 1000 tokens"):
        parse_budget("m.toml", "entries[0].budgets", "memory_slope", "<= 16 MiB per 1000 tokens")


SLOPE_TEST = """
import os, random
from vramgate.core.leak import fit_leak

def test_memory(gate):
    leak = float(os.environ["LEAK"])
    rng = random.Random(1)
    points = [(k / 5, (1 << 30) + leak * (k / 5) + rng.gauss(0, 1 << 20)) for k in range(2000)]
    fit = fit_leak(points, warmup=[(0.0, 900e6), (10.0, 1e9)])
    gate.record("memory_slope", round(fit.slope * 1000), unit="B/1k requests", ceiling=16 << 20, scope="machine",
                history=False, fit=fit)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_a_leak_fails_with_its_bound_and_floor_and_the_page_draws_its_samples(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: list[str]) -> None:
    """A leak of 64 KiB per request over an allowance of 16: the terminal says the slope, its bound and the run's
    floor; the report's page draws the samples, the levels, the fit and the allowance (through an xdist worker
    too). Without the leak the same test passes and says its floor."""
    pytester.makepyfile(test_mem=SLOPE_TEST)
    monkeypatch.setenv("LEAK", str(64 * 1024))
    result = pytester.runpytest("--gate-hardware", "test-hw", "--gate-report", "report", *workers)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "99.9% lower bound" in out and "is above its ceiling 16.00 MiB per 1k requests" in out, out
    data = json.loads((pytester.path / "report" / "report.json").read_text())
    (metric,) = data["tests"][0]["metrics"]
    assert metric["now"]["fit"]["levels"] and "this run's floor" in metric["decided_by"]
    page = html_page(data)
    assert page.count('<svg class="slope"') == 1 and "allowance (ceiling)" in page and "requests completed" in page
    monkeypatch.setenv("LEAK", "0")
    result = pytester.runpytest("--gate-hardware", "test-hw", "--gate-report", "report", *workers)
    result.assert_outcomes(passed=1)
    metric = json.loads((pytester.path / "report" / "report.json").read_text())["tests"][0]["metrics"][0]
    assert "this run's floor" in metric["decided_by"] and not metric["failed"]
