"""Latency of each engine profile against the unpatched engine, paired A/B in one run.

Note [paired latency] in ``vramgate.engine.paired``: both engines are up at once and
take turns on the same workload, so the per-round ratio profile / unpatched
cancels the machine's drift. The ratios are a measured metric: they regress
against the stored baseline when their median grows by more than the paired
tolerance and a Mann-Whitney U test is clear. ``vramgate calibrate`` measured
the tolerance, the rounds per test and the figures they give on a 2-core CPU
(false alarms and detections of a planted +10%: see docs/calibration.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.testing import (
    ModelLoader,
    PairedEngines,
    Profile,
    confirmed_rounds,
    engine_tier,
    latency_spec,
    paired_defaults,
    runnable_candidate,
    skip_unmet,
)


@pytest.mark.gate_profiles("latency")
def test_profile_latency_ratio(gate: Gate, vllm_env: Path, project_root: Path, model_shape: ModelLoader,
                               tmp_path: Path, profile: Profile, request: pytest.FixtureRequest) -> None:
    """Per-round median engine step of the profile over the unpatched engine's, on the calibration workload; a
    failing first look is confirmed by a second (Note [second look] in vramgate.engine.paired)."""
    skip_unmet(profile)
    tier = engine_tier()
    reference = latency_spec("tiny-llama")
    candidate = runnable_candidate(reference, profile, model_shape(reference.model).use_mla)
    settings = paired_defaults(tier)
    with PairedEngines(reference, candidate, project_root, tmp_path, cache_root=vllm_env / "cache") as engines:
        reference_rounds, candidate_rounds, looks = confirmed_rounds(engines, settings, seed=0)
    request.node.add_report_section("call", "vramgate paired looks", "\n".join(looks))
    assert len(reference_rounds) == len(candidate_rounds) == settings.rounds * (1 if len(looks) == 1 else 2)
    gate.record_paired(f"{settings.stat}_ratio", reference_rounds, candidate_rounds, tolerance=settings.tolerance,
                       alpha=settings.alpha, history_tolerance=settings.history_tolerance)
