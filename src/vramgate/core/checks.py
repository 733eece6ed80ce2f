"""Checks of one metric: against its budget, and against its baseline.

Each check is a small pure function that returns what it found; the plugin
collects the findings of a test and turns the failing ones into one message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vramgate.core.kinds import kind_rule
from vramgate.core.leak import POWER, SLOPE_SCALE
from vramgate.core.metrics import Metric, Paired, format_change, relative_change
from vramgate.core.provenance import Provenance
from vramgate.core.stats import DEFAULT_ALPHA, DETECTION_POWER, compare_pairs, detectable_pair_shift

Verdict = Literal[
    "ok", "regressed", "improved", "missing", "new", "updated", "incompatible", "not compared", "untrusted",
    "no baselines",
]

#: Verdicts that fail a test (budget failures fail it too, whatever the verdict).
FAILING: frozenset[str] = frozenset({"regressed", "missing", "incompatible", "untrusted"})

#: Why an ``untrusted`` verdict was not judged: the GPU-state guard distrusted the measurement, or a paired
#: metric's run was too noisy for its in-run check (:func:`check_noise`).
Untrusted = Literal["gpu state", "too noisy"]


def verdict_text(verdict: str, outside_budget: bool) -> str:
    """The one display text of a verdict: *verdict* itself, ``outside budget`` for an ``ok`` figure that breaks
    its budget, ``<verdict>, outside budget`` for any other that does. Never parsed back: readers keep the verdict
    and whether the figure is outside its budget as fields."""
    if not outside_budget:
        return verdict
    return "outside budget" if verdict == "ok" else f"{verdict}, outside budget"


@dataclass(frozen=True)
class Finding:
    """What the gate concluded about one metric of one test."""

    metric: Metric
    verdict: Verdict
    baseline: Metric | None = None
    provenance: Provenance | None = None
    change: float | None = None
    budget: str | None = None
    """Why the metric breaks its ceiling or floor, or None when within budget."""
    detail: str = ""
    """How the comparison was decided (tolerance, p-value)."""
    untrusted: Untrusted | None = None
    """Why an ``untrusted`` verdict was not judged; None for every other verdict."""

    @property
    def failed(self) -> bool:
        """Whether this finding fails its test: a failing verdict or a broken budget."""
        return self.verdict in FAILING or self.budget is not None


def check_budget(metric: Metric) -> str | None:
    """A message when *metric* is above its ceiling or below its floor, else None.

    A paired metric (:class:`~vramgate.core.metrics.Paired`) also fails its budget
    when the candidate side is worse than the reference side of the same run.
    """
    if metric.paired is not None:
        pair = metric.paired
        result = compare_pairs(pair.reference, pair.candidate, better=metric.better, tolerance=pair.tolerance,
                               alpha=pair.alpha)
        if result.regressed:
            return (f"the candidate is worse than its reference in this run: median ratio {1 + result.change:.4g} "
                    f"({format_change(result.change)}; tolerance {pair.tolerance:.1%}, signed-rank one-sided "
                    f"p = {result.p_worse:.2g})")
    if metric.fit is not None and metric.ceiling is not None:  # Note [leak fit] in vramgate.core.leak
        fit, allowance = metric.fit, metric.ceiling / SLOPE_SCALE
        if fit.shows_leak(allowance):
            return (f"{metric.show()}: its {1 - fit.alpha:.1%} lower bound {metric.show(fit.lower * SLOPE_SCALE)} "
                    f"is above its ceiling {metric.show(metric.ceiling)} (this run catches slopes of "
                    f"{metric.show(fit.floor(allowance) * SLOPE_SCALE)} or more with {POWER:.0%} detection)")
        return None
    if metric.ceiling is not None and metric.value > metric.ceiling:
        over = format_change(relative_change(metric.value, metric.ceiling))
        return f"{metric.show()} is above its ceiling {metric.show(metric.ceiling)} ({over})"
    if metric.floor is not None and metric.value < metric.floor:
        under = format_change(relative_change(metric.value, metric.floor))
        return f"{metric.show()} is below its floor {metric.show(metric.floor)} ({under})"
    return None


def leak_detail(metric: Metric) -> str:
    """How a memory slope's verdict was decided (Note [leak fit] in :mod:`vramgate.core.leak`): its bound, and the
    floor of the run beside its ceiling; empty for a metric without a fit."""
    fit = metric.fit
    if fit is None:
        return ""
    line = (f"slope {metric.show()} ± {metric.show(fit.stderr * SLOPE_SCALE)} over {fit.span:,.0f} {fit.per}s "
            f"({len(fit.levels)} levels); {1 - fit.alpha:.1%} lower bound {metric.show(fit.lower * SLOPE_SCALE)}")
    if metric.ceiling is None:
        return line
    floor = fit.floor(metric.ceiling / SLOPE_SCALE) * SLOPE_SCALE
    return f"{line}; ceiling {metric.show(metric.ceiling)}; this run's floor {metric.show(floor)}"


#: How the noise guard's verdict begins (Note [noise guard] in :mod:`vramgate.core.stats`).
TOO_NOISY = "too noisy to judge"


def paired_noise(pair: Paired) -> tuple[float | None, str]:
    """The smallest shift the in-run check of *pair* can detect on its own samples (Note [noise guard] in
    :mod:`vramgate.core.stats`), and a line saying it beside the tolerance; None where the samples give no spread
    (a non-positive sample)."""
    try:
        shift = detectable_pair_shift(pair.reference, pair.candidate, alpha=pair.alpha)
    except ValueError:
        return None, "noise: not measurable on these samples"
    return shift, (f"noise: on this run's samples the in-run check detects a shift of {shift:.1%} or more "
                   f"(alpha {pair.alpha:g}, power {DETECTION_POWER:.0%}); its tolerance is {pair.tolerance:.1%}")


def check_noise(metric: Metric) -> str | None:
    """Why *metric*, a paired metric, cannot be judged on its own samples: the run was too noisy for its in-run
    check to detect a shift of its tolerance (Note [noise guard] in :mod:`vramgate.core.stats`); None when it can
    be, or when the metric is not paired. Such a metric is ``untrusted``: neither a red nor a green."""
    if metric.paired is None:
        return None
    shift, line = paired_noise(metric.paired)
    if shift is None or shift <= metric.paired.tolerance:
        return None
    return f"{TOO_NOISY}: {line}"


def check_baseline(metric: Metric, baseline: Metric, *, alpha: float = DEFAULT_ALPHA) -> tuple[Verdict, float, str]:
    """Compare *metric* with its stored *baseline*: (verdict, relative change, how decided).

    The metric's kind judges (Note [metric kinds] in :mod:`vramgate.core.kinds`): exact metrics one-sided
    against the tolerance (default 0), in ratio terms the same in both directions; measured ones by Note
    [measured comparison] in :mod:`vramgate.core.stats`.
    """
    if baseline.unit != metric.unit or baseline.kind != metric.kind or baseline.better != metric.better:
        return (
            "incompatible",
            0.0,
            f"baseline is {baseline.kind}/{baseline.unit}/{baseline.better} is better, "
            f"now {metric.kind}/{metric.unit}/{metric.better} is better: re-record it",
        )
    verdict, change, how = kind_rule(metric.kind).judge(
        metric.value, metric.samples, baseline.value, baseline.samples, better=metric.better,
        tolerance=metric.effective_tolerance, alpha=alpha)
    return verdict, change, how
