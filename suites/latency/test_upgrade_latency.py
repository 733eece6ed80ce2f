"""Latency of the vLLM being upgraded to against the one being upgraded from, paired A/B across two engine
environments.

Only in an upgrade run (``--gate-upgrade-from PY``; ``vramgate upgrade`` sets it). Note [paired latency] in
``vramgate.engine.paired``: the two engines are up at once, each under its own environment's interpreter and
vLLM, and take turns on the same workload, so the per-round ratio new / old cancels the machine's drift. The
metric fails when the new version is slower by more than the paired tolerance with a one-sided U test clear
(the tolerance and rounds ``vramgate calibrate`` measured for profiles; docs/calibration.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.testing.answers import check_round_answers
from vramgate.testing.engines import EngineEnv, PairedEngines, engine_tier, latency_spec, paired_defaults


@pytest.mark.gate_matrix("latency", id="{model}")
def test_upgrade_latency_ratio(gate: Gate, vllm_env: Path, project_root: Path, tmp_path: Path,
                               upgrade_from: EngineEnv, model: str, block_size: int) -> None:
    """Per-round median engine step under the new vLLM over the old one's, on the calibration workload, for each
    model and block size of the matrix's latency entries."""
    candidate = latency_spec(model).replace(block_size=block_size)
    reference = candidate.replace(python=upgrade_from.python)
    settings = paired_defaults(engine_tier())
    with PairedEngines(reference, candidate, project_root, tmp_path, cache_root=vllm_env / "cache") as engines:
        result = engines.run(settings.rounds, seed=0)
    reference_rounds, candidate_rounds = result.stats(settings.stat)
    assert len(reference_rounds) == len(candidate_rounds) == settings.rounds
    old, new = result.versions["a"], result.versions["b"]
    assert old.get("vllm") == upgrade_from.vllm, f"the engine of the old version ran {old}"
    assert new.get("vllm") != old.get("vllm"), f"both engines ran vLLM {new.get('vllm')}"
    gate.record_paired(f"upgrade_{settings.stat}_ratio", reference_rounds, candidate_rounds,
                       tolerance=settings.tolerance, alpha=settings.alpha)
    # Note [round answers]: the rounds' tokens, where the model answers a task (test_upgrade_answers judges the
    # recall models' tokens and logprobs)
    check_round_answers(gate, result.answers(), who=f"this upgrade (vLLM {old.get('vllm')} -> {new.get('vllm')})",
                        model=model)
