"""Latency of each engine profile against the unpatched engine, paired A/B in one run.

Note [paired latency] in ``vramgate.engine.paired``: both engines are up at once and
take turns on the same workload, so the per-round ratio profile / unpatched
cancels the machine's drift. The ratios are a measured metric: they regress
against the stored baseline when their median grows by more than the paired
tolerance and a Mann-Whitney U test is clear. ``vramgate calibrate`` measured
the tolerance, the rounds per test and the figures they give on a 2-core CPU
(false alarms and detections of a planted +10%: see the README).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate.engine.paired import PairedEngines, paired_defaults
from vramgate.engine.runner import cpu_backend_problem, engine_tier, kernel_problem
from vramgate.profiles.manifest import find_profile, profiles_for_suite, unmet_here
from vramgate.pytest_plugin.fixture import Gate

ROOT = Path(__file__).resolve().parents[2]
PROFILE = [pytest.param(p.name, id=p.name) for p in profiles_for_suite(ROOT, "block_manager")]


@pytest.mark.parametrize("profile", PROFILE)
def test_profile_latency_ratio(gate: Gate, vllm_env: Path, model_shape, tmp_path: Path, profile: str) -> None:
    """Per-round median engine step of the profile over the unpatched engine's, on the calibration workload."""
    from vramgate.tools.calibration.engine_latency import latency_spec

    prof = find_profile(ROOT, profile)
    tier = engine_tier()
    problem = unmet_here(prof, "cpu" if tier == "cpu" else "cuda")
    reference = latency_spec("tiny-llama")
    candidate = reference.replace(profile=profile)
    if not problem and tier == "cpu":
        dtype = str(prof.engine_args.get("kv_cache_dtype", reference.kv_cache_dtype))
        problem = cpu_backend_problem(reference.replace(kv_cache_dtype=dtype), model_shape(reference.model).use_mla)
    if problem:
        pytest.skip(f"profile {profile} on this tier: {problem}")
    problem = kernel_problem(candidate.replace(engine_args={**prof.engine_args, **candidate.engine_args}))
    if problem:
        pytest.skip(f"not on this machine: profile {profile}: {problem}")
    settings = paired_defaults(tier)
    with PairedEngines(reference, candidate, ROOT, tmp_path, cache_root=vllm_env / "cache") as engines:
        result = engines.run(settings.rounds, seed=0)
    reference_rounds, candidate_rounds = result.stats(settings.stat)
    assert len(reference_rounds) == len(candidate_rounds) == settings.rounds
    gate.record_paired(f"{settings.stat}_ratio", reference_rounds, candidate_rounds, tolerance=settings.tolerance,
                       alpha=settings.alpha, history_tolerance=settings.history_tolerance)
