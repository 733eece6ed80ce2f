"""The answers of the vLLM being upgraded to against the one being upgraded from, on every recall model.

Only in an upgrade run (``--gate-upgrade-from PY``; ``vramgate upgrade`` sets it). Each recall model (a Llama, a
Llama with grouped-query attention, a DeepSeek-V2 with MLA) answers its judging prompts once under each engine
environment, and the new vLLM's tokens and logprobs are held to the old one's as a profile that must not change
its outputs is (``expect = "identical"``: the same tokens, every logprob within the bound of Note [identical
logprobs] in vramgate.core.answers). A release that changes what a model computes is a finding of the upgrade,
with its first divergence, whatever its speed; one that changes answers on purpose (a fixed kernel) is accepted
by reading that divergence, as ``vramgate upgrade``'s report shows it.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine
from vramgate.testing.answers import check_upgrade_answers
from vramgate.testing.engines import RECALL_MODELS, EngineEnv, recall_judging_spec


@pytest.mark.parametrize("arch", sorted(RECALL_MODELS))
def test_upgrade_answers(gate: Gate, engine: Engine, upgrade_from: EngineEnv, arch: str) -> None:
    """The new vLLM answers the recall model's judging prompts as the old one does."""
    new_spec = recall_judging_spec(arch)
    old = engine.run(new_spec.replace(python=upgrade_from.python))
    new = engine.run(new_spec)
    assert old.versions.get("vllm") == upgrade_from.vllm, f"the old side's engine ran {old.versions}"
    check_upgrade_answers(gate, new, old, context=f"{new_spec.model}, vLLM {upgrade_from.vllm} -> "
                                                   f"{new.versions.get('vllm')}")
