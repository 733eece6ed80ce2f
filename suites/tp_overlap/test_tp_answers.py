"""Tensor parallelism computes what one rank computes: every recall model at TP=2 against TP=1.

Each recall model (a Llama, a Llama with grouped-query attention, a DeepSeek-V2 with MLA) answers its judging
prompts at a tensor parallelism of 1 and of 2, and the TP=2 run's tokens and logprobs are held to the TP=1 run's
as an ``identical`` expectation holds a profile's (Note [identical logprobs] in vramgate.core.answers). The recall
models put their circuit on heads that the two ranks split (layer 0 on rank 0's heads, layer 1 on rank 1's: Note
[recall weights]), so a rank that computes its heads wrong, a KV head split the wrong way or an all-reduce that
drops a rank changes the answers. On the CPU tier each rank gets a core of its own (``tensor_parallel_spec``); on
a GPU it needs two.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine
from vramgate.testing.answers import check_same_answers
from vramgate.testing.engines import RECALL_MODELS, recall_judging_spec, tensor_parallel_spec

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("tensor parallelism's answers: no optimization profile changes them")


@pytest.mark.parametrize("arch", sorted(RECALL_MODELS))
def test_tp2_answers_as_tp1(gate: Gate, engine: Engine, arch: str) -> None:
    """The recall model at TP=2 answers its judging prompts as at TP=1, token for token and logprob for logprob."""
    single = recall_judging_spec(arch)
    parallel, problem = tensor_parallel_spec(single, 2)
    if problem:
        pytest.skip(f"not judged here: {problem}")
    reference = engine.run(single)
    candidate = engine.run(parallel)
    check_same_answers(gate, candidate, reference, what="tensor parallelism 2", labels=("TP=2", "TP=1"),
                       context=single.model)
