"""The second look of a paired measurement (Note [second look]): when a first look's verdict stands, when a second
look with fresh engines is taken (after a failing first look, and where a baseline is recorded: Note [baselines of
two engine pairs]), and which samples are the verdict; each look's in-run check (:func:`look`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from vramgate.core.metrics import format_change
from vramgate.core.stats import compare_pairs
from vramgate.engine.paired import PairedDefaults

#: A look's further checks of one statistic (the noise guard, the stored baseline: ``Gate.paired_checks``):
#: ``also(statistic, reference samples, candidate samples)`` gives a line per check and whether it fails.
Also = Callable[[str, Sequence[float], Sequence[float]], Sequence[tuple[str, bool]]]


#: Whether a look's samples of a statistic become a stored baseline when the test passes
#: (``Gate.writes_paired_baseline``): ``records(statistic, reference samples, candidate samples)``.
Records = Callable[[str, Sequence[float], Sequence[float]], bool]


def confirmed_rounds(take: Callable[[int], tuple[list[float], list[float]]], settings: PairedDefaults, *,
                     also: Also | None = None, records: Records | None = None
                     ) -> tuple[list[float], list[float], list[str]]:
    """The reference's and the candidate's per-round statistic, with a second look when the first fails, and a
    line per look saying what it found. ``take(n)`` takes look *n* (0, then 1): :attr:`PairedDefaults.rounds`
    round pairs of fresh engines.

    Note [second look]: a paired check fails a candidate that is worse than its reference by more than the
    tolerance with a signed-rank test of the pairs clear at alpha (in-run), or whose ratios moved against the
    stored baseline (history).
    On two busy cores a stretch of load on one engine, or an engine process that is a few percent slower for its
    whole life, can push one look past either on an unchanged tree (ratio 1.082, p 0.043, on a 2-core EPYC beside
    the other xdist worker; two clean-clone runs' ratios 0.948 and 1.069). So a first look that fails, or that is
    too noisy to judge (Note [noise guard] in :mod:`vramgate.core.stats`), is not the verdict: the test takes a
    second look with *fresh* engines (a new draw of each process's speed), in a quiet section
    (:mod:`vramgate.runtime.quiet`: the other workers finish the test they run and wait). The test fails only
    when the second look fails on its own *and* the pooled rounds of both fail, at the same tolerance and alpha:
    its rounds are the verdict when it passes, the pooled rounds when it fails. Pooling alone is not enough: an
    engine pair that ran 16% slow for its whole life (seen once in 36 unchanged trials here) drags the pooled
    median past the tolerance with any second look; two fresh engine pairs that are both that slow by chance are
    rarer by the square. A false alarm needs three failing judgements, so no level is spent twice: its rate is at
    most the product of the two looks' rates. A real regression is in every engine pair. A first look that
    passes is the verdict: the second look costs time only on a failure.

    Note [baselines of two engine pairs]: a run that records the test's baseline (*records*) takes both looks
    whatever the first found, and stores their pooled rounds. A baseline from one engine pair carries that pair's
    offset into every later comparison, and a second look cannot clear it, since both looks meet the same
    baseline: on a 2-core Intel Xeon with AMX, taking each unchanged trial of the per-gate-run campaign as the
    baseline in turn, one engine pair that ran 8-9% fast made later unchanged looks fail the history check and their
    second looks confirm it (0.9% of `block-manager-min-recompute`'s tests); baselines of two trials' pooled
    rounds gave none, and 1.75% false alarms per gate run (estimated, 160 trials) became 0.90% (on the EPYC's trials
    5.3% became 2.8%), with the same detection (docs/calibration.md). It costs time only when a baseline is
    recorded.
    """
    stat = settings.stat
    lines, ref, cand = looks_until_verdict(lambda n: {stat: take(n)}, {stat: settings.tolerance}, settings.alpha,
                                           also=also, records=records)
    return ref[stat], cand[stat], lines


def looks_until_verdict(run: Callable[[int], Mapping[str, tuple[Sequence[float], Sequence[float]]]],
                        tolerances: Mapping[str, float], alpha: float, *, also: Also | None = None,
                        records: Records | None = None
                        ) -> tuple[list[str], dict[str, list[float]], dict[str, list[float]]]:
    """Note [second look] for any paired measurement: ``run(n)`` takes look *n* (0, then 1) and gives, per
    statistic, the reference's and the candidate's samples; each statistic is judged in-run at its tolerance
    (:func:`look`) and by *also*. A first look where no check fails is the verdict; otherwise a second look is
    taken: where it passes, its samples are the verdict (they pass); where it fails too, the pooled samples of
    both are (they fail where the pooled evidence still says so). Where the first look's samples of a statistic
    would become a stored baseline (*records*), the second look is taken whatever the first found and the pooled
    samples of both are the verdict (Note [baselines of two engine pairs]). The lines say what each look found;
    the verdict's samples come back."""
    ref: dict[str, list[float]] = {k: [] for k in tolerances}
    cand: dict[str, list[float]] = {k: [] for k in tolerances}
    lines: list[str] = []

    def label(name: str, key: str) -> str:
        return name if len(tolerances) == 1 else f"{name}, {key}"

    def judge(name: str, key: str, r: Sequence[float], c: Sequence[float]) -> bool:
        line, bad = look(label(name, key), r, c, tolerance=tolerances[key], alpha=alpha)
        lines.append(line)
        for more, failing in (also(key, r, c) if also else ()):
            lines.append(f"{label(name, key)}, {more}")
            bad = bad or failing
        return bad

    looks: list[dict[str, tuple[Sequence[float], Sequence[float]]]] = []
    recording = False
    for n, name in enumerate(("first look", "second look")):
        looks.append(dict(run(n)))
        worse = False
        for key in tolerances:
            r, c = looks[n][key]
            worse = judge(name, key, r, c) or worse
            recording = recording or (not n and records is not None and records(key, r, c))
        if recording and not n:
            lines.append("recording a baseline: a second look (fresh engines) is taken, and the pooled rounds of "
                         "both are the verdict and the baseline (Note [baselines of two engine pairs])")
            continue
        if not worse and not recording:  # the first look passed, or the second did and clears it
            if n:
                lines.append("the verdict: the second look (fresh engines) passed; its rounds are the verdict")
            return lines, {k: list(looks[n][k][0]) for k in tolerances}, {k: list(looks[n][k][1]) for k in tolerances}
    for key in tolerances:
        ref[key] = [*looks[0][key][0], *looks[1][key][0]]
        cand[key] = [*looks[0][key][1], *looks[1][key][1]]
        judge("pooled (the verdict)", key, ref[key], cand[key])
    return lines, ref, cand


def look(name: str, ref: Sequence[float], cand: Sequence[float], *, tolerance: float, alpha: float
         ) -> tuple[str, bool]:
    """The in-run check of one look of a paired test (the test's own, :func:`~vramgate.core.checks.check_budget`'s
    rule): the line saying what it found, and whether the candidate is worse."""
    r = compare_pairs(ref, cand, better="lower", tolerance=tolerance, alpha=alpha)
    return (f"{name}: {len(ref)} pairs, median ratio {1 + r.change:.4g} ({format_change(r.change)}; candidate "
            f"median {r.candidate_median:.6g} vs reference {r.baseline_median:.6g}; tolerance {tolerance:.1%}, "
            f"signed-rank one-sided p = {r.p_worse:.2g}): {'worse' if r.regressed else 'not worse'}"), r.regressed
