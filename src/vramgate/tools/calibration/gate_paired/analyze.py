"""A campaign analysed: the gate's rules on every profile's trials, counted per gate run, with the noise model's
rates where asked (Note [per-gate-run campaign] in :mod:`vramgate.tools.calibration.gate_paired`)."""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramgate.tools.calibration.gate_paired.model import NoiseModel, bootstrap_model, percentile, simulate
from vramgate.tools.calibration.gate_paired.rules import BASELINE_PAIRS, Rules, judge_against_own, judge_group
from vramgate.tools.calibration.gate_paired.trials import PLANTED, TrialData


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


def stored_ratios(root: Path, key: str, name: str) -> dict[str, list[float]]:
    """Each profile's stored samples of the paired test's metric *name* (``step_ratio``) under the baseline key *key*
    (none when it has none)."""
    path = root / "baselines" / key / "latency.json"
    return ratios_in(path, name) if path.exists() else {}


def ratios_in(path: Path, name: str) -> dict[str, list[float]]:
    """Each profile's samples of the paired test's metric *name* in the baseline file *path* (a ``latency.json``:
    the key's stored one, or a copy a campaign keeps of the baselines it was judged against)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: not a baseline file ({exc})") from None
    out = {}
    for nodeid, test in data.get("tests", {}).items():
        if "test_profile_latency_ratio[" in nodeid and name in test.get("metrics", {}):
            out[nodeid.split("[", 1)[1].rstrip("]")] = [float(v) for v in test["metrics"][name]["samples"]]
    return out
