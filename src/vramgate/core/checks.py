"""Checks of one metric: against its budget, and against its baseline.

Each check is a small pure function that returns what it found; the plugin
collects the findings of a test and turns the failing ones into one message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vramgate.core.kinds import kind_rule
from vramgate.core.leak import POWER, SLOPE_SCALE
from vramgate.core.metrics import Metric, format_change, relative_change
from vramgate.core.paired import paired_rule
from vramgate.core.provenance import Provenance
from vramgate.core.stats import DEFAULT_ALPHA

Verdict = Literal[
    "ok", "regressed", "improved", "missing", "new", "updated", "incompatible", "not compared", "untrusted",
    "no baselines",
]

#: Verdicts that fail a test (budget failures fail it too, whatever the verdict).
FAILING: frozenset[str] = frozenset({"regressed", "missing", "incompatible", "untrusted"})

#: Why an ``untrusted`` verdict was not judged: the GPU-state guard distrusted the measurement, or a paired
#: metric's run was too noisy for its in-run check (:func:`check_noise`).
Untrusted = Literal["gpu state", "too noisy"]


def verdict_text(verdict: str, outside_budget: bool, *, name_ok: bool = False) -> str:
    """The one display text of a verdict: *verdict* itself, ``outside budget`` for an ``ok`` figure that breaks
    its budget (``ok, outside budget`` with *name_ok*, as the junit properties name every verdict), ``<verdict>,
    outside budget`` for any other that does. Never parsed back: readers keep the verdict and whether the figure
    is outside its budget as fields."""
    if not outside_budget:
        return verdict
    return "outside budget" if verdict == "ok" and not name_ok else f"{verdict}, outside budget"


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
    rule = paired_rule(metric)
    worse = rule.in_run() if rule is not None else None  # the paired rule's in-run check (vramgate.core.paired)
    if worse:
        return worse
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



def check_noise(metric: Metric) -> str | None:
    """Why *metric*, a paired metric, cannot be judged on its own samples
    (:meth:`vramgate.core.paired.PairedRule.too_noisy`); None when it can be, or when the metric is not paired. Such
    a metric is ``untrusted``: neither a red nor a green."""
    rule = paired_rule(metric)
    return rule.too_noisy() if rule is not None else None


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
