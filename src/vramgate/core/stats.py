"""Noise-aware comparison of measured samples.

Method (Note [measured comparison]):

A measured metric is a set of samples (default count :data:`DEFAULT_SAMPLES`).
The candidate regresses against the baseline only when *both* hold:

1. the ratio of medians moves in the worse direction by more than the metric's
   relative tolerance (default 5%), and
2. a one-sided Mann-Whitney U test rejects "no shift in the worse direction" at
   level :data:`DEFAULT_ALPHA` (1%).

The U test is rank based, so it needs no normality and is robust to the odd
outlier (a GC pause, a clock change). Its p-value is exact for small samples
without ties and uses the normal approximation with tie and continuity
corrections otherwise. The tolerance keeps statistically clear but practically
irrelevant shifts from failing a PR; the test keeps a large but noisy shift of
the median from failing it on chance. With lognormal samples whose coefficient
of variation is 5%, twenty samples a side give a false-alarm rate of about
0.35% and a power of about 99% for a 10% shift (over 4,000 simulated trials;
fifteen samples: 0.45% and 98%; ten: 90% power). The harness's own tests check
both by simulation with fixed seeds.

Pure Python on purpose: it must run where only pytest and torch are present.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from statistics import NormalDist

from vramgate.core.numbers import Better, median, relative_change, worse_change

DEFAULT_ALPHA = 0.01
DEFAULT_SAMPLES = 20
_EXACT_LIMIT = 40


@cache
def _u_counts(m: int, n: int) -> tuple[int, ...]:
    """Number of orderings of m x's and n y's for each value of U (x above y pairs)."""
    if m == 0 or n == 0:
        return (1,)
    # The largest element is either an x (it beats all n y's: U grows by n)
    # or a y (it beats nothing: U unchanged).
    a = _u_counts(m - 1, n)
    b = _u_counts(m, n - 1)
    out = [0] * (m * n + 1)
    for u, c in enumerate(a):
        out[u + n] += c
    for u, c in enumerate(b):
        out[u] += c
    return tuple(out)


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> float:
    """One-sided p-value for "x tends to be greater than y" (Mann-Whitney U).

    Exact for small samples without ties; normal approximation with tie and
    continuity correction otherwise.
    """
    m, n = len(x), len(y)
    if m == 0 or n == 0:
        raise ValueError("Mann-Whitney U needs samples on both sides")
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(pooled)
    tie_term = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        rank = (i + j) / 2.0 + 1.0
        for k in range(i, j + 1):
            ranks[k] = rank
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    rank_sum_x = sum(r for r, (_, side) in zip(ranks, pooled, strict=True) if side == 0)
    u = rank_sum_x - m * (m + 1) / 2.0
    if tie_term == 0 and m <= _EXACT_LIMIT and n <= _EXACT_LIMIT:
        counts = _u_counts(m, n)
        total = sum(counts)
        u_int = round(u)
        return sum(counts[u_int:]) / total
    mean = m * n / 2.0
    nn = m + n
    var = m * n / 12.0 * ((nn + 1) - tie_term / (nn * (nn - 1)))
    if var <= 0:
        return 1.0
    z = (u - mean - 0.5) / math.sqrt(var)
    return _normal_sf(z)


@dataclass(frozen=True)
class SampleComparison:
    """Outcome of comparing candidate samples against baseline samples."""

    baseline_median: float
    candidate_median: float
    change: float
    """Relative change of the median, ``candidate / baseline - 1``."""
    p_worse: float
    """One-sided p-value that the candidate is worse than the baseline."""
    p_better: float
    """One-sided p-value that the candidate is better than the baseline."""
    regressed: bool
    improved: bool


def compare_samples(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    better: Better,
    tolerance: float,
    alpha: float = DEFAULT_ALPHA,
) -> SampleComparison:
    """Compare two sample sets by the rule in Note [measured comparison]."""
    base_med = median(baseline)
    cand_med = median(candidate)
    change = relative_change(cand_med, base_med)
    p_greater = mann_whitney_greater(candidate, baseline)
    p_less = mann_whitney_greater(baseline, candidate)
    # Tolerances mean the same in both directions, in ratio terms (metrics.worse_change).
    worse = worse_change(cand_med, base_med, better)
    gain = worse_change(base_med, cand_med, better)
    if better == "lower":
        p_worse, p_better = p_greater, p_less
    else:
        p_worse, p_better = p_less, p_greater
    regressed = worse > tolerance and p_worse < alpha
    improved = gain > tolerance and p_better < alpha
    return SampleComparison(base_med, cand_med, change, p_worse, p_better, regressed, improved)


#: The power at which :func:`detectable_pair_shift` states the smallest shift a comparison can see.
DETECTION_POWER = 0.5


def normal_quantile(p: float) -> float:
    """The standard normal quantile (the standard library's, ``statistics.NormalDist``)."""
    return NormalDist().inv_cdf(p)


def robust_log_spread(values: Sequence[float]) -> float:
    """The spread of *values* on a log scale, robust to outliers: 1.4826 x the median absolute deviation of
    their logarithms (the standard deviation for lognormal values; 0.05 is about 5%)."""
    if len(values) < 2 or any(v <= 0 for v in values):
        raise ValueError("a log spread needs at least 2 positive values")
    logs = [math.log(v) for v in values]
    centre = median(logs)
    return 1.4826 * median([abs(x - centre) for x in logs])


@cache
def _signed_rank_counts(n: int) -> tuple[int, ...]:
    """Number of sign assignments of ranks 1..n for each value of the positive rank sum."""
    counts = [1]
    for rank in range(1, n + 1):
        grown = counts + [0] * rank
        for total, c in enumerate(counts):
            grown[total + rank] += c
        counts = grown
    return tuple(counts)


def signed_rank_greater(differences: Sequence[float]) -> float:
    """One-sided p-value for "the differences tend to be above zero" (Wilcoxon signed-rank; zeros dropped).

    Exact for up to :data:`_EXACT_LIMIT` differences without ties in their magnitudes; normal approximation with
    tie and continuity correction otherwise."""
    d = [x for x in differences if x != 0]
    n = len(d)
    if n == 0:
        return 1.0
    ordered = sorted(d, key=abs)
    ranks = [0.0] * n
    tie_term = 0.0
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(ordered[j + 1]) == abs(ordered[i]):
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2.0 + 1.0
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    w = sum(r for r, x in zip(ranks, ordered, strict=True) if x > 0)
    if tie_term == 0 and n <= _EXACT_LIMIT:
        counts = _signed_rank_counts(n)
        return float(sum(counts[round(w):])) / float(2**n)
    mean = n * (n + 1) / 4.0
    var = n * (n + 1) * (2 * n + 1) / 24.0 - tie_term / 48.0
    if var <= 0:
        return 1.0
    return _normal_sf((w - mean - 0.5) / math.sqrt(var))


def compare_pairs(reference: Sequence[float], candidate: Sequence[float], *, better: Better, tolerance: float,
                  alpha: float = DEFAULT_ALPHA) -> SampleComparison:
    """Compare a candidate with its reference pair by pair (Note [paired comparison]).

    Note [paired comparison]: a paired measurement takes its two sides in pairs, side by side, in a random order
    within each pair. Under "no difference" each pair's log ratio candidate / reference is then as likely above
    zero as below, whatever the machine did in that pair's time, so a one-sided Wilcoxon signed-rank test of the
    log ratios (:func:`signed_rank_greater`) is exact, and it sees only what the pairing leaves of the noise: on
    a 2-core CPU, where a round's engine step spreads by 10-25% from round to round, the log ratio of a round pair
    spreads by less, since both sides of a pair share part of it (docs/calibration.md). The candidate is worse
    when the median ratio is worse than 1 by more than *tolerance* (in ratio terms, the same in both directions)
    and the test is clear at *alpha*; ``change`` is the median ratio minus 1.
    """
    if len(reference) != len(candidate) or not reference:
        raise ValueError(f"pairs differ in number: {len(reference)} vs {len(candidate)}")
    if any(x <= 0 for x in reference) or any(y <= 0 for y in candidate):
        raise ValueError("a paired comparison needs positive samples")
    logs = [math.log(y / x) for x, y in zip(reference, candidate, strict=True)]
    ratio = math.exp(median(logs))
    p_greater, p_less = signed_rank_greater(logs), signed_rank_greater([-x for x in logs])
    worse, gain = worse_change(ratio, 1.0, better), worse_change(1.0, ratio, better)
    p_worse, p_better = (p_greater, p_less) if better == "lower" else (p_less, p_greater)
    return SampleComparison(median(reference), median(candidate), ratio - 1.0, p_worse, p_better,
                            worse > tolerance and p_worse < alpha, gain > tolerance and p_better < alpha)


def detectable_pair_shift(reference: Sequence[float], candidate: Sequence[float], *, alpha: float = DEFAULT_ALPHA,
                          power: float = DETECTION_POWER) -> float:
    """The smallest relative shift that :func:`compare_pairs` at *alpha* detects with *power*, given the noise of
    these pairs (Note [noise guard]).

    Note [noise guard]: a comparison on samples this noisy cannot back a verdict at a tolerance below the shift
    it can see. The noise is the :func:`robust_log_spread` *s* of the pairs' ratios; the shift is the
    normal-theory detectable mean of *n* log ratios, ``(z_(1-alpha) + z_power) * s / sqrt(n)``, over the
    signed-rank test's asymptotic efficiency against the t test, ``sqrt(3 / pi)``. The power is
    :data:`DETECTION_POWER`, 50%: the paired rule fails a shift only when the median ratio moves past the tolerance
    *and* the test is clear, and a true shift of exactly the tolerance moves the median past it half the time
    however quiet the run; the guard asks that the test not be the weaker half of the rule. On a 2-core CPU the
    round pairs' ratios of the paired engine test spread by 7-44% (median 16%, 69 trials: docs/calibration.md),
    which gives 2-14% (median 5%) with 30 pairs; lognormal samples of sigma 0.6 on both sides give about 25%, and a
    check at 7.5% on them is no check.
    """
    if len(reference) != len(candidate) or len(reference) < 2:
        raise ValueError("a detectable shift needs at least 2 pairs")
    s = robust_log_spread([y / x for x, y in zip(reference, candidate, strict=True)])
    z = normal_quantile(1 - alpha) + normal_quantile(power)
    return math.exp(z * s / math.sqrt(len(reference)) / math.sqrt(3 / math.pi)) - 1
