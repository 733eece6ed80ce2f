"""The further looks of a paired measurement (Note [second look], Note [three looks]): when a first look's verdict
stands, when more looks with fresh engines are taken (after a failing first look, and where a baseline is recorded:
Note [baselines of two engine pairs]), and which samples are the verdict; each look's in-run check (:func:`look`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from vramgate.core.metrics import format_change
from vramgate.core.stats import compare_pairs
from vramgate.engine.paired import PairedDefaults

#: A look's further checks of one statistic (the noise guard, the stored baseline: ``Gate.paired_checks``):
#: ``also(statistic, reference samples, candidate samples)`` gives a line per check and whether it fails.
Also = Callable[[str, Sequence[float], Sequence[float]], Sequence[tuple[str, bool]]]


#: A look's samples, as the caller of :meth:`LookRule.decide` keeps them.
L = TypeVar("L")


#: The looks' names, by number (``run(n)``/``take(n)`` takes ``LOOK_NAMES[n]``).
LOOK_NAMES = ("first look", "second look", "third look")


#: Whether a look's samples of a statistic become a stored baseline when the test passes
#: (``Gate.writes_paired_baseline``): ``records(statistic, reference samples, candidate samples)``.
Records = Callable[[str, Sequence[float], Sequence[float]], bool]


def confirmed_rounds(take: Callable[[int], tuple[list[float], list[float]]], settings: PairedDefaults, *,
                     also: Also | None = None, records: Records | None = None
                     ) -> tuple[list[float], list[float], list[str]]:
    """The reference's and the candidate's per-round statistic, with further looks when the first fails, and a
    line per look saying what it found. ``take(n)`` takes look *n* (0, 1, then 2): :attr:`PairedDefaults.rounds`
    round pairs of fresh engines. *settings* say how many looks at most and at what tolerance the first is
    screened (Note [three looks]; Note [second look] where they take two).

    Note [second look]: a paired check fails a candidate that is worse than its reference by more than the
    tolerance with a signed-rank test of the pairs clear at alpha (in-run), or whose ratios moved against the
    stored baseline (history).
    On two busy cores a stretch of load on one engine, or an engine process that is a few percent slower for its
    whole life, can push one look past either on an unchanged tree. So a first look that fails, or that is too
    noisy to judge (Note [noise guard] in :mod:`vramgate.core.stats`), is not the verdict: the test takes a
    second look with *fresh* engines (a new draw of each process's speed), in a quiet section
    (:mod:`vramgate.runtime.quiet`: the other workers finish the test they run and wait). With two looks at most
    (the GPU tier, the serving suite) the test fails only when the second look fails on its own *and* the pooled
    rounds of both fail, at the same tolerance and alpha: its rounds are the verdict when it passes, the pooled
    rounds when it fails. Pooling two alone is not enough: one engine pair that runs slow for its whole life drags
    the pooled median past the tolerance with any second look; two fresh engine pairs that are both that slow by
    chance are rarer by the square. A false alarm needs three failing judgements, so no level is spent twice: its
    rate is at most the product of the two looks' rates. A first look that passes is the verdict: further looks
    cost time only on a failure. The measurements: docs/calibration.md, "The second look and the noise guard".

    Note [three looks]: the price of two looks that must both fail is detection: a look that catches a step
    regression with probability p makes a test that catches it with about p squared. Where the tier takes three
    looks (the CPU tier), the first look is screened at a lower tolerance (:attr:`PairedDefaults.screen`): one
    that passes it is the verdict; one that does not is followed by two looks with fresh engines, in a quiet
    section, and the verdict is the pooled rounds of all three, judged at the tolerance as any look is. The pooled
    median of three engine pairs stands one pair that runs slow for its whole life (a third of the rounds cannot
    carry the median), and a real regression, which is in every pair, meets the tolerance with the noise of three
    pairs instead of one. Further looks cost time only after a first look fails; the screen trips more often than
    the tolerance would on a profile whose true ratio sits near it. Detection, false alarms and time under both
    rules, per machine: docs/calibration.md, "Three looks against two".

    Note [baselines of two engine pairs]: a run that records the test's baseline (*records*) takes two looks at
    least, whatever the first found, and stores their pooled rounds (three's, where the first look asked for
    them). A baseline from one engine pair carries that pair's offset into every later comparison, and a second
    look cannot clear it, since both looks meet the same baseline; in a baseline of two engine pairs one pair's
    offset carries half the rounds. It costs time only when a baseline is recorded. The campaign that measured it:
    docs/calibration.md, "On a 2-core Intel Xeon with AMX".
    """
    stat = settings.stat
    screen = None if settings.screen is None else {stat: settings.screen}
    lines, ref, cand = looks_until_verdict(lambda n: {stat: take(n)}, {stat: settings.tolerance}, settings.alpha,
                                           also=also, records=records, screen=screen, looks=settings.looks)
    return ref[stat], cand[stat], lines


@dataclass(frozen=True)
class Decided(Generic[L]):
    """What :meth:`LookRule.decide` found: the samples that are the verdict, and whether the verdict fails (as the
    rule judged it on the way; the end of a gate test judges the verdict's samples again)."""

    verdict: L
    failed: bool


@dataclass(frozen=True)
class LookRule:
    """When a paired measurement's first look is its verdict, which further looks of fresh engines it takes, and
    which samples decide (Note [second look], Note [three looks], Note [baselines of two engine pairs]): the one rule
    the gate's paired tests (:func:`looks_until_verdict`) and the paired calibration campaigns
    (``vramgate calibrate paired``) apply. Its thresholds are the caller's judge's: a tier's
    :class:`~vramgate.engine.paired.PairedDefaults`."""

    looks: int = 2
    """The most looks (2 or 3)."""

    def __post_init__(self) -> None:
        if self.looks not in (2, 3):
            raise ValueError(f"a paired measurement takes 2 or 3 looks at most, not {self.looks}")

    @classmethod
    def of(cls, settings: PairedDefaults) -> LookRule:
        """The rule of a tier's settings."""
        return cls(settings.looks)

    @property
    def further(self) -> int:
        """The looks taken after a first that fails."""
        return self.looks - 1

    def describe(self, screen: float | None = None) -> str:
        """The rule in words (*screen*: the first look's tolerance, where it is screened)."""
        first = "" if screen is None else f"; first look screened at {screen:.1%}"
        if self.looks == 3:
            return f"three looks{first}, the pooled rounds of all three the verdict"
        return f"two looks{first}, the second deciding by 'both'"  # 'both': the second look and the pooled rounds

    def decide(self, take: Callable[[int], L], judge: Callable[[str, L, bool], bool],
               pool: Callable[[Sequence[L]], L], *, records: Callable[[L], bool] | None = None,
               say: Callable[[str], None] | None = None) -> Decided[L]:
        """Take and judge looks until the verdict. ``take(n)`` takes look *n* (0, 1, 2: fresh engines each);
        ``judge(name, look, screened)`` says whether a look (or the pooled samples, named ``pooled (the
        verdict)``) fails, the first look at its screen (*screened*); ``pool(looks)`` pools looks' samples;
        ``records(first)``: whether the first look's samples would become a stored baseline (then a second look is
        taken whatever the first found, and the pooled samples are the verdict and the baseline). *say* hears
        what the rule decided on the way, in words.

        A first look that passes (and records nothing) is the verdict. After one that fails: with two looks, a
        second; where it passes, its samples are the verdict (they pass), else the pooled samples of both (judged
        again); with three, two more, and the pooled samples of all three are the verdict."""
        taken = [take(0)]
        tripped = judge(LOOK_NAMES[0], taken[0], True)
        recording = records is not None and records(taken[0])
        if not tripped and not recording:
            return Decided(taken[0], False)
        if recording and say is not None:
            say(f"recording a baseline: {'two more looks' if tripped and self.looks == 3 else 'a second look'} "
                "(fresh engines) taken, and the pooled rounds of the looks are the verdict and the baseline "
                "(Note [baselines of two engine pairs])")
        worse = False
        for n in range(1, self.looks if tripped else 2):
            taken.append(take(n))
            worse = judge(LOOK_NAMES[n], taken[n], False) or worse
        if self.looks == 2 and tripped and not recording and not worse:  # the second clears the first
            if say is not None:
                say("the verdict: the second look (fresh engines) passed; its rounds are the verdict")
            return Decided(taken[1], False)
        pooled = pool(taken)
        return Decided(pooled, judge(POOLED, pooled, False))


#: The name :meth:`LookRule.decide` judges the pooled samples under.
POOLED = "pooled (the verdict)"


def looks_until_verdict(run: Callable[[int], Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                        tolerances: Mapping[str, float], alpha: float, *, also: Also | None = None,
                        records: Records | None = None, screen: Mapping[str, float] | None = None,
                        looks: int = 2
                        ) -> tuple[list[str], dict[str, list[float]], dict[str, list[float]]]:
    """Note [second look] and Note [three looks] for any paired measurement, by :class:`LookRule`: ``run(n)`` takes
    look *n* (0, 1, 2) and gives, per statistic, the reference's and the candidate's samples; each statistic is
    judged in-run at its tolerance (:func:`look`; the first look at its *screen*, where given) and by *also*; a
    look fails where any statistic does. *records*: whether a first look's samples of a statistic would become a
    stored baseline. The lines say what each look found; the verdict's samples come back."""
    rule = LookRule(looks)
    lines: list[str] = []
    screened = screen is not None and any(screen.get(k, t) < t for k, t in tolerances.items())
    Look = dict[str, tuple[list[float], list[float]]]

    def judge(name: str, one: Look, first: bool) -> bool:
        if first and screened:
            name += " (screened)"
        bad = False
        for key, (r, c) in one.items():
            label = name if len(tolerances) == 1 else f"{name}, {key}"
            line, failing = look(label, r, c, tolerance=(screen or {}).get(key, tolerances[key]) if first
                                 else tolerances[key], alpha=alpha)
            lines.append(line)
            for more, also_failing in (also(key, r, c) if also else ()):
                lines.append(f"{label}, {more}")
                failing = failing or also_failing
            bad = bad or failing
        return bad

    def take(n: int) -> Look:
        got = run(n)
        return {k: (list(got[k][0]), list(got[k][1])) for k in tolerances}

    def pool(taken: Sequence[Look]) -> Look:
        return {k: ([v for one in taken for v in one[k][0]], [v for one in taken for v in one[k][1]])
                for k in tolerances}

    decided = rule.decide(take, judge, pool, say=lines.append,
                          records=None if records is None else
                          lambda one: any(records(k, r, c) for k, (r, c) in one.items()))
    return (lines, {k: list(v[0]) for k, v in decided.verdict.items()},
            {k: list(v[1]) for k, v in decided.verdict.items()})


def look(name: str, ref: Sequence[float], cand: Sequence[float], *, tolerance: float, alpha: float
         ) -> tuple[str, bool]:
    """The in-run check of one look of a paired test (the test's own, :func:`~vramgate.core.checks.check_budget`'s
    rule): the line saying what it found, and whether the candidate is worse."""
    r = compare_pairs(ref, cand, better="lower", tolerance=tolerance, alpha=alpha)
    return (f"{name}: {len(ref)} pairs, median ratio {1 + r.change:.4g} ({format_change(r.change)}; candidate "
            f"median {r.candidate_median:.6g} vs reference {r.baseline_median:.6g}; tolerance {tolerance:.1%}, "
            f"signed-rank one-sided p = {r.p_worse:.2g}): {'worse' if r.regressed else 'not worse'}"), r.regressed
