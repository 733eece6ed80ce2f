"""A campaign's analysis as Markdown: a row per profile and condition, the noise model's rates, the per-gate-run
figures."""

from __future__ import annotations

import math
from typing import Any

from vramgate.tools.calibration.gate_paired.trials import show_rate


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
