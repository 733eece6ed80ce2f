"""Paired A/B under load: a reference and a candidate server, the same bursts in alternating order, judged
in-run with a second look before a failure.

Note [paired bursts]: as with engines (Note [paired latency] in :mod:`vramgate.engine.paired`), the speed of
a shared machine drifts by more than the regressions worth catching, so a profile is judged against the
unpatched server up at the same time: both serve the same burst (same prompts, same rate, same seed), one after
the other in a seeded random order, round after round; the ratio of the burst's median TPOT (and TTFT),
candidate over reference, cancels what both saw.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from vramgate.engine.load import Load, LoadResult, run_plan
from vramgate.engine.looks import Also, looks_until_verdict
from vramgate.engine.server import ApiServer


@dataclass
class PairedBursts:
    """The reference's and the candidate's results of each round (Note [paired bursts])."""

    reference: list[LoadResult]
    candidate: list[LoadResult]
    order: list[str]
    """``"ab"`` (reference first) or ``"ba"`` per round."""

    def medians(self, latency: str) -> tuple[list[float], list[float]]:
        """Each round's median *latency* of the reference and of the candidate. TPOT's is the median over the
        requests the client read as they streamed (Note [streams in one piece] in :mod:`vramgate.engine.load`: a
        request read in one piece has a TPOT of microseconds, and a burst of them a median of nothing the server
        did); a round where either side has none is left out of both."""
        if latency != "tpot":
            return [r.median(latency) for r in self.reference], [r.median(latency) for r in self.candidate]
        ref: list[float] = []
        cand: list[float] = []
        for a, b in zip(self.reference, self.candidate, strict=True):
            streamed = a.streamed_tpot(), b.streamed_tpot()
            if all(streamed):
                ref.append(statistics.median(streamed[0]))
                cand.append(statistics.median(streamed[1]))
        return ref, cand


def run_paired_bursts(reference: ApiServer, candidate: ApiServer, burst: Load, rounds: int, run_dir: Path, *,
                      seed: int = 0, warmup: int = 1) -> PairedBursts:
    """*rounds* rounds of *burst* on both servers (Note [paired bursts]): each round's burst has its own seed
    (the same on both sides) and a seeded random order; *warmup* rounds run first and are left out."""
    rng = random.Random(seed)
    items: list[tuple[int, Load, str]] = []
    order = []
    for n in range(warmup + rounds):
        load = replace(burst, seed=burst.seed + n)
        first = rng.choice("ab")
        if n >= warmup:
            order.append("ab" if first == "a" else "ba")
        sides = (0, 1) if first == "a" else (1, 0)
        items += [(side, load, f"round-{n}-{'ab'[side]}") for side in sides]
    run = run_plan(items, [reference, candidate], run_dir)
    return PairedBursts(run.results[0][warmup:], run.results[1][warmup:], order)



@dataclass(frozen=True)
class PairedLoadSettings:
    """How the paired A/B under load runs and judges, per tier (docs/online-serving.md)."""

    rounds: int
    """Rounds of a look (each a burst on both servers)."""
    tolerance: dict[str, float]
    """By latency (``tpot``, ``ttft``): the candidate's per-burst median worse than the reference's by more than
    this, with a U test clear at :attr:`alpha`, fails."""
    alpha: float
    history_tolerance: dict[str, float]
    """By latency: the per-burst ratios moving by more than this against the stored baseline fail."""

    def judge(self, run: Callable[[int, int], PairedBursts], *, also: Also | None = None
              ) -> tuple[list[str], dict[str, list[float]], dict[str, list[float]]]:
        """Run a look (``run(rounds, seed)``), and a second one when the first finds a latency worse or *also*
        (the noise guard, the stored baseline) fails (Note [second look] in :mod:`vramgate.engine.looks`: the
        verdict is then the pooled rounds'); the lines saying what each look found, and the reference's and
        candidate's per-burst medians by latency."""
        def one_look(n: int) -> dict[str, tuple[list[float], list[float]]]:
            bursts = run(self.rounds, n)
            return {latency: bursts.medians(latency) for latency in self.tolerance}

        return looks_until_verdict(one_look, self.tolerance, self.alpha, also=also)


#: CPU (2 cores): bursts of 32 requests at concurrency 8, 64 + 32 tokens; TPOT at 10% / alpha 0.05 with a second
#: look (thinly calibrated: overlapping windows of two runs); TTFT under load is queueing and stalls on 2 cores, with
#: no signal from a planted delay, so it is judged at 100% only. GPU: not measured; the first runs on a GPU class
#: calibrate it. The measurements: docs/online-serving.md, "Paired A/B under load".
PAIRED_LOAD_SETTINGS = {
    "cpu": PairedLoadSettings(rounds=20, tolerance={"tpot": 0.10, "ttft": 1.0}, alpha=0.05,
                              history_tolerance={"tpot": 0.15, "ttft": 1.0}),
    "gpu": PairedLoadSettings(rounds=20, tolerance={"tpot": 0.05, "ttft": 0.25}, alpha=0.01,
                              history_tolerance={"tpot": 0.05, "ttft": 0.25}),
}


def paired_settings(tier: str) -> PairedLoadSettings:
    """The paired A/B under load's settings on the ``cpu`` or ``gpu`` engine tier."""
    if tier not in PAIRED_LOAD_SETTINGS:
        raise ValueError(f"unknown engine tier {tier!r}; known: {', '.join(PAIRED_LOAD_SETTINGS)}")
    return PAIRED_LOAD_SETTINGS[tier]
