"""Every profile's KV cache, sized by vLLM itself, and the engine's peak memory with that cache full.

Note [full KV cache]: a change to how vLLM sizes its KV cache (its memory profiling, the CPU worker's RSS, the
CUDA-graph estimate) passes every check that gives the engine a KV budget: those runs never size it. And a change
that makes the KV cache larger than the memory holds passes any check whose load does not fill it. So each profile
runs the serving configuration with no KV budget (``cpu_memory`` on CPU, ``gpu_memory_utilization`` on a GPU) at a
memory chosen to leave about :data:`~vramgate.testing.engines.CAPACITY_KV_TOKENS` tokens of KV cache to the unpatched
engine (its non-KV memory, measured by a probe run, plus that many tokens' bytes), and the recall model's judging
prompts, which need about twice that: vLLM fills its KV cache and preempts. The figures come from vLLM's own objects
and the engine's process (:class:`~vramgate.engine.MemoryDecision`):

- the load fills the KV cache vLLM gave (the share of its blocks in use at the peak, from the scheduler's own block
  pool: ``kv_fill``; the unpatched engine's reads 1.0);
- the engine's peak memory with that KV cache full, over the requested memory, is held to :data:`PEAK_CEILING` (an
  absolute budget: the requested memory is what the team gave vLLM): the load's measured peak (the process tree's
  resident memory on CPU, the engine's device memory on a GPU) plus the part of the KV cache the load left unused,
  whose pages a fuller load would touch (``full_kv_peak_fraction``). A profile that makes vLLM size its KV cache past
  the memory fails here whether or not the load reached the end of it;
- the KV cache it gave is recorded beside the unpatched engine's (``kv_capacity_ratio``), not judged: a profile may
  mean to change it.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine, ModelLoader
from vramgate.testing.engines import TRACE_ENV, capacity_probe_spec, capacity_spec, engine_tier
from vramgate.testing.profiles import DIFF_LINES_PROPERTY, Profile, runnable_candidate, skip_unmet, unpatched
from vramgate.testing.quantization import Checkpoints

#: The recall model of the check: its judging prompts are the load. The answers check judges the same runs
#: (suites/answers/test_profile_answers.py, pre-merge): one engine start, two checks.
ARCH = "llama-gqa"
#: The engine's peak with its KV cache full over the requested memory; what unchanged engines and a KV cache sized
#: past the memory read: docs/campaigns/full-kv-capacity.md.
PEAK_CEILING = 1.2


def _quantized(profile: Profile) -> str | None:
    """A quantized profile's case runs nightly: it writes its checkpoint of the recall model first, and its answers
    are the quantization suite's (suites/quantization/test_accuracy.py, pre-merge)."""
    return "a quantized profile's capacity: its checkpoint of the recall model is written first, and the " \
        "quantization suite judges its answers pre-merge" if profile.checkpoint is not None else None


@pytest.mark.gate_judges("capacity")
@pytest.mark.gate_profiles(reference="unpatched", nightly=_quantized)
def test_profile_capacity(gate: Gate, engine: Engine, model_shape: ModelLoader, profile: Profile | None,
                          request: pytest.FixtureRequest) -> None:
    """The KV cache vLLM gives itself with the profile at the capacity configuration, filled by the judging prompts:
    the engine's peak held to the requested memory. A quantized profile loads the recall model quantized as its
    checkpoint (nightly)."""
    skip_unmet(profile)
    # the probe and the reference are unpatched whatever the session applies (Note [the unpatched reference] in
    # vramgate.engine.spec); the case without a profile is the session's engine (the same run without --gate-profile)
    probe = engine.run(unpatched(capacity_probe_spec(ARCH)))
    spec = capacity_spec(ARCH, probe)
    reference = engine.run(unpatched(spec))
    if profile is None:
        result = engine.run(spec)
    else:
        candidate = runnable_candidate(spec, profile, model_shape(spec.model).use_mla)
        if profile.checkpoint is not None:  # the checkpoints fixture needs torch: asked for only here
            checkpoints: Checkpoints = request.getfixturevalue("checkpoints")
            candidate = checkpoints.serve(candidate, profile)
        result = engine.run(candidate.replace(env={**candidate.env, TRACE_ENV: "1"}))
    d = result.decision
    assert d is not None and d.load_peak_bytes is not None, "the run has no memory decision of vLLM's"
    fill = min(1.0, result.scheduler.peak_blocks_in_use / max(1, result.kv.usable_blocks))
    full = (d.load_peak_bytes + (1.0 - fill) * d.available_kv_bytes) / d.requested_bytes
    gate.record("kv_fill", round(fill, 4), unit="ratio", better="higher", scope="machine", history=False)
    gate.record("load_peak_fraction", round(d.load_peak_bytes / d.requested_bytes, 4), unit="ratio",
                scope="machine", history=False)
    gate.record("full_kv_peak_fraction", round(full, 4), unit="ratio", ceiling=PEAK_CEILING, scope="machine",
                history=False)
    assert reference.decision is not None
    gate.record("kv_capacity_ratio", round(d.available_kv_bytes / reference.decision.available_kv_bytes, 4),
                unit="ratio", better="higher", scope="machine", history=False)
    if result.diff is not None:
        request.node.user_properties.append((DIFF_LINES_PROPERTY, (result.diff.ran_count, result.diff.changed_count)))
        request.node.add_report_section("call", "vramgate diff ran", result.diff.describe())
        reason = result.diff.not_run_reason(engine_tier())
        if reason and full <= PEAK_CEILING:
            pytest.skip(reason)
