"""The paired test's rules applied to a campaign's trials: a first look, the further looks of fresh engines, the
verdict (Note [three looks] and Note [second look] in :mod:`vramgate.engine.looks`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vramgate.engine.looks import LookRule
from vramgate.tools.calibration.gate_paired.trials import TrialData

if TYPE_CHECKING:
    from vramgate.engine.paired import PairedDefaults


@dataclass(frozen=True)
class Rules:
    """The paired test's settings (the gate's: :data:`~vramgate.engine.paired.PAIRED_DEFAULTS`) with the gate's own
    rule of looks (:class:`~vramgate.engine.looks.LookRule`), judging a campaign's trials as the gate judges looks."""

    tolerance: float
    alpha: float
    history_tolerance: float
    looks: int = 2
    """The most looks (:attr:`~vramgate.engine.paired.PairedDefaults.looks`)."""
    screen: float | None = None
    """The first look's in-run tolerance (Note [three looks]); ``None``: :attr:`tolerance`."""

    @property
    def rule(self) -> LookRule:
        """The gate's rule of looks at these settings."""
        return LookRule(self.looks)

    @property
    def further(self) -> int:
        """The looks taken after a first that fails."""
        return self.rule.further

    @property
    def second(self) -> str:
        """How the looks after a failing first decide, as a campaign's analysis names it: ``both`` (two looks: the
        second look's own rounds and the pooled rounds of both fail) or ``three`` (the pooled rounds of three)."""
        return "three" if self.looks == 3 else "both"

    def describe(self) -> str:
        """The rule in words, for a report's header."""
        return self.rule.describe(self.screen)

    @classmethod
    def of(cls, settings: PairedDefaults) -> Rules:
        """The rules of a tier's :class:`~vramgate.engine.paired.PairedDefaults`."""
        return cls(settings.tolerance, settings.alpha, settings.history_tolerance, settings.looks, settings.screen)

    def first_fails(self, first: TrialData, base: Sequence[float] | None) -> list[str]:
        """Which checks a first look fails (its in-run check at the screen)."""
        return self.fails(first.ref, first.cand, base, screened=True)

    def confirms(self, first: TrialData, *more: TrialData, base: Sequence[float] | None) -> bool:
        """Whether the further looks *more* (:attr:`further` of them) after a failing first look *first* fail the
        test, by the gate's rule (:meth:`~vramgate.engine.looks.LookRule.decide`)."""
        if len(more) != self.further:
            raise ValueError(f"{self.second!r} takes {self.further} further looks, got {len(more)}")
        looks = (first, *more)

        def judge(name: str, t: TrialData, screened: bool) -> bool:
            if t is first:
                return True  # asked of a first look that failed
            return bool(self.fails(t.ref, t.cand, base, screened=screened))

        def pool(taken: Sequence[TrialData]) -> TrialData:
            return dataclasses.replace(first, ref=[v for t in taken for v in t.ref],
                                       cand=[v for t in taken for v in t.cand])

        return self.rule.decide(lambda n: looks[n], judge, pool).failed

    def fails(self, ref: Sequence[float], cand: Sequence[float], base: Sequence[float] | None, *,
              screened: bool = False) -> list[str]:
        """Which checks a look with these rounds fails, as the end of the test judges them: ``in-run`` (at the
        screen where *screened*), ``noise`` (Note [noise guard]) and, against the stored ratios *base*,
        ``history``."""
        from vramgate.core.checks import check_baseline
        from vramgate.core.metrics import Metric, median
        from vramgate.core.stats import compare_pairs, detectable_pair_shift

        out = []
        tolerance = self.screen if screened and self.screen is not None else self.tolerance
        if compare_pairs(ref, cand, better="lower", tolerance=tolerance, alpha=self.alpha).regressed:
            out.append("in-run")
        if detectable_pair_shift(ref, cand, alpha=self.alpha) > self.tolerance:
            out.append("noise")
        if base:
            ratios = [c / r for r, c in zip(ref, cand, strict=True)]
            now = Metric("ratio", median(ratios), "ratio", "measured", samples=ratios,
                         tolerance=self.history_tolerance)
            then = Metric("ratio", median(base), "ratio", "measured", samples=list(base))
            if check_baseline(now, then)[0] == "regressed":
                out.append("history")
        return out


#: The most sets of further looks :func:`judge_group` tries per failing first look (evenly spread).
MAX_FURTHER = 100


def further_looks(others: Sequence[TrialData], rules: Rules) -> list[tuple[TrialData, ...]]:
    """The sets of further looks a failing first look is confirmed with, drawn from *others* (trials of fresh
    engines): each other trial (two looks), or each pair of them (three), at most :data:`MAX_FURTHER`."""
    import itertools

    sets = list(itertools.combinations(others, rules.further))
    return sets[::max(1, -(-len(sets) // MAX_FURTHER))]


def median_ratio(t: TrialData) -> float:
    """The median over *t*'s round pairs of candidate / reference."""
    from vramgate.core.metrics import median

    return median([c / r for r, c in zip(t.ref, t.cand, strict=True)])


def judge_group(group: Sequence[TrialData], rules: Rules, base: Sequence[float] | None) -> dict[str, Any]:
    """One profile's trials of one condition under *rules*: how often a first look fails (and which checks), and
    how often the test fails (a first look that fails, then the further looks of *rules*, here each other trial,
    or pair of other trials, in turn: fresh engines, as the gate takes them; :func:`further_looks`)."""
    from vramgate.core.stats import detectable_pair_shift

    first = [rules.first_fails(t, base) for t in group]
    verdicts = []
    for i, t in enumerate(group):
        if not first[i]:
            verdicts.append(0.0)
            continue
        sets = further_looks([u for j, u in enumerate(group) if j != i], rules)
        pooled = [rules.confirms(t, *more, base=base) for more in sets]
        verdicts.append(sum(pooled) / len(pooled) if pooled else 1.0)
    ratios = [median_ratio(t) for t in group]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    return {
        "trials": len(group),
        "ratio_range": [min(ratios), max(ratios)],
        "between_trials_sd": math.sqrt(sum((x - mean) ** 2 for x in logs) / max(1, len(logs) - 1)),
        "detectable_shift_max": max(detectable_pair_shift(t.ref, t.cand, alpha=rules.alpha) for t in group),
        "first_look_fails": sum(1 for f in first if f),
        "first_look_by_check": {c: sum(1 for f in first if c in f) for c in ("in-run", "noise", "history")},
        "fails": sum(verdicts),
        "fails_per_first_look": [bool(f) for f in first],
        "fails_per_trial": verdicts,
    }


#: Engine pairs a recorded baseline of a paired test pools (Note [baselines of two engine pairs] in
#: :mod:`vramgate.engine.looks`).
BASELINE_PAIRS = 2
#: The most baselines :func:`judge_against_own` tries per judged trial.
MAX_BASELINES = 40


def judge_against_own(group: Sequence[TrialData], unchanged: Sequence[TrialData], rules: Rules,
                      pairs: int = BASELINE_PAIRS) -> dict[str, Any]:
    """:func:`judge_group` against baselines made of *pairs* of the profile's *unchanged* trials but the judged one
    (other engine pairs' unchanged looks, pooled, as the gate records a baseline on this machine), each such
    baseline in turn (at most :data:`MAX_BASELINES`, evenly spread); a failing first look's further looks are the
    other trials but those. Counts are means over the baselines (fractions of trials)."""
    import itertools

    out = judge_group(group, rules, None)  # the descriptive figures; the counts are replaced below
    by = dict.fromkeys(out["first_look_by_check"], 0.0)
    per_first, per_fail = [], []
    for i, t in enumerate(group):
        combos = list(itertools.combinations([u for u in unchanged if u.index != t.index], pairs))
        bases = combos[::max(1, -(-len(combos) // MAX_BASELINES))]
        first_rate = fail_rate = 0.0
        for chosen in bases:
            base = [c / r for b in chosen for r, c in zip(b.ref, b.cand, strict=True)]
            first = rules.first_fails(t, base)
            if not first:
                continue
            first_rate += 1 / len(bases)
            for check in first:
                by[check] += 1 / len(bases)
            used = {t.index, *(b.index for b in chosen)}
            sets = further_looks([u for u in group if u.index not in used], rules)
            fail_rate += (sum(rules.confirms(t, *more, base=base) for more in sets) / len(sets) if sets else 1.0
                          ) / len(bases)
        if not bases:  # too few other unchanged trials: judged without a baseline
            first_rate, fail_rate = float(out["fails_per_first_look"][i]), out["fails_per_trial"][i]
        per_first.append(first_rate)
        per_fail.append(fail_rate)
    out.update(first_look_fails=sum(per_first), first_look_by_check=by, fails_per_first_look=per_first,
               fails=sum(per_fail), fails_per_trial=per_fail, history_baselines=len(unchanged),
               baseline_pairs=pairs)
    return out
