"""The rule of a paired metric (:class:`~vramgate.core.metrics.Paired`): what its pairs add to its kind's rule.

A paired metric is a measured one (its samples are the pairs' ratios), compared with its baseline by its kind's
rule like any other. Its pairs add three things, each decided here and nowhere else: the in-run check (a
candidate worse than its reference in the same run breaks the metric's budget, Note [paired comparison] in
:mod:`vramgate.core.stats`), the noise guard (a run too noisy for the in-run check to detect a shift of its
tolerance makes the metric ``untrusted``, Note [noise guard] there), and the lines a failing test's message shows
(what each look found, Note [second look] in :mod:`vramgate.engine.looks`, and the noise line where no look
said it).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramgate.core.metrics import Metric, Paired, format_change
from vramgate.core.numbers import Better
from vramgate.core.stats import DETECTION_POWER, compare_pairs, detectable_pair_shift

#: How an ``untrusted`` paired metric's reason begins (:meth:`PairedRule.too_noisy`).
TOO_NOISY = "too noisy to judge"


@dataclass(frozen=True)
class PairedRule:
    """The in-run check, the noise guard and the message lines of one paired measurement."""

    pair: Paired
    better: Better

    def in_run(self) -> str | None:
        """Why the candidate is worse than its reference in this run (the metric then breaks its budget); None
        when it is not."""
        pair = self.pair
        result = compare_pairs(pair.reference, pair.candidate, better=self.better, tolerance=pair.tolerance,
                               alpha=pair.alpha)
        if not result.regressed:
            return None
        return (f"the candidate is worse than its reference in this run: median ratio {1 + result.change:.4g} "
                f"({format_change(result.change)}; tolerance {pair.tolerance:.1%}, signed-rank one-sided "
                f"p = {result.p_worse:.2g})")

    def noise(self) -> tuple[float | None, str]:
        """The smallest shift the in-run check can detect on these samples (Note [noise guard] in
        :mod:`vramgate.core.stats`), and a line saying it beside the tolerance; None where the samples give no
        spread (a non-positive sample)."""
        pair = self.pair
        try:
            shift = detectable_pair_shift(pair.reference, pair.candidate, alpha=pair.alpha)
        except ValueError:
            return None, "noise: not measurable on these samples"
        return shift, (f"noise: on this run's samples the in-run check detects a shift of {shift:.1%} or more "
                       f"(alpha {pair.alpha:g}, power {DETECTION_POWER:.0%}); its tolerance is {pair.tolerance:.1%}")

    def too_noisy(self) -> str | None:
        """Why the measurement cannot be judged on its own samples (it is then ``untrusted``: neither a red nor a
        green); None when it can be."""
        shift, line = self.noise()
        if shift is None or shift <= self.pair.tolerance:
            return None
        return f"{TOO_NOISY}: {line}"

    def message_lines(self) -> list[str]:
        """What a failing test's message shows of the measurement: what each look found, then the noise line
        unless the looks said it (:attr:`Paired.noise_in_looks`)."""
        return [*self.pair.looks, *([] if self.pair.noise_in_looks else [self.noise()[1]])]


def paired_rule(metric: Metric) -> PairedRule | None:
    """The paired rule of *metric*; None for a metric that is not paired."""
    return PairedRule(metric.paired, metric.better) if metric.paired is not None else None
