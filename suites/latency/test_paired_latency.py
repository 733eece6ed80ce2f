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
from vramgate.testing import ModelLoader
from vramgate.testing.engines import latency_spec, record_paired_step
from vramgate.testing.profiles import Profile, runnable_candidate, skip_unmet


@pytest.mark.gate_judges("latency")
@pytest.mark.gate_profiles()
def test_profile_latency_ratio(gate: Gate, vllm_env: Path, project_root: Path, model_shape: ModelLoader,
                               tmp_path: Path, profile: Profile, request: pytest.FixtureRequest) -> None:
    """Per-round median engine step of the profile over the unpatched engine's, on the calibration workload; a
    failing first look is confirmed by fresh engines (Note [three looks] in vramgate.engine.looks on the CPU tier,
    Note [second look] on a GPU)."""
    skip_unmet(profile)
    if profile.checkpoint is not None:
        pytest.skip(f"profile {profile.name} quantizes the model: the quantization suite judges its latency on its "
                    "own checkpoint (suites/quantization/test_quant_latency.py)")
    reference = latency_spec("tiny-llama")
    candidate = runnable_candidate(reference, profile, model_shape(reference.model).use_mla)
    record_paired_step(gate, reference, candidate, request, project_root=project_root, run_dir=tmp_path,
                       cache_root=vllm_env / "cache", who=profile.name, expectation=profile.outputs)
