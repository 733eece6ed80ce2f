"""The paired latency tests' precision per gate run, in the pre-merge configuration (two busy workers).

Note [per-gate-run campaign]: ``vramgate calibrate`` measures one paired look at a time on an otherwise idle
machine. The pre-merge gate runs its paired latency tests (``suites/latency/test_paired_latency.py``, one per
profile of the suite ``latency``) on one xdist worker while the other worker runs the rest of the gate. This
campaign reproduces that: ``run`` keeps the rest of the pre-merge gate running in a loop as the other worker
(``--busy``) and, beside it, takes trials of each profile's paired test as the gate takes them (fresh engines,
the tier's rounds, the same workload and seeds), unchanged and with a planted delay per engine step in the
candidate (Note [planted delay]). Every trial's rounds go to ``trials.jsonl`` as they come, so an interrupted
campaign keeps what it measured.

``analyze`` (pure: :func:`analyze`) applies the gate's own rules to the trials (the in-run look, the noise
guard, the ratio against a stored baseline and against the campaign's other trials, and the further looks of
Note [three looks] or Note [second look] in :mod:`vramgate.engine.looks`, taken from other trials: fresh pairs of
engines, as the gate takes them; a campaign's trials serve either rule, :class:`Rules`) and counts false alarms
per gate run (any profile's test failing on an unchanged tree) and detections per profile, with exact
(Clopper-Pearson) 95% bounds.

Longer than 400 lines: the campaign, the rules it applies and the noise model that extrapolates them are one
measurement, kept in one place so that the figures in docs/calibration.md come from one module.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vramgate.engine.paired import PairedDefaults

#: The planted delay a detection trial gives the candidate's engine steps.
PLANTED = 0.10
#: A trial's conditions: its name and the delay planted in the candidate.
CONDITIONS = (("unchanged", 0.0), ("delay-10%", PLANTED))
#: Round pairs per value of the step floor (Note [step floor]).
FLOOR_GROUP = 5


def floor_sums(series: Sequence[Sequence[float]], group: int = FLOOR_GROUP) -> list[float]:
    """Per *group* consecutive *series* (each a round's step durations, position by position the same work), the
    sum over the positions of the shortest duration at each; a position some series lack counts with those that
    have it. ``ValueError`` when the series do not split into groups of *group* or one is empty.

    Note [step floor]: an engine runs the same steps in the same order every round (64 in every round of 134
    trials: the offline scheduler does not depend on time), and a step's duration is its work plus what the
    machine took from it meanwhile: on a 2-core CPU single steps ran 2-4x their usual time now and then. The step
    floor of 5 rounds is the workload's engine time with the least taken. On the same 104 trials beside the other
    xdist worker its look saw a planted +10% with 1.2-1.3x the signal to noise of each round's median step, on
    every CPU profile, but a look gives 6 pairs instead of 30, and with the gate's rules (signed-rank test, noise
    guard, second look) it caught no more and alarmed no less (docs/calibration.md): no tier gates it, and a
    campaign takes it with ``run --stat step_floor``."""
    if group < 1 or len(series) % group:
        raise ValueError(f"{len(series)} series do not split into groups of {group}")
    if not all(series):
        raise ValueError("a series has no samples")
    out = []
    for start in range(0, len(series), group):
        block = series[start:start + group]
        out.append(sum(min(s[k] for s in block if len(s) > k) for k in range(max(len(s) for s in block))))
    return out


def _binomial_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def _solve(f: Any) -> float:
    """The p in [0, 1] where the increasing-then-false predicate *f* turns false (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) else (lo, mid)
    return (lo + hi) / 2


def upper_bound(hits: int, trials: int, confidence: float = 0.95) -> float:
    """The exact (Clopper-Pearson) one-sided upper *confidence* bound of a rate seen *hits* times in *trials*: 3/n
    for no hit at 95% (the rule of three)."""
    if trials <= 0:
        return math.nan
    if hits >= trials:
        return 1.0
    return _solve(lambda p: _binomial_cdf(hits, trials, p) > 1 - confidence)


def lower_bound(hits: int, trials: int, confidence: float = 0.95) -> float:
    """The exact one-sided lower *confidence* bound of a rate seen *hits* times in *trials*."""
    if trials <= 0:
        return math.nan
    if hits <= 0:
        return 0.0
    return _solve(lambda p: 1 - _binomial_cdf(hits - 1, trials, p) < 1 - confidence)


def show_rate(hits: int, trials: int, *, bound: str = "upper") -> str:
    """``hits/trials (rate; 95% upper bound B)`` (or lower bound, for a detection)."""
    if not trials:
        return "no trials"
    b = upper_bound(hits, trials) if bound == "upper" else lower_bound(hits, trials)
    return f"{hits}/{trials} ({hits / trials:.1%}; 95% {bound} bound {b:.1%})"


@dataclass(frozen=True)
class TrialData:
    """One trial of one profile's paired test: a statistic's samples (``step``: each round's median engine step, the
    gate's; ``step_floor``: Note [step floor]), reference and candidate."""

    profile: str
    condition: str
    """``unchanged`` or ``delay-10%``."""
    index: int
    ref: list[float]
    cand: list[float]
    busy: bool
    stat: str = "step"
    """The statistic of ``ref`` and ``cand`` (trials before it was recorded took ``step``)."""
    together: bool | None = None
    """Whether both engines ran each pair's rounds at once (Note [rounds together]); ``None``: not recorded."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialData:
        """A trial from a line of ``trials.jsonl``."""
        together = data.get("together")
        return cls(str(data["profile"]), str(data["condition"]), int(data["index"]),
                   [float(v) for v in data["ref"]], [float(v) for v in data["cand"]], bool(data.get("busy", True)),
                   str(data.get("stat", "step")), None if together is None else bool(together))


def load_trials(paths: Sequence[Path]) -> list[TrialData]:
    """Every trial in the ``trials.jsonl`` of each campaign folder in *paths*."""
    out = []
    for folder in paths:
        for n, line in enumerate((folder / "trials.jsonl").read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    out.append(TrialData.from_json(json.loads(line)))
                except (KeyError, TypeError, ValueError) as exc:
                    raise SystemExit(f"{folder / 'trials.jsonl'}:{n}: not a trial ({exc!r})") from None
    return out


# -- running -------------------------------------------------------------------------------------------------


def _busy_loop(root: Path, out: Path, stop: Path) -> Any:
    """The other worker: the rest of the pre-merge gate (without the paired latency tests), run after run, in its
    own process group (:func:`vramgate.runtime.process.launch`; ``busy.log`` says how each run ended)."""
    from vramgate.runtime import process

    script = (
        "import pathlib, subprocess, sys\n"
        f"stop, out = pathlib.Path({str(stop)!r}), pathlib.Path({str(out)!r})\n"
        "n = 0\n"
        "while not stop.exists():\n"
        "    with open(out / f'busy-{n}.log', 'wb') as log:\n"
        "        rc = subprocess.call([sys.executable, '-m', 'pytest', 'suites', '-m', 'not gate_nightly',\n"
        "                              '-p', 'no:xdist', '-p', 'no:cacheprovider', '-q',\n"
        "                              '--deselect', 'suites/latency/test_paired_latency.py',\n"
        "                              '--gate-report', str(out / f'busy-report-{n}'),\n"
        "                              '--basetemp', str(out / f'busy-tmp-{n}')],\n"
        "                             stdout=log, stderr=subprocess.STDOUT)\n"
        "    print(f'run {n}: exit {rc}', flush=True)\n"
        "    n += 1\n"
    )
    return process.launch([sys.executable, "-c", script], out / "busy.log", env=dict(os.environ), cwd=root)


def run(root: Path, out: Path, minutes: float, profiles: Sequence[str], busy: bool, rounds: int | None,
        quiet_looks: bool = False, together: bool | None = None,
        conditions: Sequence[str] = ("unchanged", "delay-10%"), stat: str | None = None,
        both_ways: bool = False) -> None:
    """Trials until *minutes* have passed (see the module's docstring), appended to ``out/trials.jsonl``; of the
    *conditions* named (:data:`CONDITIONS`) only; of *stat* (default the tier's; ``step_floor``: Note [step
    floor]); *both_ways*: each profile and condition's trial is taken with rounds together and then one after the
    other, back to back, so that the two ways of Note [rounds together] meet the same host state (an A/B in turns
    that ``analyze --together`` reads one way at a time)."""
    import pytest

    from vramgate.engine import engine_tier
    from vramgate.engine.paired import PairedEngines, latency_spec, paired_defaults
    from vramgate.profiles import find_profile
    from vramgate.runtime import quiet
    from vramgate.testing import runnable_candidate

    settings = paired_defaults(engine_tier())
    n_rounds = rounds or settings.rounds
    if both_ways and together is not None:
        raise ValueError("both ways takes trials together and one after the other: give no together setting")
    ways = (True, False) if both_ways else (settings.together if together is None else together,)
    stat = stat or settings.stat
    out.mkdir(parents=True, exist_ok=True)
    stop = out / "stop"
    stop.unlink(missing_ok=True)
    # The other worker and the trials share one session lock, as a gate session's workers do (Note [quiet sections]).
    os.environ[quiet.QUIET_LOCK_ENV] = str(out / "quiet.lock")
    other = _busy_loop(root, out, stop) if busy else None
    # A campaign stopped by a signal still stops its other worker (the finally below), however many come.
    def stop_here(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop_here)
    reference = latency_spec("tiny-llama")
    candidates = {}
    for name in profiles:  # as the test takes its candidate: a profile this machine cannot run is left out
        try:
            candidates[name] = runnable_candidate(reference, find_profile(root, name), use_mla=False)
        except pytest.skip.Exception as exc:
            print(f"{name}: left out: {exc}", flush=True)
    deadline = time.monotonic() + minutes * 60
    index = sum(1 for _ in (out / "trials.jsonl").open()) if (out / "trials.jsonl").exists() else 0
    cycle = 0
    try:
        while time.monotonic() < deadline:
            cycle += 1
            for condition, delay in [(c, d) for c, d in CONDITIONS if c in conditions]:
                for name, candidate in candidates.items():
                    if delay:
                        candidate = candidate.replace(env={"VRAMGATE_PLANT_DELAY": str(delay)})
                    for together in ways if cycle % 2 else ways[::-1]:  # neither way always goes first
                        run_dir = out / "engines" / f"{index}"
                        t0 = time.time()
                        with contextlib.ExitStack() as stack:
                            got = stack.enter_context(quiet.quiet()) if quiet_looks else None
                            engines = stack.enter_context(PairedEngines(reference, candidate, root, run_dir,
                                                                        cache_root=out / "cache"))
                            result = engines.run(n_rounds, seed=index, together=together)
                        if stat == "step_floor":
                            ref = floor_sums([r.steps_s for r in result.a])
                            cand = floor_sums([r.steps_s for r in result.b])
                        else:
                            ref, cand = result.stats(stat)
                        line = {"profile": name, "condition": condition, "index": index, "ref": ref, "cand": cand,
                                "stat": stat,
                                "ref_steps": [r.steps_s for r in result.a], "cand_steps": [r.steps_s for r in result.b],
                                "busy": busy, "started": t0, "seconds": time.time() - t0, "isa": os.environ.get(
                                    "VRAMGATE_CPU_ISA", ""), "quiet": bool(got and got.quiet),
                                "waited_s": got.waited_s if got else 0.0, "together": together}
                        with (out / "trials.jsonl").open("a", encoding="utf-8") as f:
                            f.write(json.dumps(line) + "\n")
                        way = "together" if together else "one after the other"
                        print(f"trial {index}: {name} {condition} ({way}): {time.time() - t0:.1f} s", flush=True)
                        index += 1
                        if time.monotonic() >= deadline:
                            return
    finally:
        stop.write_text("stop")
        if other is not None:
            from vramgate.runtime import process

            process.kill_group(other)


# -- analysis ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rules:
    """The paired test's rules at one setting (the gate's: :data:`~vramgate.engine.paired.PAIRED_DEFAULTS`)."""

    tolerance: float
    alpha: float
    history_tolerance: float
    second: str = "both"
    """How the looks after a failing first decide (Note [second look], Note [three looks] in
    :mod:`vramgate.engine.looks`): ``pooled`` (the pooled rounds of two fail), ``alone`` (the second look's own
    rounds fail), ``both`` (both: the rule of two looks) or ``three`` (two more looks; the pooled rounds of all
    three fail)."""
    screen: float | None = None
    """The first look's in-run tolerance (Note [three looks]); ``None``: :attr:`tolerance`."""

    @property
    def further(self) -> int:
        """The looks taken after a first that fails."""
        return 2 if self.second == "three" else 1

    def describe(self) -> str:
        """The rule in words, for a report's header."""
        first = "" if self.screen is None else f"; first look screened at {self.screen:.1%}"
        if self.second == "three":
            return f"three looks{first}, the pooled rounds of all three the verdict"
        return f"two looks{first}, the second deciding by {self.second!r}"

    @classmethod
    def of(cls, settings: PairedDefaults) -> Rules:
        """The rules of a tier's :class:`~vramgate.engine.paired.PairedDefaults`."""
        return cls(settings.tolerance, settings.alpha, settings.history_tolerance,
                   "three" if settings.looks == 3 else "both", settings.screen)

    def first_fails(self, first: TrialData, base: Sequence[float] | None) -> list[str]:
        """Which checks a first look fails (its in-run check at the screen)."""
        return self.fails(first.ref, first.cand, base, screened=True)

    def confirms(self, first: TrialData, *more: TrialData, base: Sequence[float] | None) -> bool:
        """Whether the further looks *more* (:attr:`further` of them) after a failing first look *first* fail the
        test."""
        if len(more) != self.further:
            raise ValueError(f"{self.second!r} takes {self.further} further looks, got {len(more)}")
        looks = (first, *more)
        pooled = bool(self.fails([v for t in looks for v in t.ref], [v for t in looks for v in t.cand], base))
        if self.second in ("three", "pooled"):
            return pooled
        alone = bool(self.fails(more[0].ref, more[0].cand, base))
        return {"alone": alone, "both": pooled and alone}[self.second]

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


def _ratio(t: TrialData) -> float:
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
    ratios = [_ratio(t) for t in group]
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


def analyze(trials: Sequence[TrialData], baselines: dict[str, list[float]] | None = None,
            rules: Rules | None = None, model_runs: int = 0, *, own_history: bool = False,
            baseline_pairs: int = BASELINE_PAIRS, bootstrap: int = 0) -> dict[str, Any]:
    """The gate's rules applied to *trials* (Note [per-gate-run campaign]); *baselines*: each profile's stored
    samples of the paired test's metric on this machine's key, where it has them; *own_history*: a profile
    without them takes its unchanged trials, *baseline_pairs* pooled at a time, as the stored baseline in turn
    (:func:`judge_against_own`: what a baseline recorded on this machine gives), and the per-gate-run figures
    are then estimates.

    Per gate run, the k-th unchanged trial of every profile is one gate run's set of paired tests: its first looks
    fail when any does (a count with an exact bound, no model), and it fails with probability 1 - prod(1 - p) over
    the profiles' confirmed rates p (an estimate, which takes the looks of fresh engines as independent). With
    *model_runs*, each profile's :class:`NoiseModel` predicts both rates from that many simulated tests; with
    *bootstrap*, that many refits of it to resampled trials bound them (:func:`bootstrap_model`), and the
    per-gate-run false alarms too (each replicate's profiles together)."""
    from vramgate.engine.paired import PAIRED_DEFAULTS

    if bootstrap and not model_runs:
        raise ValueError("a bootstrap refits the noise model: give model_runs too")
    rules = rules or Rules.of(PAIRED_DEFAULTS["cpu"])
    by: dict[tuple[str, str], list[TrialData]] = {}
    for t in sorted(trials, key=lambda t: t.index):
        by.setdefault((t.profile, t.condition), []).append(t)
    profiles: dict[str, dict[str, Any]] = {}
    for (profile, condition), group in sorted(by.items()):
        base = (baselines or {}).get(profile)
        if own_history and not base:
            judged = judge_against_own(group, by.get((profile, "unchanged"), []), rules, baseline_pairs)
        else:
            judged = judge_group(group, rules, base)
        profiles.setdefault(profile, {})[condition] = judged
    models: dict[str, dict[str, Any]] = {}
    if model_runs:
        for (profile, condition), group in sorted(by.items()):
            if condition != "unchanged" or len(group) < 2:
                continue
            model = NoiseModel.fit(group)
            history = bool((baselines or {}).get(profile)) or own_history
            pooled = baseline_pairs if own_history else 1  # a stored baseline's pairs are not known here
            models[profile] = {
                "effect": model.effect, "between": model.between, "runs": model_runs,
                "false_alarms": simulate(model, rules, runs=model_runs, history=history, baseline_pairs=pooled),
                "detection": simulate(model, rules, runs=model_runs, history=history, shift=PLANTED,
                                      baseline_pairs=pooled),
            }
            if bootstrap:
                models[profile].update(bootstrap_model(  # each profile its own draws: their tests are independent
                    group, rules, replicates=bootstrap, runs=model_runs, history=history, baseline_pairs=pooled,
                    seed=zlib.crc32(profile.encode()) * 1000))
    per_run_upper = None
    if bootstrap and models:  # replicate k of every profile is one draw of the whole gate run's rates
        per_run = [1 - math.prod(1 - m["false_alarms_replicates"][k] for m in models.values())
                   for k in range(bootstrap)]
        per_run_upper = percentile(per_run, 0.95)
    unchanged = [p["unchanged"] for p in profiles.values() if "unchanged" in p]
    runs = min((u["trials"] for u in unchanged), default=0)
    # a run's first looks fail when any does (with own baselines each look's rate is a mean over them: expected runs)
    failed_runs: float = 0.0
    for k in range(runs):
        clear = 1.0
        for u in unchanged:
            clear *= 1 - float(u["fails_per_first_look"][k])
        failed_runs += 1 - clear
    survive = 1.0
    for u in unchanged:
        survive *= 1 - u["fails"] / u["trials"]
    own = sorted(p for p, c in profiles.items() if "history_baselines" in c.get("unchanged", {}))
    return {"rules": {"tolerance": rules.tolerance, "alpha": rules.alpha, "history_tolerance": rules.history_tolerance,
                      "screen": rules.screen, "second": rules.second, "described": rules.describe()},
            "profiles": profiles, "models": models, "gate_runs": runs, "gate_runs_first_look_failed": failed_runs,
            "gate_run_false_alarm_estimate": 1 - survive, "history_baselines": sorted(baselines or {}),
            "own_history": own, "baseline_pairs": baseline_pairs, "bootstrap": bootstrap,
            "gate_run_false_alarm_model_upper": per_run_upper}


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

        logs = [math.log(_ratio(t)) for t in group]
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


def render(result: dict[str, Any]) -> str:
    """The analysis as Markdown: a row per profile and condition, then the per-gate-run figures."""
    r = result["rules"]
    together = result.get("together")
    way = "" if together is None else " Rounds together." if together else " Rounds one after the other."
    rule = f" Rule: {r['described']}." if r.get("described") else ""
    part = f" Each trial's first {result['rounds']} round pairs only." if result.get("rounds") else ""
    lines = [f"Statistic `{result.get('stat', 'step')}`.{way}{part}{rule} In-run tolerance {r['tolerance']:.1%} "
             f"(alpha {r['alpha']:g}), history tolerance "
             f"{r['history_tolerance']:.1%}; stored baselines for: {', '.join(result['history_baselines']) or 'none'}"
             + (f"; the campaign's own unchanged trials, {result.get('baseline_pairs', 1)} pooled, as baselines "
               f"for: {', '.join(result['own_history'])}"
                if result.get("own_history") else "") + ".",
             "",
             "| profile | condition | trials | ratio, trial medians | SD between trials | largest detectable "
             "shift | first looks failing (in-run / noise / history) | tests failing (after the further looks) |",
             "|---|---|---|---|---|---|---|---|"]
    for profile, conditions in result["profiles"].items():
        for condition, e in conditions.items():
            by = e["first_look_by_check"]
            kind = "upper" if condition == "unchanged" else "lower"
            hits = e["first_look_fails"]
            first = (show_rate(round(hits), e["trials"], bound=kind) if abs(hits - round(hits)) < 1e-9 else
                     f"{hits:.2f} of {e['trials']} ({hits / e['trials']:.1%}; mean over the baselines)")
            lines.append(
                f"| {profile} | {condition} | {e['trials']} | {e['ratio_range'][0]:.3f}-{e['ratio_range'][1]:.3f} | "
                f"{e['between_trials_sd']:.1%} | {e['detectable_shift_max']:.1%} | {first} ({by['in-run']:.3g} / "
                f"{by['noise']:.3g} / {by['history']:.3g}) | {e['fails']:.2f} of {e['trials']} "
                f"({e['fails'] / e['trials']:.1%}) |")
    models = result.get("models") or {}
    if models:
        lines += ["", "| profile | model: true ratio | SD between engine pairs | false alarms | detection of +10% |",
                  "|---|---|---|---|---|"]
        lines += [f"| {p} | {math.exp(m['effect']):.3f} | {m['between']:.1%} | {m['false_alarms']:.1%}"
                  + (f" (95% upper {m['false_alarms_upper']:.1%})" if "false_alarms_upper" in m else "")
                  + f" | {m['detection']:.1%}"
                  + (f" (95% lower {m['detection_lower']:.1%})" if "detection_lower" in m else "")
                  + f" (of {m['runs']} simulated tests"
                  + (f"; bounds from {m['replicates']} refits to resampled trials, each resolving "
                     f"{1 / m['runs']:.2%}" if "replicates" in m else "")
                  + ") |" for p, m in models.items()]
    failed = result["gate_runs_first_look_failed"]
    shown = (show_rate(round(failed), result["gate_runs"]) if abs(failed - round(failed)) < 1e-9 else
             f"{failed:.2f} of {result['gate_runs']} (expected, over the baselines)")
    lines += ["", f"Gate runs (one unchanged trial of each profile): first looks failed in "
              f"{shown}; estimated false alarms per "
              f"gate run after the further looks: {result['gate_run_false_alarm_estimate']:.2%}."]
    if result.get("gate_run_false_alarm_model_upper") is not None:
        lines += ["", f"The model's false alarms per gate run (every profile's test), 95% upper bound over "
                  f"{result['bootstrap']} refits to resampled trials (Note [bootstrap bound]): "
                  f"{result['gate_run_false_alarm_model_upper']:.2%} (a refit's simulated tests resolve rates down to "
                  f"{1 / max(m['runs'] for m in models.values()):.2%} per profile)."]
    return "\n".join(lines)


def stored_ratios(root: Path, key: str, name: str) -> dict[str, list[float]]:
    """Each profile's stored samples of the paired test's metric *name* (``step_ratio``) under the baseline key *key*
    (none when it has none)."""
    path = root / "baselines" / key / "latency.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    out = {}
    for nodeid, test in data.get("tests", {}).items():
        if "test_profile_latency_ratio[" in nodeid and name in test.get("metrics", {}):
            out[nodeid.split("[", 1)[1].rstrip("]")] = [float(v) for v in test["metrics"][name]["samples"]]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``run`` a campaign or ``analyze`` saved ones (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m vramgate.tools.calibration.gate_paired")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--minutes", type=float, required=True)
    r.add_argument("--profiles", default="kv-fp8,block-manager-min-recompute,block-manager-watermark")
    r.add_argument("--idle", action="store_true", help="no other worker")
    r.add_argument("--rounds", type=int)
    r.add_argument("--quiet", action="store_true", help="every trial in a quiet section")
    r.add_argument("--conditions", default="unchanged,delay-10%", help="the conditions to take trials of")
    r.add_argument("--stat", help="the statistic to record (default: the tier's; step_floor: Note [step floor])")
    r.add_argument("--together", action=argparse.BooleanOptionalAction, default=None,
                   help="both engines run each pair's rounds at once (default: the tier's setting)")
    r.add_argument("--both-ways", action="store_true",
                   help="each trial taken twice, back to back: rounds together and one after the other (an A/B)")
    z = sub.add_parser("analyze")
    z.add_argument("folders", type=Path, nargs="+")
    z.add_argument("--key", default="", help="the baseline key whose stored ratios the history check uses")
    z.add_argument("--tolerance", type=float)
    z.add_argument("--alpha", type=float)
    z.add_argument("--history-tolerance", type=float)
    z.add_argument("--looks", type=int, choices=(2, 3),
                   help="the most looks a test takes (default: the CPU tier's; Note [three looks])")
    z.add_argument("--screen", type=float,
                   help="the first look's in-run tolerance (default: the CPU tier's; 0: none, the tolerance)")
    z.add_argument("--json", type=Path, help="also write the analysis here")
    z.add_argument("--stat", help="the trials of this statistic (default: the CPU tier's)")
    z.add_argument("--together", choices=("yes", "no"),
                   help="only the trials whose rounds ran together (yes) or one after the other (no); a campaign "
                        "of run --both-ways holds both")
    z.add_argument("--rounds", type=int,
                   help="each trial's first N round pairs only: what a test of N rounds would have seen")
    z.add_argument("--model-runs", type=int, default=0, help="simulated tests per profile for the noise model")
    z.add_argument("--bootstrap", type=int, default=0,
                   help="refits of the noise model to resampled trials, for its rates' 95%% bounds (with --model-runs)")
    z.add_argument("--own-history", action="store_true",
                   help="a profile without stored baselines takes its unchanged trials, pooled by --baseline-pairs, "
                        "in turn as one")
    z.add_argument("--baseline-pairs", type=int, default=BASELINE_PAIRS,
                   help="engine pairs (unchanged trials) per baseline of --own-history (the gate records 2)")
    args = parser.parse_args(argv)
    if args.command == "analyze" and args.bootstrap and not args.model_runs:
        parser.error("--bootstrap refits the noise model: give --model-runs too")
    root = Path.cwd()
    if args.command == "run":
        run(root, args.out, args.minutes, [p for p in args.profiles.split(",") if p], not args.idle, args.rounds,
            args.quiet, args.together, args.conditions.split(","), args.stat, args.both_ways)
        return 0
    from vramgate.engine.paired import PAIRED_DEFAULTS

    d = PAIRED_DEFAULTS["cpu"]
    changes: dict[str, Any] = {k: v for k, v in (("tolerance", args.tolerance), ("alpha", args.alpha),
                                                 ("history_tolerance", args.history_tolerance), ("looks", args.looks))
                               if v is not None}
    if args.screen is not None:
        changes["screen"] = args.screen or None  # 0: no screen
    try:
        rules = Rules.of(dataclasses.replace(d, **changes))  # the tier's settings check what is given
    except ValueError as exc:
        parser.error(str(exc))
    stat = args.stat or d.stat
    way = None if args.together is None else args.together == "yes"
    trials = [t for t in load_trials(args.folders) if t.stat == stat and (way is None or t.together is way)]
    if not trials:
        which = "" if way is None else (" with rounds together" if way else " with rounds one after the other")
        raise SystemExit(f"no trials of the statistic {stat!r}{which} in {', '.join(map(str, args.folders))}")
    if args.rounds is not None:
        short = [t.index for t in trials if len(t.ref) < args.rounds]
        if args.rounds < 1 or short:
            parser.error(f"--rounds {args.rounds}: " + ("must be at least 1" if args.rounds < 1 else
                         f"trials {', '.join(map(str, short[:5]))} have fewer round pairs"))
        trials = [dataclasses.replace(t, ref=t.ref[:args.rounds], cand=t.cand[:args.rounds]) for t in trials]
    result = analyze(trials, stored_ratios(root, args.key, f"{stat}_ratio") if args.key else None, rules,
                     args.model_runs, own_history=args.own_history, baseline_pairs=args.baseline_pairs,
                     bootstrap=args.bootstrap)
    result["stat"] = stat
    result["together"] = way
    result["rounds"] = args.rounds
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True))
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
