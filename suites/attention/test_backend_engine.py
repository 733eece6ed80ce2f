"""The MLA attention backends the profiles force, in vLLM's engine (GPU tier): the KV cache they give at a fixed
budget with the backend's own kernel block size, and their engine step against vLLM's automatic choice.

The profiles' hypothesis (``patches/attention-*``): with a fixed KV budget (``kv_cache_memory_bytes``) the KV
capacity is the same whatever the backend, up to one block of rounding (FlashMLA runs block size 64 only), and
what a backend moves is the transient memory of attention and the latency. So each profile's run records the
capacity, the block size and the allocator's peak (Note [allocator peak] in vramgate.engine.measure), and fails
when the capacity moved by a block or more against the automatic choice's; the paired test gates the step's
latency of the profile over the automatic choice's, both engines up at once (Note [paired latency]).

vLLM's CPU build has its CPU MLA backend only: on the CPU tier every case skips (``[requires] device = "cuda"``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.testing import Engine
from vramgate.testing.engines import EngineSpec, engine_tier, latency_spec, record_paired_step
from vramgate.testing.profiles import Profile, runnable_candidate, skip_unmet, unpatched

#: The DeepSeek-class (MLA) model the backends run: 576 values per token and layer (kv_lora_rank 512 + rope 64).
MODEL = "tiny-deepseek-v2"
#: A fixed KV budget, so a backend cannot move the capacity by more than its block size's rounding.
CAPACITY_SPEC = EngineSpec(model=MODEL, workload="fixed", requests=8, block_size=16, max_model_len=1024,
                           kv_budget_gib=0.25)


def block_size_of(profile: Profile | None, default: int) -> int:
    """The block size a profile's backend runs (its ``block_size`` engine argument), else *default*."""
    return int(profile.engine_args.get("block_size", default)) if profile is not None else default


def gpu_tier_only() -> None:
    """Skip on the CPU tier: these cases measure CUDA backends."""
    if engine_tier() == "cpu":
        pytest.skip("GPU tier: the attention profiles force CUDA MLA backends; vLLM's CPU build has CPU_MLA and "
                    "AMX_MLA only")


@pytest.mark.gate_profiles("attention", reference="automatic")
def test_backend_kv_capacity(gate: Gate, engine: Engine, profile: Profile | None) -> None:
    """The KV capacity at a fixed budget with the profile's backend, within one block of vLLM's automatic choice's."""
    gpu_tier_only()
    skip_unmet(profile)
    spec = CAPACITY_SPEC.replace(block_size=block_size_of(profile, CAPACITY_SPEC.block_size))
    if profile is not None:
        spec = runnable_candidate(spec, profile, use_mla=True)
    result = engine.run(spec)
    kv = result.kv
    gate.record("capacity_tokens", kv.capacity_tokens, unit="tokens", better="higher")
    gate.record("kv_block_size", kv.block_size, unit="tokens")
    gate.record("bytes_per_token", kv.bytes_per_token, unit="B")
    peak = result.memory.cuda_max_allocated_bytes
    if peak is not None:
        gate.record("peak_allocated_bytes", peak, unit="B", tolerance=0.05, scope="machine")
    if profile is not None:
        automatic = engine.run(unpatched(CAPACITY_SPEC)).kv  # Note [the unpatched reference]
        moved = abs(int(kv.capacity_tokens) - int(automatic.capacity_tokens))
        block = max(int(kv.block_size), int(automatic.block_size))
        assert moved < block, (
            f"profile {profile.name} moved the KV capacity at a fixed budget by {moved} tokens (more than one block "
            f"of {block}): {kv.capacity_tokens} tokens at block size {kv.block_size} against the automatic "
            f"choice's {automatic.capacity_tokens} at {automatic.block_size}")


@pytest.mark.gate_profiles("attention")
def test_backend_latency_ratio(gate: Gate, vllm_env: Path, project_root: Path, tmp_path: Path, profile: Profile,
                               request: pytest.FixtureRequest) -> None:
    """Per-round median engine step of the profile's backend over vLLM's automatic choice, at the same block size;
    a failing first look is confirmed by fresh engines (Note [second look] in vramgate.engine.looks: a GPU-tier test,
    two looks)."""
    gpu_tier_only()
    skip_unmet(profile)
    reference = latency_spec(MODEL)
    reference = reference.replace(block_size=block_size_of(profile, reference.block_size))
    candidate = runnable_candidate(reference, profile, use_mla=True)
    record_paired_step(gate, reference, candidate, request, project_root=project_root, run_dir=tmp_path,
                       cache_root=vllm_env / "cache", who=profile.name, expectation=profile.outputs)
