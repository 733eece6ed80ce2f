"""The recall models answer what they were made to answer (Note [recall weights] in vramgate.models.recall_weights).

The pressure and block_manager suites hold vLLM's answers on ``recall-llama`` to the task; this checks the
committed checkpoints themselves with the reference modules (what vLLM's Llama and DeepSeek-V2 compute), and that
the command in each ``recall.json`` still makes a model that answers everything, with margins that batch order and
kernel rounding cannot close.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.testing.answers import check_recall_model

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("the recall models' own answers: a property of the fixtures, not of a profile")


@pytest.mark.parametrize("arch", ["llama", "deepseek-v2"])
def test_recall_model_answers_every_prompt(gate: Gate, project_root: Path, tmp_path: Path, arch: str) -> None:
    """The committed checkpoint answers every judging prompt in bf16, and its command remakes one that does too
    (the same file on the machine and torch release that made it: recorded, not required)."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    folder = project_root / "fixtures" / "models" / f"recall-{arch}"
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
