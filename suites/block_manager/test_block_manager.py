"""Block-manager profiles against the unpatched scheduler, on the same traces, in the same session.

Each profile under ``patches/`` that names this suite runs next to the baseline:
the simulator (vLLM's real scheduler, a 2,000-request ShareGPT-like trace under
KV pressure) and the real CPU engine (``PRESSURE_SPEC``, shared with the pressure suite). Every figure
is gated per profile; each profile's claims are checked against the baseline
run and their verdicts reported, held or not.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine, ModelLoader, Simulator
from vramgate.testing.answers import check_answers, check_task_accuracy
from vramgate.testing.claims import check_claims
from vramgate.testing.engines import (
    PRESSURE_SPEC,
    EngineResult,
    cpu_backend_problem,
    engine_tier,
    unpaired_latency_tolerance,
)
from vramgate.testing.profiles import Profile, skip_unmet, unpatched
from vramgate.testing.simulator import SimResult, build

#: Requests of the simulated trace: 2,000 keep every claim's verdict that 5,000 gave (docs/running.md, "How big each
#: measured run is").
SIM_REQUESTS = 2000
SIM_KV_BLOCKS = 4096
#: Unpaired latency against a stored baseline: the tier's calibrated tolerance (vramgate.testing).
TOLERANCE = unpaired_latency_tolerance()


def simulate(simulator: Simulator, profile: Profile | None) -> SimResult:
    """The 2,000-request ShareGPT-like trace under KV pressure, with *profile* applied (its overlay in a child)."""
    workload = build("sharegpt", requests=SIM_REQUESTS, seed=0, max_model_len=4096)
    return simulator.run("tiny-llama", workload, profile=profile, block_size=16, num_gpu_blocks=SIM_KV_BLOCKS,
                         max_model_len=4096)


def sim_figures(result: SimResult) -> dict[str, float]:
    """The simulated run's figures that profiles' claims may name."""
    data = result.figures()
    return {k: float(data[k]) for k in ("peak_blocks_used", "preemptions", "preempted_requests", "recomputed_tokens",
                                        "prefix_cache_hit_rate", "internal_waste_mean", "throughput_tokens_per_s")}


@pytest.mark.gate_profiles("block_manager", reference="baseline")
def test_simulated_pressure(gate: Gate, simulator: Simulator, profile: Profile | None) -> None:
    skip_unmet(profile)
    if profile is not None and not profile.series and set(profile.engine_args) <= {"kv_cache_dtype"}:
        pytest.skip(f"profile {profile.name} changes only the KV dtype; at a fixed block count the scheduler sees "
                    "no difference (its effect, capacity, is measured by the engine test)")
    figures = sim_figures(simulate(simulator, profile))
    gate.record("peak_blocks", figures["peak_blocks_used"], unit="blocks", ceiling=SIM_KV_BLOCKS - 1)
    gate.record("preemptions", figures["preemptions"], unit="count")
    gate.record("preempted_requests", figures["preempted_requests"], unit="requests")
    gate.record("recomputed_tokens", figures["recomputed_tokens"], unit="tokens")
    gate.record("prefix_cache_hit_rate", round(figures["prefix_cache_hit_rate"], 6), unit="ratio", better="higher",
                tolerance=1e-6)
    gate.record("internal_waste", round(figures["internal_waste_mean"], 6), unit="ratio", tolerance=1e-6)
    gate.record("virtual_throughput", round(figures["throughput_tokens_per_s"], 3), unit="tokens/s",
                better="higher", tolerance=1e-6)
    if profile is not None:
        check_claims(gate, profile, "sharegpt-pressure", figures, sim_figures(simulate(simulator, None)))


def engine_figures(result: EngineResult) -> dict[str, float]:
    """The engine run's figures that profiles' claims may name."""
    sched, lat = result.scheduler, result.latency
    return {
        "preemptions": float(sched.preemptions),
        "recomputed_tokens": float(sched.recomputed_tokens),
        "peak_blocks_in_use": float(sched.peak_blocks_in_use),
        "capacity_tokens": float(result.kv.capacity_tokens),
        "throughput": float(lat.output_throughput_tokens_per_s),
    }


@pytest.mark.gate_judges("answers")  # under KV pressure: what a preemption or a prefix-cache change computes
@pytest.mark.gate_profiles("block_manager", reference="baseline")
def test_engine_pressure(gate: Gate, engine: Engine, model_shape: ModelLoader, profile: Profile | None) -> None:
    """The pressure suite's engine run, with each profile applied: its cost, its claims, and its answers against the
    unpatched run's (the model answers the recall task; the unpatched run must answer it all)."""
    skip_unmet(profile)
    spec = PRESSURE_SPEC if profile is None else PRESSURE_SPEC.replace(profile=profile.name)
    if profile is not None and engine_tier() == "cpu":
        dtype = str(profile.engine_args.get("kv_cache_dtype", spec.kv_cache_dtype))
        problem = cpu_backend_problem(spec.replace(kv_cache_dtype=dtype), model_shape(spec.model).use_mla)
        if problem:
            pytest.skip(f"profile {profile.name} on this tier: {problem}")
    result = engine.run(spec)
    figures = engine_figures(result)
    gate.record("preemptions", figures["preemptions"], unit="count")
    gate.record("recomputed_tokens", figures["recomputed_tokens"], unit="tokens")
    gate.record("capacity_tokens", figures["capacity_tokens"], unit="tokens", better="higher")
    per_request = [n / e for n, e in zip(result.latency.output_lens, result.latency.e2e_s, strict=True) if e]
    gate.record_samples("request_throughput", per_request, unit="tokens/s", better="higher", tolerance=TOLERANCE)
    if profile is None:
        check_task_accuracy(gate, result, context=spec.model)
        return
    reference = engine.run(unpatched(PRESSURE_SPEC))  # Note [the unpatched reference] in vramgate.engine.spec
    check_claims(gate, profile, "engine-pressure", figures, engine_figures(reference))
    # Note [the same answer] in vramgate.core.answers: the profile's answers against the unpatched run's, last
    check_answers(gate, profile, result, reference, context=spec.model)
