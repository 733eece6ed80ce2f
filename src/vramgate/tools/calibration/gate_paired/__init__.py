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

Its parts: :mod:`.trials` (a trial, the exact bounds of a rate), :mod:`.campaign` (``run``), :mod:`.rules` (the
gate's rules on trials), :mod:`.model` (the noise model and its bootstrap), :mod:`.analyze` (``analyze``),
:mod:`.render` (the Markdown), :mod:`.cli` (``vramgate calibrate paired``, or ``python -m`` this package).
"""


from __future__ import annotations

from vramgate.tools.calibration.gate_paired.analyze import analyze, ratios_in, stored_ratios
from vramgate.tools.calibration.gate_paired.campaign import run
from vramgate.tools.calibration.gate_paired.cli import main
from vramgate.tools.calibration.gate_paired.model import NoiseModel, bootstrap_model, percentile, simulate
from vramgate.tools.calibration.gate_paired.render import render
from vramgate.tools.calibration.gate_paired.rules import (
    BASELINE_PAIRS,
    MAX_BASELINES,
    MAX_FURTHER,
    Rules,
    further_looks,
    judge_against_own,
    judge_group,
    median_ratio,
)
from vramgate.tools.calibration.gate_paired.trials import (
    CONDITIONS,
    FLOOR_GROUP,
    PLANTED,
    TrialData,
    floor_sums,
    load_trials,
    lower_bound,
    show_rate,
    upper_bound,
)

__all__ = [
    "BASELINE_PAIRS",
    "CONDITIONS",
    "FLOOR_GROUP",
    "MAX_BASELINES",
    "MAX_FURTHER",
    "PLANTED",
    "NoiseModel",
    "Rules",
    "TrialData",
    "analyze",
    "bootstrap_model",
    "floor_sums",
    "further_looks",
    "judge_against_own",
    "judge_group",
    "load_trials",
    "lower_bound",
    "main",
    "median_ratio",
    "percentile",
    "ratios_in",
    "render",
    "run",
    "show_rate",
    "simulate",
    "stored_ratios",
    "upper_bound",
]
