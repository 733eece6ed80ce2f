"""Drift: a slow creep that no single merge shows.

Note [drift rule]:

A gate judges each change against the baseline it replaces, so a metric that gets 2% worse with every merge never
fails one (2% is inside a measured metric's 5% tolerance and inside its noise), and after ten merges it is 22%
worse. The drift rule looks at the series of accepted values instead (one value per merge that changed it,
:mod:`vramgate.store.history`), and flags a series when, over its last ``window`` values, *both* hold:

1. a one-sided Mann-Kendall test rejects "no trend in the worse direction" at level ``alpha``, and
2. the Theil-Sen slope, carried over the window, adds up to a worse change of more than ``min_change``.

The values are taken as logarithms, turned so that up is worse (``better="higher"``: the negated logarithm), so the
slope is a relative change per merge and a metric's size does not matter; a series with a zero or negative value
is taken as it is, with its change relative to the window's median.

Why this rule: the Mann-Kendall test is rank based, like the U test of :mod:`vramgate.core.stats`: it needs no
noise level, no normality, and a single outlier (one noisy re-record) moves it by one rank, not by its size. Its
null distribution is exact for a series without ties (the inversions of a random permutation), so its false-alarm
rate does not depend on how noisy the metric is: a CV of 5% and a CV of 50% alarm equally rarely. The noise still
decides *when* a creep is found, since a noisy series needs more merges for its ranks to line up. An exact metric
with no noise (KV bytes) has a strictly rising series under a creep and is flagged as soon as it has
``min_points`` values; a flat one has all ties and never is. The second condition keeps a trend that is clear but
small (a 0.1% creep of an exact figure) from being called drift, the way a tolerance does for one comparison. A
one-sided CUSUM would find a creep a few merges sooner but needs the noise level (estimated from the same short
series it judges, its false-alarm rate then depends on that estimate); a comparison with the value N merges ago
uses two points of the series and is the noisiest choice.

Measured (multiplicative lognormal noise with a CV of 5%, the rule applied after every merge, default
parameters; ``tests/test_history.py`` repeats the first 1,000 of each with their seeds): a flat series of 60
merges was flagged in 0 of 1,000 trials (6 of 20,000, 0.03%); a series rising 2% per merge was flagged in every
one of 1,000 trials, after 9 to 21 merges (median 16, 95th percentile 19). An exact series (no noise) rising 2%
per merge is flagged at merge 9, one rising 0.5% per merge at merge 11. A step (one deliberate, reviewed change
followed by a flat series) can also satisfy the rule while it is inside the window: the verdict then says how much
worse the window's end is than its start, and the reviewer who accepted the step knows why.

Pure Python on purpose, like :mod:`vramgate.core.stats`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from vramgate.core.metrics import Better, format_change, median

#: How many of the latest accepted values the rule looks at.
DEFAULT_WINDOW = 25
#: The fewest values the rule judges; fewer are "too few to judge". Nine is the fewest whose trend test can reach
#: :data:`DEFAULT_ALPHA` (nine values rising without a fall: p = 1/9! = 2.8e-6).
DEFAULT_MIN_POINTS = 9
#: The one-sided Mann-Kendall level; small, because the rule is applied again after every merge.
DEFAULT_ALPHA = 1e-5
#: The least worse change over the window that counts as drift (a measured metric's default tolerance).
DEFAULT_MIN_CHANGE = 0.05
#: The longest series whose trend test is exact (the normal approximation is good beyond).
_EXACT_LIMIT = 60


@dataclass(frozen=True)
class DriftRule:
    """The parameters of the drift rule (Note [drift rule]); the defaults are the ones the docs measure."""

    window: int = DEFAULT_WINDOW
    min_points: int = DEFAULT_MIN_POINTS
    alpha: float = DEFAULT_ALPHA
    min_change: float = DEFAULT_MIN_CHANGE

    def __post_init__(self) -> None:
        if not 3 <= self.min_points <= self.window:
            raise ValueError(f"drift rule: need 3 <= min_points <= window, got {self.min_points} and {self.window}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"drift rule: alpha must be between 0 and 1, got {self.alpha}")
        if not (math.isfinite(self.min_change) and self.min_change >= 0):
            raise ValueError(f"drift rule: min_change must be a finite number >= 0, got {self.min_change}")

    def to_json(self) -> dict[str, Any]:
        """The parameters as JSON data."""
        return {"window": self.window, "min_points": self.min_points, "alpha": self.alpha,
                "min_change": self.min_change}


@dataclass(frozen=True)
class DriftVerdict:
    """What the drift rule says of one series."""

    drifting: bool
    points: int
    """How many of the latest values were judged."""
    change: float
    """The worse change over those values that the Theil-Sen slope adds up to (positive = worse)."""
    per_merge: float
    """The same per value of the series (per merge that changed it)."""
    p_value: float
    """The one-sided Mann-Kendall p-value of a trend in the worse direction."""
    reason: str

    def to_json(self) -> dict[str, Any]:
        """This verdict as plain JSON data (an infinite change as the string ``inf``/``-inf``)."""
        def number(x: float) -> float | str:
            return x if math.isfinite(x) else str(x)

        return {"drifting": self.drifting, "points": self.points, "change": number(self.change),
                "per_merge": number(self.per_merge), "p_value": self.p_value, "reason": self.reason}


@cache
def _inversions_cdf(n: int) -> tuple[float, ...]:
    """``P(inversions <= k)`` of a random permutation of *n* items, for each k (the Mahonian distribution)."""
    counts = [1]
    for m in range(2, n + 1):  # insert the m-th item: it adds 0 .. m-1 inversions
        nxt = [0] * (len(counts) + m - 1)
        running = 0
        for k in range(len(nxt)):
            running += counts[k] if k < len(counts) else 0
            if k - m >= 0:
                running -= counts[k - m]
            nxt[k] = running
        counts = nxt
    total = sum(counts)
    out, acc = [], 0
    for c in counts:
        acc += c
        out.append(acc / total)
    return tuple(out)


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def kendall_trend_p(values: Sequence[float]) -> float:
    """One-sided p-value of "*values* tend to rise" (the Mann-Kendall test).

    Exact for a series without ties (up to 60 values); the normal approximation with tie and continuity
    corrections otherwise. 1.0 for fewer than two values or when all are equal."""
    n = len(values)
    if n < 2:
        return 1.0
    s = 0
    for i in range(n - 1):
        vi = values[i]
        for j in range(i + 1, n):
            d = values[j] - vi
            s += (d > 0) - (d < 0)
    groups: dict[float, int] = {}
    for v in values:
        groups[v] = groups.get(v, 0) + 1
    ties = [t for t in groups.values() if t > 1]
    pairs = n * (n - 1) // 2
    if not ties and n <= _EXACT_LIMIT:
        # S = pairs - 2 * inversions, so S >= s  <=>  inversions <= (pairs - s) / 2
        return _inversions_cdf(n)[(pairs - s) // 2]
    var = (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties)) / 18.0
    if var <= 0:
        return 1.0
    return _normal_sf((s - 1) / math.sqrt(var)) if s > 0 else _normal_sf((s + 1) / math.sqrt(var))


def sen_slope(values: Sequence[float]) -> float:
    """The Theil-Sen slope of *values* against their index: the median of the slopes of all pairs (0.0 for fewer
    than two values)."""
    n = len(values)
    if n < 2:
        return 0.0
    return median([(values[j] - values[i]) / (j - i) for i in range(n - 1) for j in range(i + 1, n)])


def _oriented(values: Sequence[float], better: Better) -> tuple[list[float], bool]:
    """*values* turned so that up is worse, as logarithms when all are positive (and whether they are)."""
    sign = 1.0 if better == "lower" else -1.0
    if all(v > 0 for v in values):
        return [sign * math.log(v) for v in values], True
    return [sign * v for v in values], False


def check_drift(values: Sequence[float], better: Better, rule: DriftRule | None = None) -> DriftVerdict:
    """The drift rule (Note [drift rule]) on the latest values of a series of accepted values, oldest first."""
    rule = rule or DriftRule()
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
    latest = list(values[-rule.window:])
    n = len(latest)
    if n < rule.min_points:
        return DriftVerdict(False, n, 0.0, 0.0, 1.0,
                            f"too few values to judge ({n}; the rule needs {rule.min_points})")
    y, logs = _oriented(latest, better)
    return _verdict(latest, y, logs, kendall_trend_p(y), rule)


def _verdict(latest: list[float], y: list[float], logs: bool, p: float, rule: DriftRule) -> DriftVerdict:
    """The verdict on the values *latest* (*y*: turned up-is-worse, as logarithms when *logs*), p-value *p*."""
    n = len(latest)
    slope = sen_slope(y)
    if logs:
        per_merge, change = math.expm1(slope), math.expm1(slope * (n - 1))
    else:
        scale = abs(median(latest))
        if scale == 0:
            per_merge = change = 0.0 if slope == 0 else math.copysign(math.inf, slope)
        else:
            per_merge, change = slope / scale, slope * (n - 1) / scale
    drifting = p < rule.alpha and change > rule.min_change
    trend = f"{format_change(change)} worse over the last {n} values ({format_change(per_merge)} per value)"
    if drifting:
        reason = f"drifting: {trend}; trend test p={p:.2g} < {rule.alpha:g}"
    elif p >= rule.alpha:
        reason = f"no drift: no clear trend toward worse (p={p:.2g}, needs < {rule.alpha:g}); {trend}"
    else:
        reason = f"no drift: a clear trend, but only {trend} (needs more than {format_change(rule.min_change)})"
    return DriftVerdict(drifting, n, change, per_merge, p, reason)


def first_drift(values: Sequence[float], better: Better, rule: DriftRule | None = None) -> int | None:
    """After how many values the drift rule, applied after each one, first flags the series; None if never."""
    rule = rule or DriftRule()
    for end in range(rule.min_points, len(values) + 1):
        latest = list(values[max(0, end - rule.window):end])
        y, logs = _oriented(latest, better)
        p = kendall_trend_p(y)
        if p < rule.alpha and _verdict(latest, y, logs, p, rule).drifting:  # the slope only where the test is clear
            return end
    return None
