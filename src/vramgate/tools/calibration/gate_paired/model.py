"""The noise model that extrapolates a campaign's trials to rates too small to count in them, and its bootstrap
bounds (Note [bootstrap bound])."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vramgate.tools.calibration.gate_paired.rules import Rules, median_ratio
from vramgate.tools.calibration.gate_paired.trials import PLANTED, TrialData


@dataclass(frozen=True)
class NoiseModel:
    """A profile's paired rounds as the trials show them: each round pair's log ratio is the profile's true log
    ratio (*effect*), plus its engine pair's offset (SD *between*: an engine process is a little faster or slower
    for its whole life), plus the pair's noise (SD one of *spreads*, the ratio spreads the trials had: a look
    draws one); a look has *samples* pairs, as the trials had (30 round pairs, or 6 step floors)."""

    effect: float
    between: float
    spreads: tuple[float, ...]
    samples: int = 30

    @classmethod
    def fit(cls, group: Sequence[TrialData]) -> NoiseModel:
        """The model of one profile's unchanged trials: *between* is what the trials' median log ratios spread by
        beyond the noise of a median of their own rounds (about pi/2 s^2/n)."""
        from vramgate.core.stats import robust_log_spread

        logs = [math.log(median_ratio(t)) for t in group]
        spreads = tuple(robust_log_spread([c / r for r, c in zip(t.ref, t.cand, strict=True)]) for t in group)
        mean = sum(logs) / len(logs)
        total = sum((x - mean) ** 2 for x in logs) / max(1, len(logs) - 1)
        own = sum(math.pi / 2 * s**2 / len(t.ref) for s, t in zip(spreads, group, strict=True)) / len(group)
        return cls(mean, math.sqrt(max(0.0, total - own)), spreads, min(len(t.ref) for t in group))

    def look(self, rng: Any, rounds: int, shift: float = 0.0) -> tuple[list[float], list[float]]:
        """One look's rounds from fresh engines, the candidate *shift* slower."""
        s = rng.choice(self.spreads)
        offset = rng.gauss(0.0, self.between)
        ref = [0.005 * math.exp(rng.gauss(0.0, 0.1)) for _ in range(rounds)]
        cand = [r * math.exp(self.effect + offset + math.log1p(shift) + rng.gauss(0.0, s)) for r in ref]
        return ref, cand


def simulate(model: NoiseModel, rules: Rules, *, rounds: int | None = None, shift: float = 0.0, runs: int = 2000,
             history: bool = True, seed: int = 0, baseline_pairs: int = 1) -> float:
    """How often the paired test fails under *model*: a first look, further ones (fresh engines) when it fails, the
    verdict of *rules*; against a baseline of *baseline_pairs* other unchanged engine pairs' looks, pooled, where
    *history*. A look has *rounds* pairs (default: the model's)."""
    import random

    rng = random.Random(seed)
    rounds = model.samples if rounds is None else rounds
    fails = 0
    for _ in range(runs):
        base = None
        if history:
            base = []
            for _ in range(baseline_pairs):
                r, c = model.look(rng, rounds)
                base += [y / x for x, y in zip(r, c, strict=True)]
        ref, cand = model.look(rng, rounds, shift)
        first = TrialData("", "", 0, ref, cand, True)
        if not rules.first_fails(first, base):
            continue
        more = [TrialData("", "", n, *model.look(rng, rounds, shift), True) for n in range(1, 1 + rules.further)]
        fails += rules.confirms(first, *more, base=base)
    return fails / runs


def percentile(values: Sequence[float], q: float) -> float:
    """The *q* quantile of *values* (the smallest value with at least a fraction *q* of them at or below it)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def bootstrap_model(unchanged: Sequence[TrialData], rules: Rules, *, replicates: int, runs: int,
                    history: bool = True, baseline_pairs: int = 1, seed: int = 0) -> dict[str, Any]:
    """Bounds of the :class:`NoiseModel`'s rates from the trials it was fitted to (a profile's *unchanged* trials):
    each of *replicates* draws as many trials with replacement, refits the model and simulates *runs* tests
    unchanged and with the planted +10% (:func:`simulate`). Gives each replicate's rates, the false alarms' 95%
    upper bound and the detection's 95% lower bound (percentiles).

    Note [bootstrap bound]: a rate near 1% seen in the trials themselves needs about 300 gate runs' worth before its
    exact bound falls to 1%; the model reaches lower rates from the trials' noise (the profile's true ratio, the
    spread between engine pairs, the rounds' spread), but its point estimate says nothing of how well a handful of
    trials pins those down. Refitting it to resampled trials (engine pairs are what is drawn: a trial is one) puts
    that uncertainty into the rates: a replicate that happens to hold the slow engine pair twice fits a wider
    spread between pairs and alarms more. The bound holds under the model's form (normal offsets between engine
    pairs, each look's rounds as one of the trials' spreads); a tail the trials never showed stays outside it. A
    refit's rate is counted in *runs* simulated tests, so a bound of 0 says only "below 1 / runs"."""
    import random

    rng = random.Random(seed)
    fa, det = [], []
    for k in range(replicates):
        model = NoiseModel.fit([rng.choice(unchanged) for _ in unchanged])
        fa.append(simulate(model, rules, runs=runs, history=history, baseline_pairs=baseline_pairs, seed=seed + k))
        det.append(simulate(model, rules, runs=runs, history=history, shift=PLANTED,
                            baseline_pairs=baseline_pairs, seed=seed + k))
    return {"replicates": replicates, "false_alarms_replicates": fa, "detection_replicates": det,
            "false_alarms_upper": percentile(fa, 0.95), "detection_lower": percentile(det, 0.05)}
