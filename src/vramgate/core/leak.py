"""A memory slope with its confidence bound: does a server keep memory per request (or per token), and what is
the smallest leak one run could show.

Note [leak fit]: a leak keeps memory alive per request admitted or per token generated, so the server's memory
grows linearly in the requests (tokens) it has completed. The samples of one load are not independent: memory
moves in steps (an allocator arena, a batch's buffers) and each step stays for many samples, so a least-squares
slope over the samples is precise-looking and its textbook standard error is far too small. The fit therefore
works on *levels*: the measured part is cut into :data:`SEGMENTS` equal spans of completed requests (tokens), and
each span gives one level, the median of its samples (a step inside one span moves one level; a spike between
two samples moves none). The slope is the least-squares line through the levels, and its standard error comes
from the levels' own scatter around that line (``SEGMENTS - 2`` degrees of freedom): a run whose memory wandered
gets a wide bound, one whose memory grew smoothly a narrow one, on any machine, with no figure carried over from
another run.

The verdict is one-sided, at :data:`ALPHA` (Student's t): the run shows a leak when the slope's lower bound is
above the allowance (the entry's ``memory_slope`` budget), and only then. Its *floor* is the smallest true slope
that this run's scatter would show with :data:`POWER` detection, ``allowance + (t + z(power) * sqrt(1 + t² / 2df))
* SE`` with ``t`` the one-sided t quantile at ``alpha``: the normal approximation of the noncentral t (the bound's
own uncertainty, with few levels, costs detection), slightly conservative (the exact distance at 10 degrees of
freedom is about 1% shorter). The report prints the floor beside the verdict, so that a pass reads "no leak of at
least FLOOR", not "no leak".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

from vramgate.core.stats import normal_quantile

#: The measured part's spans, one level each (Note [leak fit]).
SEGMENTS = 12
#: The one-sided false-alarm rate of one verdict when the server keeps nothing beyond the allowance.
ALPHA = 0.001
#: The detection rate at the floor a run reports (Note [leak fit]).
POWER = 0.95
#: What a slope is per: requests completed, or output tokens completed.
PER = ("request", "token")
#: The fewest levels a fit takes (spans with fewer than two samples give none).
LEAST_LEVELS = 8
#: A slope metric's figures are per 1,000 requests (tokens): its fit's, per one, times this.
SLOPE_SCALE = 1000.0
#: The most raw samples a fit keeps for its picture (evenly thinned).
PICTURE_SAMPLES = 240


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile at *p* with *df* degrees of freedom (Hill's expansion around the normal quantile: within
    1% of the exact value for df >= 4 and p up to 0.999, low by 0.84% at df 4 and 0.999, 0.1% at df 6; a fit has at
    least :data:`LEAST_LEVELS` levels, so df >= 6)."""
    if df < 1:
        raise ValueError(f"t quantile needs at least one degree of freedom, got {df}")
    z = normal_quantile(p)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


@dataclass(frozen=True)
class LeakFit:
    """A memory slope, fitted to levels (Note [leak fit]); slopes and bounds in bytes per :attr:`per`."""

    per: str
    """``request`` or ``token`` (:data:`PER`)."""
    slope: float
    stderr: float
    df: int
    alpha: float
    levels: tuple[tuple[float, float], ...]
    """(completed, bytes) of each span: the points the line is fitted to."""
    intercept: float
    span: float
    """Requests (tokens) completed over the measured part: from its first sample to its last."""
    samples: tuple[tuple[float, float], ...] = ()
    """(completed, bytes) of the measured part's samples, thinned to :data:`PICTURE_SAMPLES`: the picture's."""
    warmup: tuple[tuple[float, float], ...] = ()
    """(completed, bytes) of the samples before the measured part (the warm-up), thinned alike."""

    @property
    def lower(self) -> float:
        """The slope's one-sided lower confidence bound at :attr:`alpha`."""
        return self.slope - t_quantile(1 - self.alpha, self.df) * self.stderr

    def floor(self, allowance: float, power: float = POWER) -> float:
        """The smallest slope this run would show above *allowance* with *power* detection (Note [leak fit])."""
        t = t_quantile(1 - self.alpha, self.df)
        return allowance + (t + normal_quantile(power) * math.sqrt(1 + t * t / (2 * self.df))) * self.stderr

    def shows_leak(self, allowance: float) -> bool:
        """Whether the run shows a slope above *allowance*: its lower bound is above it."""
        return self.lower > allowance

    def to_json(self) -> dict[str, Any]:
        """The fit as JSON data (what :meth:`from_json` reads)."""
        return {"per": self.per, "slope": self.slope, "stderr": self.stderr, "df": self.df, "alpha": self.alpha,
                "intercept": self.intercept, "span": self.span, "levels": [list(p) for p in self.levels],
                "samples": [list(p) for p in self.samples], "warmup": [list(p) for p in self.warmup]}

    @classmethod
    def from_json(cls, data: Any, where: str = "fit") -> LeakFit:
        """The fit :meth:`to_json` wrote; ValueError naming *where* when *data* is not one."""
        try:
            def points(key: str) -> tuple[tuple[float, float], ...]:
                return tuple((float(x), float(y)) for x, y in data.get(key, []))

            fit = cls(str(data["per"]), float(data["slope"]), float(data["stderr"]), int(data["df"]),
                      float(data["alpha"]), points("levels"), float(data["intercept"]), float(data["span"]),
                      points("samples"), points("warmup"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{where}: not a memory slope's fit ({exc!r})") from None
        if fit.per not in PER or fit.df < 1 or not 0 < fit.alpha < 1:
            raise ValueError(f"{where}: not a memory slope's fit (per {fit.per!r}, df {fit.df}, alpha {fit.alpha})")
        return fit


def _thin(points: Sequence[tuple[float, float]], most: int = PICTURE_SAMPLES) -> tuple[tuple[float, float], ...]:
    if len(points) <= most:
        return tuple(points)
    step = len(points) / most
    return tuple(points[int(i * step)] for i in range(most))


def fit_leak(points: Sequence[tuple[float, float]], *, per: str = "request", segments: int = SEGMENTS,
             alpha: float = ALPHA, warmup: Sequence[tuple[float, float]] = ()) -> LeakFit:
    """The slope of bytes against completed requests (tokens) of *points* (completed, bytes), the measured part of a
    load, fitted to its levels with its standard error (Note [leak fit]); *warmup* is kept for the picture only.
    ValueError when the points give fewer than :data:`LEAST_LEVELS` levels."""
    if per not in PER:
        raise ValueError(f"a memory slope is per {' or per '.join(PER)}, not per {per!r}")
    pts = sorted((float(x), float(y)) for x, y in points)
    if len(pts) < 2 * segments or pts[-1][0] <= pts[0][0]:
        raise ValueError(f"a memory slope needs at least {2 * segments} samples over a growing count of completed "
                         f"{per}s, got {len(pts)}")
    x0, x1 = pts[0][0], pts[-1][0]
    width = (x1 - x0) / segments
    spans: list[list[tuple[float, float]]] = [[] for _ in range(segments)]
    for x, y in pts:
        spans[min(int((x - x0) / width), segments - 1)].append((x, y))
    levels = tuple((median(x for x, _ in s), median(y for _, y in s)) for s in spans if len(s) >= 2)
    if len(levels) < LEAST_LEVELS:
        raise ValueError(f"a memory slope needs samples in at least {LEAST_LEVELS} of its {segments} spans, got "
                         f"{len(levels)}: the completions came in too few bursts")
    n = len(levels)
    mx = sum(x for x, _ in levels) / n
    my = sum(y for _, y in levels) / n
    sxx = sum((x - mx) ** 2 for x, _ in levels)
    slope = sum((x - mx) * (y - my) for x, y in levels) / sxx
    intercept = my - slope * mx
    rss = sum((y - intercept - slope * x) ** 2 for x, y in levels)
    stderr = math.sqrt(rss / (n - 2) / sxx)
    return LeakFit(per, slope, stderr, n - 2, alpha, levels, intercept, x1 - x0, _thin(pts), _thin(sorted(warmup)))
