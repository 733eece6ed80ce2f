"""Preemption and recomputation under a KV budget that forces them.

When the KV cache runs out, vLLM's v1 scheduler preempts the most recently
admitted running request, frees its blocks and later recomputes its tokens.
These figures are what a block-manager change (an admission watermark, an
eviction policy) has to improve. Both the simulator (a 2,000-request
ShareGPT-like trace) and the real CPU engine (the same kind of trace, smaller)
are gated; the engine's figures are checked against the simulator's.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine, Simulator
from vramgate.testing.engines import PRESSURE_SPEC
from vramgate.testing.simulator import build

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("the simulator's agreement with the engine: block_manager gates the profiles")

#: KV pool of the simulated run: 2,048 blocks of 16 tokens (32k tokens) for up to 256 sequences.
SIM_KV_BLOCKS = 2048


def test_simulated_pressure(gate: Gate, simulator: Simulator) -> None:
    workload = build("sharegpt", requests=2000, seed=0, max_model_len=4096)
    result = simulator.run("tiny-llama", workload, block_size=16, num_gpu_blocks=SIM_KV_BLOCKS, max_model_len=4096)
    gate.record("preemptions", result.preemptions, unit="count")
    gate.record("preempted_requests", result.preempted_requests, unit="requests")
    gate.record("recomputed_tokens", result.recomputed_tokens, unit="tokens")
    gate.record("peak_blocks", result.peak_blocks_used, unit="blocks", ceiling=SIM_KV_BLOCKS - 1)
    gate.record("virtual_throughput", round(result.throughput_tokens_per_s, 3), unit="tokens/s", better="higher",
                tolerance=1e-6)
    assert result.preemptions > 0, "the budget was meant to force preemptions; none happened"


def test_engine_pressure(gate: Gate, engine: Engine) -> None:
    result = engine.run(PRESSURE_SPEC)
    sched = result.scheduler
    gate.record("preemptions", sched.preemptions, unit="count")
    gate.record("recomputed_tokens", sched.recomputed_tokens, unit="tokens")
    gate.record("peak_blocks", sched.peak_blocks_in_use, unit="blocks", ceiling=result.kv.usable_blocks)
    assert sched.preemptions == sched.preemptions_by_request, (
        "the scheduler probe and vLLM's per-request stats disagree on preemptions"
    )
    assert sched.preemptions > 0, "the budget was meant to force preemptions; none happened"


def test_simulator_agrees_with_engine(gate: Gate, engine: Engine, simulator: Simulator) -> None:
    """The same trace, pool and limits through the engine and through the simulator (async scheduling as the
    engine ran it: off on CPU, on by default on CUDA)."""
    spec = PRESSURE_SPEC
    result = engine.run(spec)
    if not result.scheduler.chunked_prefill:
        pytest.skip("this engine runs without chunked prefill; the simulator models it on")
    workload = build(spec.workload, requests=spec.requests, seed=spec.seed,
                     max_model_len=spec.max_model_len)
    sim = simulator.run(spec.model, workload, **result.simulator_settings())
    figures = {
        "peak_blocks": (sim.peak_blocks_used, result.scheduler.peak_blocks_in_use),
        "preemptions": (sim.preemptions, result.scheduler.preemptions),
        "recomputed_tokens": (sim.recomputed_tokens, result.scheduler.recomputed_tokens),
        "steps": (sim.steps, result.scheduler.steps),
    }
    gate.record("peak_blocks_difference", abs(figures["peak_blocks"][0] - figures["peak_blocks"][1]), unit="blocks",
                ceiling=0)
    gate.record("preemptions_difference", abs(figures["preemptions"][0] - figures["preemptions"][1]), unit="count",
                ceiling=0)
    differ = {k: v for k, v in figures.items() if v[0] != v[1]}
    assert not differ, f"simulator vs engine (simulator, engine): {differ}"
