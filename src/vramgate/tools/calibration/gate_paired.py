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
guard, the ratio against a stored baseline and against the campaign's other trials, and the second look of
Note [second look] in :mod:`vramgate.engine.paired`, taken from another trial: a fresh pair of engines, as the
gate takes it) and counts false alarms per gate run (any profile's test failing on an unchanged tree) and
detections per profile, with exact (Clopper-Pearson) 95% bounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The planted delay a detection trial gives the candidate's engine steps.
PLANTED = 0.10


def clopper_pearson(hits: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """The exact two-sided *level* interval of a binomial rate (each side (1 - level) / 2)."""
    if trials <= 0:
        return (math.nan, math.nan)
    tail = (1 - level) / 2

    def cdf(k: int, p: float) -> float:
        return sum(math.comb(trials, i) * p**i * (1 - p) ** (trials - i) for i in range(k + 1))

    def solve(f: Any, lo: float = 0.0, hi: float = 1.0) -> float:
        for _ in range(60):
            mid = (lo + hi) / 2
            if f(mid):
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = 0.0 if hits == 0 else solve(lambda p: 1 - cdf(hits - 1, p) < tail)
    high = 1.0 if hits == trials else solve(lambda p: cdf(hits, p) > tail)
    return (low, high)


def show_rate(hits: int, trials: int) -> str:
    """``hits/trials (rate; 95% bound)``: the upper bound for a false-alarm count, both for the rest."""
    if not trials:
        return "no trials"
    lo, hi = clopper_pearson(hits, trials)
    return f"{hits}/{trials} ({hits / trials:.1%}; 95% CI {lo:.1%}-{hi:.1%})"


@dataclass(frozen=True)
class TrialData:
    """One trial of one profile's paired test: each round's median engine step, reference and candidate."""

    profile: str
    condition: str
    """``unchanged`` or ``delay-10%``."""
    index: int
    ref: list[float]
    cand: list[float]
    busy: bool

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrialData:
        """A trial from a line of ``trials.jsonl``."""
        return cls(str(data["profile"]), str(data["condition"]), int(data["index"]),
                   [float(v) for v in data["ref"]], [float(v) for v in data["cand"]], bool(data.get("busy", True)))


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


def _busy_loop(root: Path, out: Path, stop: Path) -> subprocess.Popen[bytes]:
    """The other worker: the rest of the pre-merge gate (without the paired latency tests), run after run."""
    script = (
        "import pathlib, subprocess, sys\n"
        f"stop = pathlib.Path({str(stop)!r})\n"
        "n = 0\n"
        "while not stop.exists():\n"
        "    subprocess.call([sys.executable, '-m', 'pytest', 'suites', '-m', 'not gate_nightly', '-p', 'no:xdist',\n"
        "                     '-p', 'no:cacheprovider', '-q', '--deselect', 'suites/latency/test_paired_latency.py',\n"
        f"                     '--gate-report', {str(out)!r} + f'/busy-report-{{n}}',\n"
        f"                     '--basetemp', {str(out)!r} + f'/busy-tmp-{{n}}'],\n"
        f"                    cwd={str(root)!r}, stdout=open({str(out)!r} + f'/busy-{{n}}.log', 'wb'),\n"
        "                    stderr=subprocess.STDOUT)\n"
        "    n += 1\n"
    )
    return subprocess.Popen([sys.executable, "-c", script], start_new_session=True)


def run(root: Path, out: Path, minutes: float, profiles: Sequence[str], busy: bool, rounds: int | None) -> None:
    """Trials until *minutes* have passed (see the module's docstring), appended to ``out/trials.jsonl``."""
    from vramgate.engine import engine_tier
    from vramgate.engine.paired import PairedEngines, latency_spec, paired_defaults
    from vramgate.profiles import find_profile

    settings = paired_defaults(engine_tier())
    n_rounds = rounds or settings.rounds
    out.mkdir(parents=True, exist_ok=True)
    stop = out / "stop"
    stop.unlink(missing_ok=True)
    other = _busy_loop(root, out, stop) if busy else None
    reference = latency_spec("tiny-llama")
    deadline = time.monotonic() + minutes * 60
    index = sum(1 for _ in (out / "trials.jsonl").open()) if (out / "trials.jsonl").exists() else 0
    try:
        while time.monotonic() < deadline:
            for condition, delay in (("unchanged", 0.0), ("delay-10%", PLANTED)):
                for name in profiles:
                    profile = find_profile(root, name)
                    candidate = reference.replace(profile=profile.name)
                    if delay:
                        candidate = candidate.replace(env={"VRAMGATE_PLANT_DELAY": str(delay)})
                    run_dir = out / "engines" / f"{index}"
                    t0 = time.time()
                    with PairedEngines(reference, candidate, root, run_dir, cache_root=out / "cache") as engines:
                        ref, cand = engines.run(n_rounds, seed=index).stats(settings.stat)
                    line = {"profile": name, "condition": condition, "index": index, "ref": ref, "cand": cand,
                            "busy": busy, "started": t0, "seconds": time.time() - t0, "isa": os.environ.get(
                                "VRAMGATE_CPU_ISA", "")}
                    with (out / "trials.jsonl").open("a", encoding="utf-8") as f:
                        f.write(json.dumps(line) + "\n")
                    print(f"trial {index}: {name} {condition}: {time.time() - t0:.1f} s", flush=True)
                    index += 1
                    if time.monotonic() >= deadline:
                        return
    finally:
        stop.write_text("stop")
        if other is not None:
            from vramgate.runtime import process

            process.kill_group(other)  # type: ignore[arg-type]


# -- analysis ------------------------------------------------------------------------------------------------


def analyze(trials: Sequence[TrialData], baselines: dict[str, list[float]] | None = None,
            tolerance: float | None = None, alpha: float | None = None,
            history_tolerance: float | None = None) -> dict[str, Any]:
    """The gate's rules applied to *trials* (Note [per-gate-run campaign]); *baselines*: each profile's stored
    ``step_ratio`` samples on this machine's key, where it has them."""
    from vramgate.core.checks import check_baseline
    from vramgate.core.metrics import Metric
    from vramgate.core.stats import compare_samples, detectable_shift
    from vramgate.engine.paired import PAIRED_DEFAULTS

    d = PAIRED_DEFAULTS["cpu"]
    tol = d.tolerance if tolerance is None else tolerance
    a = d.alpha if alpha is None else alpha
    htol = d.history_tolerance if history_tolerance is None else history_tolerance

    def ratios(t: TrialData) -> list[float]:
        return [c / r for r, c in zip(t.ref, t.cand, strict=True)]

    def in_run(ref: list[float], cand: list[float]) -> bool:
        return compare_samples(ref, cand, better="lower", tolerance=tol, alpha=a).regressed

    def noisy(ref: list[float], cand: list[float]) -> bool:
        return detectable_shift(ref, cand, alpha=a) > tol

    def history(rs: list[float], base: list[float]) -> bool:
        m = Metric("step_ratio", sum(rs) / len(rs), "ratio", "measured", samples=sorted(rs), tolerance=htol)
        m.value = sorted(rs)[len(rs) // 2] if len(rs) % 2 else (sorted(rs)[len(rs) // 2 - 1] +
                                                                 sorted(rs)[len(rs) // 2]) / 2
        b = Metric("step_ratio", sorted(base)[len(base) // 2], "ratio", "measured", samples=list(base))
        return check_baseline(m, b)[0] == "regressed"

    out: dict[str, Any] = {"tolerance": tol, "alpha": a, "history_tolerance": htol, "profiles": {}}
    by: dict[tuple[str, str], list[TrialData]] = {}
    for t in trials:
        by.setdefault((t.profile, t.condition), []).append(t)
    gate_fail_unconfirmed: dict[int, bool] = {}
    for (profile, condition), group in sorted(by.items()):
        group.sort(key=lambda t: t.index)
        base = (baselines or {}).get(profile)
        entry: dict[str, Any] = {"trials": len(group)}
        medians = [sorted(ratios(t))[len(t.ref) // 2] for t in group]
        logs = [math.log(m) for m in medians]
        mean = sum(logs) / len(logs)
        entry["ratio_median_range"] = [min(medians), max(medians)]
        entry["between_trial_sd_log"] = math.sqrt(sum((x - mean) ** 2 for x in logs) / max(1, len(logs) - 1))
        shifts = [detectable_shift(t.ref, t.cand, alpha=a) for t in group]
        entry["detectable_shift_range"] = [min(shifts), max(shifts)]
        entry["untrusted"] = sum(1 for t in group if noisy(t.ref, t.cand))
        first = [in_run(t.ref, t.cand) for t in group]
        hist_first = [history(ratios(t), base) if base else False for t in group]
        entry["first_look_fails_in_run"] = sum(first)
        entry["first_look_fails_history"] = sum(hist_first)
        # The second look: another trial of the same profile and condition (fresh engines), pooled.
        confirmed_pairs = looked = 0
        confirmed_by_trial = []
        for i, t in enumerate(group):
            if not (first[i] or hist_first[i] or noisy(t.ref, t.cand)):
                confirmed_by_trial.append(0.0)
                continue
            hits = n = 0
            for j, u in enumerate(group):
                if j == i:
                    continue
                ref, cand = t.ref + u.ref, t.cand + u.cand
                fails = in_run(ref, cand) or noisy(ref, cand) or (base is not None and history(ratios(t) + ratios(u),
                                                                                              base))
                hits += fails
                n += 1
            confirmed_pairs += hits
            looked += n
            confirmed_by_trial.append(hits / n if n else 1.0)
        entry["confirmed_expected"] = sum(confirmed_by_trial)
        entry["confirmed_rate"] = sum(confirmed_by_trial) / len(group)
        entry["first_look_fail_any"] = sum(1 for i in range(len(group)) if first[i] or hist_first[i] or
                                           noisy(group[i].ref, group[i].cand))
        # History against the campaign's own trials: each trial as the baseline of every other.
        own = sum(history(ratios(u), ratios(t)) for t in group for u in group if u is not t)
        entry["history_vs_own_trials"] = [own, len(group) * (len(group) - 1)]
        out["profiles"].setdefault(profile, {})[condition] = entry
        if condition == "unchanged":
            for k, t in enumerate(group):
                gate_fail_unconfirmed[k] = gate_fail_unconfirmed.get(k, False) or first[k] or hist_first[k]
    fa = [p["unchanged"]["confirmed_rate"] for p in out["profiles"].values() if "unchanged" in p]
    out["gate_run_false_alarm_union"] = sum(fa)
    out["gate_runs_first_look_fail"] = [sum(gate_fail_unconfirmed.values()), len(gate_fail_unconfirmed)]
    return out


def render(result: dict[str, Any]) -> str:
    """The analysis as a Markdown table per profile."""
    lines = [f"in-run tolerance {result['tolerance']:.1%} (alpha {result['alpha']}), history tolerance "
             f"{result['history_tolerance']:.1%}", "",
             "| profile | condition | trials | step ratio (trial medians) | between-trial SD | detectable shift |"
             " untrusted | first look fails (in-run / history / any) | confirmed (expected) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for profile, conditions in result["profiles"].items():
        for condition, e in conditions.items():
            n = e["trials"]
            lines.append(
                f"| {profile} | {condition} | {n} | {e['ratio_median_range'][0]:.3f}-{e['ratio_median_range'][1]:.3f}"
                f" | {e['between_trial_sd_log']:.1%} | {e['detectable_shift_range'][0]:.1%}-"
                f"{e['detectable_shift_range'][1]:.1%} | {e['untrusted']} | {e['first_look_fails_in_run']} / "
                f"{e['first_look_fails_history']} / {e['first_look_fail_any']} | {e['confirmed_expected']:.2f} "
                f"({e['confirmed_rate']:.1%}) |")
    lines += ["", f"gate runs whose first looks failed somewhere: {result['gate_runs_first_look_fail'][0]} of "
              f"{result['gate_runs_first_look_fail'][1]}; confirmed false alarms per gate run (union over "
              f"profiles): {result['gate_run_false_alarm_union']:.2%}"]
    return "\n".join(lines)


def stored_ratios(root: Path, key: str) -> dict[str, list[float]]:
    """Each profile's stored ``step_ratio`` samples under the baseline key *key* (none when it has none)."""
    path = root / "baselines" / key / "latency.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    out = {}
    for nodeid, test in data.get("tests", {}).items():
        if "test_profile_latency_ratio[" in nodeid and "step_ratio" in test.get("metrics", {}):
            out[nodeid.split("[", 1)[1].rstrip("]")] = [float(v) for v in test["metrics"]["step_ratio"]["samples"]]
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
    z = sub.add_parser("analyze")
    z.add_argument("folders", type=Path, nargs="+")
    z.add_argument("--key", default="", help="the baseline key whose stored ratios the history check uses")
    z.add_argument("--tolerance", type=float)
    z.add_argument("--alpha", type=float)
    z.add_argument("--history-tolerance", type=float)
    args = parser.parse_args(argv)
    root = Path.cwd()
    if args.command == "run":
        run(root, args.out, args.minutes, [p for p in args.profiles.split(",") if p], not args.idle, args.rounds)
        return 0
    result = analyze(load_trials(args.folders), stored_ratios(root, args.key) if args.key else None,
                     args.tolerance, args.alpha, args.history_tolerance)
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
