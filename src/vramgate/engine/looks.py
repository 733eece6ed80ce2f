"""The further looks of a paired measurement (Note [second look], Note [three looks]): when a first look's verdict
stands, when more looks with fresh engines are taken (after a failing first look, and where a baseline is recorded:
Note [baselines of two engine pairs]), and which samples are the verdict; each look's in-run check (:func:`look`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from vramgate.core.metrics import format_change
from vramgate.core.stats import compare_pairs
from vramgate.engine.paired import PairedDefaults

#: A look's further checks of one statistic (the noise guard, the stored baseline: ``Gate.paired_checks``):
#: ``also(statistic, reference samples, candidate samples)`` gives a line per check and whether it fails.
Also = Callable[[str, Sequence[float], Sequence[float]], Sequence[tuple[str, bool]]]


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
    whole life, can push one look past either on an unchanged tree (ratio 1.082, p 0.043, on a 2-core EPYC beside
    the other xdist worker; two clean-clone runs' ratios 0.948 and 1.069). So a first look that fails, or that is
    too noisy to judge (Note [noise guard] in :mod:`vramgate.core.stats`), is not the verdict: the test takes a
    second look with *fresh* engines (a new draw of each process's speed), in a quiet section
    (:mod:`vramgate.runtime.quiet`: the other workers finish the test they run and wait). With two looks at most
    (the GPU tier, the serving suite) the test fails only when the second look fails on its own *and* the pooled
    rounds of both fail, at the same tolerance and alpha: its rounds are the verdict when it passes, the pooled
    rounds when it fails. Pooling two alone is not enough: an engine pair that ran 16% slow for its whole life
    (seen once in 36 unchanged trials here) drags the pooled median past the tolerance with any second look; two
    fresh engine pairs that are both that slow by chance are rarer by the square. A false alarm needs three
    failing judgements, so no level is spent twice: its rate is at most the product of the two looks' rates. A
    first look that passes is the verdict: further looks cost time only on a failure.

    Note [three looks]: the price of two looks that must both fail is detection: a look that catches a +10% step
    regression with probability p makes a test that catches it with about p squared (0.89 gives 0.80; on a 2-core
    Xeon 72.5% of the planted +10% of `block-manager-watermark` failed the test, docs/calibration.md). Where the
    tier takes three looks (the CPU tier), the first look is screened at a lower tolerance (:attr:`PairedDefaults.
    screen`, 5% where the tolerance is 7.5%): one that passes it is the verdict; one that does not is followed by
    two looks with fresh engines, in a quiet section, and the verdict is the pooled rounds of all three, judged at
    the tolerance as any look is. The pooled median of three engine pairs stands one pair that runs slow for its
    whole life (a third of the rounds cannot carry the median), and a real regression, which is in every pair,
    meets the tolerance with the noise of three pairs instead of one. On the stored campaigns' trials (each trial
    a look of fresh engines; docs/calibration.md, "Three looks against two") it caught 98-100% of the planted
    +10% per profile on a 2-core Xeon where two looks caught 73-100%, and the estimated false alarms per gate run
    fell from 0.90% to 0.04%; on an AVX2-only EPYC it caught 78% and 86% where two looks caught 58% and 58%,
    with none of 20 unchanged tests failing either way. On the noisiest key's day (engine pairs 3.9% apart) it
    caught 76-84% where two looks caught 57-67%, but false alarms rose too (2.8% to 3.9% per gate run): neither
    rule meets 1% there. Further looks cost time only after a first look fails; the screen trips more often than
    the tolerance would on a profile whose true ratio sits near it (`kv-fp8` at 1.03 on the Xeon: 7 of 27 first
    looks against 3).

    Note [baselines of two engine pairs]: a run that records the test's baseline (*records*) takes two looks at
    least, whatever the first found, and stores their pooled rounds (three's, where the first look asked for
    them). A baseline from one engine pair carries that pair's
    offset into every later comparison, and a second look cannot clear it, since both looks meet the same
    baseline: on a 2-core Intel Xeon with AMX, taking each unchanged trial of the per-gate-run campaign as the
    baseline in turn, one engine pair that ran 8-9% fast made later unchanged looks fail the history check and their
    second looks confirm it (0.9% of `block-manager-min-recompute`'s tests); baselines of two trials' pooled
    rounds gave none, and 1.75% false alarms per gate run (estimated, 160 trials) became 0.90% (on the EPYC's trials
    5.3% became 2.8%), with the same detection (docs/calibration.md). It costs time only when a baseline is
    recorded.
    """
    stat = settings.stat
    screen = None if settings.screen is None else {stat: settings.screen}
    lines, ref, cand = looks_until_verdict(lambda n: {stat: take(n)}, {stat: settings.tolerance}, settings.alpha,
                                           also=also, records=records, screen=screen, looks=settings.looks)
    return ref[stat], cand[stat], lines


def looks_until_verdict(run: Callable[[int], Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                        tolerances: Mapping[str, float], alpha: float, *, also: Also | None = None,
                        records: Records | None = None, screen: Mapping[str, float] | None = None,
                        looks: int = 2
                        ) -> tuple[list[str], dict[str, list[float]], dict[str, list[float]]]:
    """Note [second look] and Note [three looks] for any paired measurement: ``run(n)`` takes look *n* (0, 1, 2)
    and gives, per statistic, the reference's and the candidate's samples; each statistic is judged in-run at its
    tolerance (:func:`look`; the first look at its *screen*, where given) and by *also*. A first look where no
    check fails is the verdict. Otherwise, with *looks* 2, a second look is taken: where it passes, its samples
    are the verdict (they pass); where it fails too, the pooled samples of both are (they fail where the pooled
    evidence still says so); with *looks* 3, two more looks are taken and the pooled samples of all three are the
    verdict. Where the first look's samples of a statistic would become a stored baseline (*records*), a second
    look is taken whatever the first found and the pooled samples are the verdict and the baseline (Note
    [baselines of two engine pairs]). The lines say what each look found; the verdict's samples come back."""
    if looks not in (2, 3):
        raise ValueError(f"a paired measurement takes 2 or 3 looks at most, not {looks}")
    lines: list[str] = []

    def label(name: str, key: str) -> str:
        return name if len(tolerances) == 1 else f"{name}, {key}"

    def judge(name: str, key: str, r: Sequence[float], c: Sequence[float], tolerance: float) -> bool:
        line, bad = look(label(name, key), r, c, tolerance=tolerance, alpha=alpha)
        lines.append(line)
        for more, failing in (also(key, r, c) if also else ()):
            lines.append(f"{label(name, key)}, {more}")
            bad = bad or failing
        return bad

    def pooled(taken: Sequence[Mapping[str, tuple[Sequence[float], Sequence[float]]]]
               ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        return ({k: [v for one in taken for v in one[k][0]] for k in tolerances},
                {k: [v for one in taken for v in one[k][1]] for k in tolerances})

    taken = [dict(run(0))]
    screened = screen is not None and any(screen.get(k, t) < t for k, t in tolerances.items())
    first = LOOK_NAMES[0] + (" (screened)" if screened else "")
    tripped = recording = False
    for key in tolerances:
        r, c = taken[0][key]
        tripped = judge(first, key, r, c, (screen or {}).get(key, tolerances[key])) or tripped
        recording = recording or (records is not None and records(key, r, c))
    if not tripped and not recording:  # the first look passed: the verdict
        return lines, {k: list(taken[0][k][0]) for k in tolerances}, {k: list(taken[0][k][1]) for k in tolerances}
    if recording:
        lines.append(f"recording a baseline: {'two more looks' if tripped and looks == 3 else 'a second look'} "
                     "(fresh engines) taken, and the pooled rounds of the looks are the verdict and the baseline "
                     "(Note [baselines of two engine pairs])")
    worse = False
    for n in range(1, looks if tripped else 2):
        name = LOOK_NAMES[n]
        taken.append(dict(run(n)))
        for key in tolerances:
            r, c = taken[n][key]
            worse = judge(name, key, r, c, tolerances[key]) or worse
    if looks == 2 and tripped and not recording and not worse:  # Note [second look]: the second clears the first
        lines.append("the verdict: the second look (fresh engines) passed; its rounds are the verdict")
        return lines, {k: list(taken[1][k][0]) for k in tolerances}, {k: list(taken[1][k][1]) for k in tolerances}
    ref, cand = pooled(taken)
    for key in tolerances:
        judge("pooled (the verdict)", key, ref[key], cand[key], tolerances[key])
    return lines, ref, cand


def look(name: str, ref: Sequence[float], cand: Sequence[float], *, tolerance: float, alpha: float
         ) -> tuple[str, bool]:
    """The in-run check of one look of a paired test (the test's own, :func:`~vramgate.core.checks.check_budget`'s
    rule): the line saying what it found, and whether the candidate is worse."""
    r = compare_pairs(ref, cand, better="lower", tolerance=tolerance, alpha=alpha)
    return (f"{name}: {len(ref)} pairs, median ratio {1 + r.change:.4g} ({format_change(r.change)}; candidate "
            f"median {r.candidate_median:.6g} vs reference {r.baseline_median:.6g}; tolerance {tolerance:.1%}, "
            f"signed-rank one-sided p = {r.p_worse:.2g}): {'worse' if r.regressed else 'not worse'}"), r.regressed
