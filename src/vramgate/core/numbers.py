"""Changes and medians of figures: what the metrics, the statistics and the kinds' rules all build on."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Better = Literal["lower", "higher"]


def worse_change(new: float, old: float, better: Better) -> float:
    """How much worse *new* is than *old*, in ratio terms, the same in both directions (positive = worse).

    Lower is better: ``new / old - 1``. Higher is better: ``old / new - 1``, so
    half the throughput is +100% worse, as double the latency is; a tolerance
    of 1.0 fails at half, never "at nothing". ``inf`` when the divisor is zero
    and the other figure is not.
    """
    if better == "lower":
        return relative_change(new, old)
    return relative_change(old, new)


def relative_change(new: float, old: float) -> float:
    """``new / old - 1``; ``inf``/``-inf`` when *old* is zero and *new* is not."""
    if old == 0:
        return 0.0 if new == 0 else math.copysign(math.inf, new)
    return new / old - 1.0


def format_change(change: float) -> str:
    """*change* (a fraction) as a signed percentage with two decimals (``+1.25%``), or ``+inf%`` / ``-inf%``."""
    if math.isinf(change):
        return "+inf%" if change > 0 else "-inf%"
    return f"{change * 100:+.2f}%"


def median(values: Sequence[float]) -> float:
    """The median of *values* (the mean of the middle two for an even count); :class:`ValueError` for none."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no samples")
    mid = n // 2
    return float(ordered[mid]) if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0
