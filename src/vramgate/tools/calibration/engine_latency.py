"""The gate's own precision: false alarms on unchanged code, detections of planted regressions.

``vramgate calibrate`` runs a campaign on this machine and writes what it
measured (``calibration.json``, ``calibration.md``):

* Exact metrics: the same engine spec run several times on unchanged code,
  each run's exact figures (KV capacity, page bytes, blocks in use,
  preemptions, weight bytes, ...) checked against the first run's with the
  gate's own :func:`~vramgate.core.checks.check_baseline`; then planted
  regressions, which the checks must all catch: one more KV block per request
  (the plant ``calibrate-extra-kv-block``, a diff to vLLM's KV cache manager that ships with the gate in
  :data:`PLANTS`, not under a project's ``patches/``: it is no optimization to judge)
  and +1% weight bytes (Note [planted weight bytes] in the engine worker).
* Measured metrics: paired engines (Note [paired latency]) on unchanged code
  (reference vs an identical candidate) and with a planted delay of +5% and
  +10% per engine step in the candidate (Note [planted delay]). Each run of a
  pair yields rounds; consecutive rounds form trials of the size the gate's
  paired latency test uses. A trial's samples are per-round ratios candidate /
  reference. Against history (the way the gate compares with a stored
  baseline), every trial of the unchanged pairs is compared with every trial
  of *other* unchanged pairs (false alarms) and of the delayed pairs
  (detections), with the gate's own :func:`~vramgate.core.stats.compare_samples` at
  each candidate tolerance and level; within a trial the candidate's rounds
  are also compared with the reference's pair by pair, by the paired test's
  own in-run rule (:func:`~vramgate.core.stats.compare_pairs`).

The analysis is pure (:func:`analyze`) so that the figures can be recomputed
from a saved ``calibration.json`` (``--from``) for other tolerances.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.core.stats import compare_pairs, compare_samples

#: Conditions of the measured part: the candidate's planted delay per engine step.
DELAYS = {"unchanged": 0.0, "delay-5%": 0.05, "delay-10%": 0.10}
#: Tolerances and levels the analysis sweeps.
TOLERANCES = (0.02, 0.03, 0.05, 0.075, 0.10, 0.20, 0.30, 0.50, 1.0)
ALPHAS = (0.01, 0.05)
#: Figures the gate promises for measured metrics on a noisy CPU (and meets them with its defaults).
TARGET_FALSE_ALARMS = 0.01
TARGET_DETECTION = 0.95


@dataclass
class Rate:
    """A count out of trials, with a 95% upper (false alarms) or lower (detections) bound."""

    hits: int
    trials: int

    @property
    def rate(self) -> float:
        """Hits per trial (NaN without trials)."""
        return self.hits / self.trials if self.trials else math.nan

    def bounds(self) -> tuple[float, float]:
        """Wilson score interval at 95%."""
        n, z = self.trials, 1.96
        if n == 0:
            return (math.nan, math.nan)
        p = self.hits / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return (max(0.0, centre - half), min(1.0, centre + half))

    def to_json(self) -> dict[str, Any]:
        """The rate as JSON data: hits, trials, rate and its Wilson 95% interval."""
        lo, hi = self.bounds()
        return {"hits": self.hits, "trials": self.trials, "rate": self.rate, "wilson95": [lo, hi]}

    def show(self) -> str:
        """The rate in words: ``hits/trials (rate, 95% CI low-high)``."""
        lo, hi = self.bounds()
        return f"{self.hits}/{self.trials} ({self.rate:.1%}, 95% CI {lo:.1%}-{hi:.1%})"


@dataclass
class Trial:
    """A run of paired rounds cut to the size of one gate test: per-round statistics of both sides."""

    condition: str
    pair: int
    a: list[float]
    b: list[float]

    @property
    def ratios(self) -> list[float]:
        """Per-round ratios candidate / reference."""
        return [y / x for x, y in zip(self.a, self.b, strict=True)]


def make_trials(raw: dict[str, list[dict[str, list[float]]]], stat: str, rounds: int) -> list[Trial]:
    """Cut every pair's rounds of *raw* (condition -> pairs -> stat -> values) into trials of *rounds*."""
    out = []
    for condition, pairs in raw.items():
        for index, pair in enumerate(pairs):
            a, b = pair[f"a_{stat}"], pair[f"b_{stat}"]
            for start in range(0, len(a) - rounds + 1, rounds):
                out.append(Trial(condition, index, a[start:start + rounds], b[start:start + rounds]))
    return out


@dataclass
class Figures:
    """False alarms and detections at one tolerance and level."""

    tolerance: float
    alpha: float
    history_false_alarms: Rate
    history_detection: dict[str, Rate]
    ab_false_alarms: Rate
    ab_detection: dict[str, Rate]
    raw_false_alarms: Rate = field(default_factory=lambda: Rate(0, 0))
    """Raw candidate samples against another process's raw reference samples (no pairing)."""
    raw_detection: dict[str, Rate] = field(default_factory=dict)

    def meets(self) -> bool:
        """Whether history false alarms and detection of the 10% delay meet the targets (``TARGET_*``)."""
        det = self.history_detection.get("delay-10%")
        return (self.history_false_alarms.trials > 0 and self.history_false_alarms.rate <= TARGET_FALSE_ALARMS
                and det is not None and det.trials > 0 and det.rate >= TARGET_DETECTION)

    def to_json(self) -> dict[str, Any]:
        """These figures as JSON data, with whether they meet the targets."""
        return {"tolerance": self.tolerance, "alpha": self.alpha,
                "history_false_alarms": self.history_false_alarms.to_json(),
                "history_detection": {k: v.to_json() for k, v in self.history_detection.items()},
                "ab_false_alarms": self.ab_false_alarms.to_json(),
                "ab_detection": {k: v.to_json() for k, v in self.ab_detection.items()},
                "raw_false_alarms": self.raw_false_alarms.to_json(),
                "raw_detection": {k: v.to_json() for k, v in self.raw_detection.items()},
                "meets_targets": self.meets()}


def analyze(trials: Sequence[Trial], tolerance: float, alpha: float) -> Figures:
    """False alarms and detections of the gate's sample comparison over *trials* (see the module docs)."""

    def regressed(baseline: Sequence[float], candidate: Sequence[float]) -> bool:
        return compare_samples(baseline, candidate, better="lower", tolerance=tolerance, alpha=alpha).regressed

    def in_run(reference: Sequence[float], candidate: Sequence[float]) -> bool:  # the paired test's own rule
        return compare_pairs(reference, candidate, better="lower", tolerance=tolerance, alpha=alpha).regressed

    same = [t for t in trials if t.condition == "unchanged"]
    fa, raw_fa = Rate(0, 0), Rate(0, 0)
    for base in same:
        for cand in same:
            if cand.pair != base.pair:
                fa.trials += 1
                fa.hits += regressed(base.ratios, cand.ratios)
                raw_fa.trials += 1
                raw_fa.hits += regressed(base.a, cand.b)
    detection: dict[str, Rate] = {}
    ab_detection: dict[str, Rate] = {}
    raw_detection: dict[str, Rate] = {}
    for condition in sorted({t.condition for t in trials} - {"unchanged"}):
        hist, ab, raw = Rate(0, 0), Rate(0, 0), Rate(0, 0)
        for cand in (t for t in trials if t.condition == condition):
            ab.trials += 1
            ab.hits += in_run(cand.a, cand.b)
            for base in same:
                hist.trials += 1
                hist.hits += regressed(base.ratios, cand.ratios)
                if base.pair != cand.pair:
                    raw.trials += 1
                    raw.hits += regressed(base.a, cand.b)
        detection[condition], ab_detection[condition], raw_detection[condition] = hist, ab, raw
    ab_fa = Rate(len(same), 0)
    ab_fa.trials, ab_fa.hits = len(same), sum(in_run(t.a, t.b) for t in same)
    return Figures(tolerance, alpha, fa, detection, ab_fa, ab_detection, raw_fa, raw_detection)


def sweep(trials: Sequence[Trial], tolerances: Sequence[float] = TOLERANCES,
          alphas: Sequence[float] = ALPHAS) -> list[Figures]:
    """The :func:`analyze` figures of *trials* at every level in *alphas* and tolerance in *tolerances*."""
    return [analyze(trials, tol, alpha) for alpha in alphas for tol in tolerances]


# -- exact metrics ---------------------------------------------------------------------

#: Exact figures of an engine result the campaign checks: (name, path in the result, unit, better).
EXACT_FIGURES: tuple[tuple[str, tuple[str, str], str, str], ...] = (
    ("capacity_tokens", ("kv", "capacity_tokens"), "tokens", "higher"),
    ("num_gpu_blocks", ("kv", "num_gpu_blocks"), "blocks", "higher"),
    ("page_bytes", ("kv", "page_bytes"), "B", "lower"),
    ("kv_tensor_bytes", ("memory", "kv_tensor_bytes"), "B", "lower"),
    ("weights_bytes", ("memory", "weights_bytes"), "B", "lower"),
    ("peak_blocks_in_use", ("scheduler", "peak_blocks_in_use"), "blocks", "lower"),
    ("preemptions", ("scheduler", "preemptions"), "count", "lower"),
    ("recomputed_tokens", ("scheduler", "recomputed_tokens"), "tokens", "lower"),
    ("scheduler_steps", ("scheduler", "steps"), "count", "lower"),
)


def exact_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """The :data:`EXACT_FIGURES` of an engine result (as written by the engine worker) as gate metrics."""
    from vramgate.core.metrics import Metric

    out = {}
    for name, (section, key), unit, better in EXACT_FIGURES:
        value = result[section][key]
        if value is None:
            continue
        out[name] = Metric(name=name, value=float(value), unit=unit, kind="exact", better=better)  # type: ignore[arg-type]
    return out


def compare_exact(baseline: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """Names of the exact metrics of *candidate* that the gate calls regressed against *baseline*."""
    from vramgate.core.checks import check_baseline

    base, cand = exact_metrics(baseline), exact_metrics(candidate)
    return [name for name, metric in cand.items()
            if name in base and check_baseline(metric, base[name])[0] == "regressed"]


@dataclass
class ExactFigures:
    """Exact-metric comparisons: unchanged reruns (false alarms) and planted regressions (detections)."""

    metrics_per_run: int = 0
    false_alarms: list[str] = field(default_factory=list)
    reruns: int = 0
    planted: dict[str, list[str]] = field(default_factory=dict)
    """Planted regression -> the metrics that caught it."""
    expected: dict[str, str] = field(default_factory=dict)
    """Planted regression -> the metric that must catch it."""

    def to_json(self) -> dict[str, Any]:
        """These figures as JSON data: reruns, comparisons, false alarms, and what caught each planted regression."""
        comparisons = self.reruns * self.metrics_per_run
        return {"reruns": self.reruns, "comparisons": comparisons, "false_alarms": self.false_alarms,
                "planted": {k: {"caught_by": v, "expected": self.expected[k], "detected": self.expected[k] in v}
                            for k, v in self.planted.items()}}


#: The calibration's own plants: profiles (a manifest and its diffs) the campaign applies by name from this folder.
PLANTS = Path(__file__).parent / "plants"

#: Planted exact regressions: name -> (spec changes, the metric that must catch it); a change ``plant`` names a
#: profile of :data:`PLANTS`.
PLANTED_EXACT: dict[str, tuple[dict[str, Any], str]] = {
    "one more KV block per request": ({"plant": "calibrate-extra-kv-block"}, "peak_blocks_in_use"),
    "+1% weight bytes": ({"env": {"VRAMGATE_PLANT_WEIGHT_BYTES": "0.01"}}, "weights_bytes"),
}


def run_exact(run: Callable[[str, dict[str, Any]], dict[str, Any]], reruns: int) -> ExactFigures:
    """*run(label, changes)* runs the campaign's engine spec with *changes* and returns the result JSON."""
    figures = ExactFigures(reruns=reruns)
    first = run("unchanged-0", {})
    figures.metrics_per_run = len(exact_metrics(first))
    for i in range(1, reruns + 1):
        figures.false_alarms += [f"rerun {i}: {name}" for name in compare_exact(first, run(f"unchanged-{i}", {}))]
    for label, (changes, metric) in PLANTED_EXACT.items():
        figures.planted[label] = compare_exact(first, run(label, changes))
        figures.expected[label] = metric
    return figures


# -- the campaign ----------------------------------------------------------------------

@dataclass
class Campaign:
    """What ``vramgate calibrate`` runs (defaults sized for a 2-core machine: about 12 minutes)."""

    model: str = "tiny-llama"
    pairs: int = 3
    """Engine pairs per condition (fresh processes each: run-to-run variation)."""
    rounds: int = 90
    """Round pairs per engine pair (cut into trials of ``trial_rounds``)."""
    trial_rounds: int = 30
    """Rounds per trial: as many as the gate's paired latency test takes (``PairedDefaults.rounds``)."""
    exact_reruns: int = 1
    stats: tuple[str, ...] = ("tpot", "e2e", "step")


def run_campaign(root: Path, out: Path, campaign: Campaign, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the campaign on this machine's engine; write ``calibration.json`` and ``calibration.md`` into *out*."""
    from vramgate.engine import apply_loaded_profile, latency_spec, run_engine
    from vramgate.engine.paired import PairedEngines, PairedResult, round_stat
    from vramgate.profiles import load_profile

    out.mkdir(parents=True, exist_ok=True)
    spec = latency_spec(campaign.model)
    started = time.time()
    raw: dict[str, list[dict[str, list[float]]]] = {}
    for condition, delay in DELAYS.items():
        raw[condition] = []
        for pair in range(campaign.pairs):
            candidate = spec.replace(env={"VRAMGATE_PLANT_DELAY": str(delay)}) if delay else spec
            run_dir = out / "runs" / f"{condition}-{pair}"
            with PairedEngines(spec, candidate, root, run_dir, cache_root=out / "vllm-cache") as engines:
                res: PairedResult = engines.run(campaign.rounds, seed=pair)
            raw[condition].append({f"{side}_{stat}": [round_stat(r, stat) for r in rounds]
                                   for stat in campaign.stats for side, rounds in (("a", res.a), ("b", res.b))})
            log(f"calibrate: {condition} pair {pair}: median tpot ratio "
                f"{sorted(res.ratios('tpot'))[len(res.a) // 2]:.3f} ({time.time() - started:.0f} s)")

    def engine_run(label: str, changes: dict[str, Any]) -> dict[str, Any]:
        exact = exact_run_spec(campaign.model).replace(**{k: v for k, v in changes.items() if k != "plant"})
        plant = [load_profile(PLANTS / changes["plant"])] if "plant" in changes else []
        resolved, paths = apply_loaded_profile(exact, plant[0], out / "overlays") if plant else (exact, [])
        result = run_engine(resolved, root, out / "runs" / f"exact-{_slug(label)}", extra_pythonpath=paths,
                            cache_root=out / "vllm-cache")
        log(f"calibrate: exact run {label} done ({time.time() - started:.0f} s)")
        return result.to_json()

    exact = run_exact(engine_run, campaign.exact_reruns)
    data = {"campaign": campaign.__dict__ | {"stats": list(campaign.stats)}, "spec": spec.to_json(),
            "raw": raw, "exact": exact.to_json(), "seconds": time.time() - started}
    data["figures"] = figures_json(raw, campaign.trial_rounds, campaign.stats)
    (out / "calibration.json").write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    (out / "calibration.md").write_text(render(data), encoding="utf-8")
    return data


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-")


def exact_run_spec(model: str) -> Any:
    """The exact runs' spec: 16 requests of 128 + 64 tokens at a 0.25 GiB KV budget."""
    from vramgate.engine import EngineSpec

    return EngineSpec(model=model, workload="fixed", requests=16, block_size=32, max_model_len=1024,
                      kv_budget_gib=0.25)


def figures_json(raw: dict[str, Any], trial_rounds: int, stats: Sequence[str]) -> dict[str, Any]:
    """Per statistic in *stats*, the :func:`sweep` of *raw* cut into trials of *trial_rounds* rounds, as JSON data."""
    return {stat: [f.to_json() for f in sweep(make_trials(raw, stat, trial_rounds))] for stat in stats}


def merge_campaigns(campaigns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pool the engine pairs of several saved campaigns (same spec and statistics) into one."""
    if not campaigns:
        raise ValueError("no campaign to merge")
    first = campaigns[0]
    for other in campaigns[1:]:
        if other.get("spec") != first.get("spec") or other["campaign"]["stats"] != first["campaign"]["stats"]:
            raise ValueError("campaigns with different specs or statistics cannot be pooled")
    out = dict(first)
    out["raw"] = {c: [pair for data in campaigns for pair in data["raw"].get(c, [])] for c in first["raw"]}
    out["seconds"] = sum(float(data["seconds"]) for data in campaigns)
    out["campaign"] = dict(first["campaign"], pairs=sum(d["campaign"]["pairs"] for d in campaigns),
                           rounds=min(d["campaign"]["rounds"] for d in campaigns))
    return out


def realized(raw: dict[str, Any], stat: str) -> dict[str, float]:
    """Per condition, the median of candidate / reference over every pair: the shift actually planted."""
    from vramgate.core.metrics import median

    return {condition: median([y / x for pair in pairs for x, y in zip(pair[f"a_{stat}"], pair[f"b_{stat}"],
                                                                        strict=True)])
            for condition, pairs in raw.items()}


def render(data: dict[str, Any]) -> str:
    """calibration.md: the figures as tables."""
    lines = ["# Gate precision on this machine", ""]
    c = data["campaign"]
    lines += [f"Model {c['model']}; {c['pairs']} engine pairs per condition, {c['rounds']} round pairs each, "
              f"trials of {c['trial_rounds']} rounds; {data['seconds']:.0f} s.", ""]
    ex = data.get("exact")
    if ex:
        lines += ["## Exact metrics", "",
                  f"Unchanged reruns: {ex['reruns']} ({ex['comparisons']} comparisons), false alarms: "
                  f"{len(ex['false_alarms'])} {ex['false_alarms'] or ''}", ""]
        for label, p in ex["planted"].items():
            lines.append(f"- planted {label}: {'detected' if p['detected'] else 'MISSED'} (expected "
                         f"{p['expected']}; caught by {', '.join(p['caught_by']) or 'nothing'})")
        lines.append("")
    for stat, rows in data["figures"].items():
        shifts = ", ".join(f"{c} {v - 1:+.1%}" for c, v in realized(data["raw"], stat).items())
        lines += [f"## Measured: {stat}", "", f"Median candidate / reference over all pairs: {shifts}.", "",
                  "Paired ratios against history (the gate's paired latency tests), A/B within one trial, and raw "
                  "samples against another run's (the gate's plain measured metrics).", "",
                  "| tolerance | alpha | paired: false alarms | paired: +5% | paired: +10% | A/B: false alarms "
                  "| A/B: +10% | raw: false alarms | raw: +10% | paired meets |", "|---" * 10 + "|"]
        for f in rows:
            def show(r: dict[str, Any]) -> str:
                return f"{r['hits']}/{r['trials']} ({r['rate']:.1%})"
            det = f["history_detection"]
            lines.append(f"| {f['tolerance']:.1%} | {f['alpha']} | {show(f['history_false_alarms'])} | "
                         f"{show(det['delay-5%'])} | {show(det['delay-10%'])} | {show(f['ab_false_alarms'])} | "
                         f"{show(f['ab_detection']['delay-10%'])} | {show(f['raw_false_alarms'])} | "
                         f"{show(f['raw_detection']['delay-10%'])} | {'yes' if f['meets_targets'] else 'no'} |")
        lines.append("")
    return "\n".join(lines)
