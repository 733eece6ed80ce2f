"""Every profile's answers on every recall model, against the unpatched engine's (Note [the same answer] in
vramgate.core.answers).

A profile is judged on its outputs whatever suites its manifest names: each recall model (a Llama, a Llama with
grouped-query attention, a DeepSeek-V2 with MLA: ``RECALL_MODELS``) answers its judging prompts with the profile
applied, and its tokens and logprobs are held to the unpatched run's of the same prompts under the profile's
``[outputs]`` expectation. The unpatched runs are the ones ``suites/pressure/test_recall_models.py`` holds to the
task (the same specs: one run per model per session and worker). An MLA kernel change shows on
``recall-deepseek-v2`` only, a grouped-query one on ``recall-llama-gqa`` only: each model is a row of its own.

A quantized profile is judged on its own checkpoints by the quantization suite (its answers against bf16's); a
profile this tier cannot run says why it is not judged here.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine, ModelLoader
from vramgate.testing.answers import check_answers
from vramgate.testing.engines import (
    RECALL_MODELS,
    TRACE_ENV,
    capacity_probe_spec,
    capacity_spec,
    engine_tier,
    recall_judging_spec,
)
from vramgate.testing.profiles import DIFF_LINES_PROPERTY, Profile, runnable_candidate, skip_unmet, unpatched

#: Pre-merge (tox -e cpu): every profile on the grouped-query Llama, in the capacity check's engine runs (the KV cache
#: vLLM sizes itself, filled by the judging prompts: preemptions included): one engine run per profile serves both.
#: The plain Llama and the MLA model run in the full gate (tox -e cpu-full, nightly), one engine run per profile each,
#: at the small runs' KV budget.
PRE_MERGE_ARCH = "llama-gqa"
ARCHS = [arch if arch == PRE_MERGE_ARCH else
         pytest.param(arch, marks=pytest.mark.gate_nightly(
             f"every profile's answers on recall-{arch}: one engine run each; pre-merge judges every profile on "
             f"recall-{PRE_MERGE_ARCH}"))
         for arch in sorted(RECALL_MODELS)]


@pytest.mark.gate_judges("answers")
@pytest.mark.gate_profiles()
@pytest.mark.parametrize("arch", ARCHS)
def test_profile_answers(gate: Gate, engine: Engine, model_shape: ModelLoader, profile: Profile, arch: str,
                         request: pytest.FixtureRequest) -> None:
    """The profile's outputs on the recall model *arch* against the unpatched run's, under its expectation."""
    skip_unmet(profile)
    if profile.checkpoint is not None:
        pytest.skip(f"profile {profile.name} quantizes the model: the quantization suite judges its answers on its "
                    "own checkpoints (suites/quantization/test_accuracy.py)")
    # Pre-merge, the runs are the capacity check's (suites/profile_capacity/test_profile_capacity.py): one engine
    # start judges both, with the KV cache vLLM sized itself filled and preempting (Note [full KV cache]).
    spec = (capacity_spec(arch, engine.run(unpatched(capacity_probe_spec(arch)))) if arch == PRE_MERGE_ARCH
            else recall_judging_spec(arch))
    use_mla = model_shape(spec.model).use_mla
    backend = str(profile.engine_args.get("attention_backend", ""))
    if backend and ("MLA" in backend.upper()) != use_mla:
        pytest.skip(f"not judged here: profile {profile.name} forces the {backend} attention backend, which "
                    f"{spec.model} ({'MLA' if use_mla else 'no MLA'}) cannot run; the other recall models judge it")
    candidate = runnable_candidate(spec, profile, use_mla)
    # Note [diff ran] in vramgate.engine.diff_lines: the candidate watches which of the diff's lines run
    candidate = candidate.replace(env={**candidate.env, TRACE_ENV: "1"})
    reference = engine.run(unpatched(spec))  # Note [the unpatched reference] in vramgate.engine.spec
    result = engine.run(candidate)
    check_answers(gate, profile, result, reference, context=spec.model)
    if result.diff is not None:  # the profile's row says whether its lines ran (Note [profile verdict])
        request.node.user_properties.append((DIFF_LINES_PROPERTY, (result.diff.ran_count, result.diff.changed_count)))
        request.node.add_report_section("call", "vramgate diff ran", result.diff.describe())
        reason = result.diff.not_run_reason(engine_tier())
        if reason:
            pytest.skip(reason)
