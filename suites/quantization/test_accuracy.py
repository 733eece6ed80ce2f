"""Task accuracy of each 4-bit checkpoint against bf16's, on a model whose answers mean something.

The suite's other checks run tiny-llama on random (or dummy) weights: real bytes and real kernels, but answers that
mean nothing. Here each quantization profile's format is written from the recall model's weights instead
(recall-llama, Note [quantized recall] in :mod:`vramgate.models.checkpoints`), and the engine runs it and the bf16
model on the same 16 recall prompts (16 to 1,000 tokens, 32 to 64 generated; one bf16 run per session for every
profile: :func:`vramgate.testing.quantization.accuracy_reference_spec`). The profile's ``[outputs]`` expectation
judges the pair (for a quantized model by default: task accuracy within 0.05 of bf16's, Note [the same answer] in
:mod:`vramgate.core.answers`); the bf16 run itself must answer every prompt, as its model was made to.

The figures (``task_accuracy``, ``reference_task_accuracy``, ``tokens_equal_fraction``) are held to the budget only,
never to a stored baseline: which tokens a 4-bit kernel's rounding flips is the machine's (kernel library, ISA), and
the budget is the claim. Where this machine's vLLM has no 4-bit kernel (``cpu_gemm_wna16`` is in its AVX-512
libraries only) a profile's test skips with the reason, before its checkpoint is written or either engine runs.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import QuantRuns
from vramgate.testing.answers import check_answers, check_task_accuracy
from vramgate.testing.profiles import Profile
from vramgate.testing.quantization import checkpoint_of


@pytest.mark.gate_judges("answers")
@pytest.mark.gate_profiles("quantization", reference="bf16")
def test_task_accuracy(gate: Gate, quant_runs: QuantRuns, profile: Profile | None) -> None:
    """bf16: every recall answer right; a quantized checkpoint: task accuracy within its budget of bf16's."""
    model = quant_runs.accuracy_reference.model
    if profile is None:
        problem = quant_runs.four_bit_problem()
        if problem:  # the bf16 run is the quantized runs' reference; the block_manager suite checks vLLM's answers
            pytest.skip(f"no quantized checkpoint runs on this machine, so no bf16 reference either: {problem}")
        check_task_accuracy(gate, quant_runs.accuracy_run(None), context=f"{model} (bf16)")
        return
    run = quant_runs.accuracy_run(profile)  # skips here, before anything runs, where the kernel is missing
    reference = quant_runs.accuracy_run(None)
    ck = checkpoint_of(profile)
    check_answers(gate, profile, run, reference, labels=("quantized", "bf16"),
                  context=f"{model} {ck.format} g{ck.group_size}")
