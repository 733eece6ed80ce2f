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
from vramgate.testing.engines import RECALL_MODELS, recall_judging_spec
from vramgate.testing.profiles import Profile, runnable_candidate, skip_unmet

#: Not in the pre-merge set yet (tox -e cpu): one engine run per profile and recall model; the full gate (tox -e
#: cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("every profile's answers on every recall model: one engine run each")


@pytest.mark.gate_profiles()
@pytest.mark.parametrize("arch", sorted(RECALL_MODELS))
def test_profile_answers(gate: Gate, engine: Engine, model_shape: ModelLoader, profile: Profile, arch: str) -> None:
    """The profile's outputs on the recall model *arch* against the unpatched run's, under its expectation."""
    skip_unmet(profile)
    if profile.checkpoint is not None:
        pytest.skip(f"profile {profile.name} quantizes the model: the quantization suite judges its answers on its "
                    "own checkpoints (suites/quantization/test_accuracy.py)")
    spec = recall_judging_spec(arch)
    use_mla = model_shape(spec.model).use_mla
    backend = str(profile.engine_args.get("attention_backend", ""))
    if backend and ("MLA" in backend.upper()) != use_mla:
        pytest.skip(f"not judged here: profile {profile.name} forces the {backend} attention backend, which "
                    f"{spec.model} ({'MLA' if use_mla else 'no MLA'}) cannot run; the other recall models judge it")
    candidate = runnable_candidate(spec, profile, use_mla)
    reference = engine.run(spec)
    result = engine.run(candidate)
    check_answers(gate, profile, result, reference, context=spec.model)
