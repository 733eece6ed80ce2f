"""The recall models answer what they were made to answer (Note [recall weights] in vramgate.models.recall_weights).

The pressure and block_manager suites hold vLLM's answers on ``recall-llama`` to the task; this checks the
committed checkpoints themselves with the reference modules (what vLLM's Llama and DeepSeek-V2 compute), and that
the command in each ``recall.json`` still makes a model that answers everything, with margins that batch order and
kernel rounding cannot close.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.models import recall

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("the recall models' own answers: a property of the fixtures, not of a profile")


@pytest.mark.parametrize("arch", ["llama", "deepseek-v2"])
def test_recall_model_answers_every_prompt(gate: Gate, project_root: Path, tmp_path: Path, arch: str) -> None:
    """The committed checkpoint answers every prompt of the judging set in bf16, and the script remakes one that
    does too (the same file on the machine and torch release that made it)."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    import torch
    from safetensors.torch import load_file

    from vramgate.models import recall_weights as rw

    folder = project_root / "fixtures" / "models" / f"recall-{arch}"
    described = recall.RecallModel.read(folder)
    assert described is not None, f"{folder} has no {recall.MODEL_FILE}"
    model = rw.build(rw.ARCHS[arch])
    model.load_state_dict({k: v.float() for k, v in load_file(str(folder / described.weights)).items()})
    accuracy, margin = rw.evaluate(model, rw.eval_lengths(described.seed))
    gate.record("committed_accuracy", accuracy, unit="ratio", better="higher", history=False)
    gate.record("committed_min_margin", round(margin, 2), unit="logits", better="higher", history=False)
    assert accuracy == 1.0 and margin >= rw.MIN_MARGIN, (
        f"{folder}: the committed weights answer {accuracy:.1%} with a smallest margin of {margin:.2f} logits")
    torch.set_num_threads(1)
    remade, accuracy, margin = rw.make(rw.ARCHS[arch], described.seed)
    path = rw.save(remade, rw.ARCHS[arch], tmp_path / arch, described.command, described.seed, accuracy, margin)
    assert accuracy == 1.0 and margin >= rw.MIN_MARGIN, (
        f"`{described.command}` now makes a model that answers {accuracy:.1%} with a smallest margin of "
        f"{margin:.2f} logits (Note [recall weights])")
    same = hashlib.sha256(path.read_bytes()).hexdigest() == described.sha256
    gate.record("remade_identical", int(same), unit="bool", history=False)
