"""Quantized checkpoints of the recall model (Note [quantized recall] in vramgate.models.checkpoints): written with a
``recall.json`` that makes the engine load them as real weights and keep their answers, and standing for weights
close to the bf16 ones. No vLLM; the writing needs torch and safetensors (W4A16 also compressed-tensors), and skips
without them."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from vramgate.engine.arguments import load_format
from vramgate.engine.worker import answers_wanted
from vramgate.models.checkpoints import Checkpoint, write_recall_checkpoint
from vramgate.models.quant import QuantConfigError, checkpoint_tensors, layout
from vramgate.models.recall import MODEL_FILE, RecallModel
from vramgate.profiles import load_profile
from vramgate.testing.quantization import RECALL_MODEL, Checkpoints, QuantRuns, accuracy_reference_spec

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "fixtures" / "models" / RECALL_MODEL
WHERE = f"fixtures/models/{RECALL_MODEL}"
FORMATS = ["awq", "gptq", "w4a16"]
#: Relative error (Frobenius) of a dequantized layer against the bf16 weights. The attention weights (at most one
#: non-zero per group of 128 inputs) come back to their fp16 scale on AWQ's asymmetric grid (0.03% measured) and
#: as 7/7.5 or 8/7.5 of themselves on the symmetric one (6.3-6.9%); the MLPs' random weights are rounded as any
#: (10-11%).
ATTENTION_ERROR = {"awq": 1e-3, "gptq": 0.07, "w4a16": 0.07}
MLP_ERROR = 0.12


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _needs(scheme: str) -> None:
    """Skip without the libraries that write *scheme*."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    if scheme == "w4a16":
        pytest.importorskip("compressed_tensors")


def _write(scheme: str, out: Path) -> Checkpoint:
    _needs(scheme)
    return write_recall_checkpoint(SOURCE, scheme, out, where=WHERE)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    """The recall model's checkpoint of a format, written once for the module."""
    made: dict[str, Checkpoint] = {}

    def get(scheme: str) -> Checkpoint:
        if scheme not in made:
            made[scheme] = _write(scheme, tmp_path_factory.mktemp("recall") / scheme)
        return made[scheme]

    return get


@pytest.mark.parametrize("scheme", FORMATS)
def test_quantized_recall_checkpoint(written: Callable[[str], Checkpoint], scheme: str) -> None:
    """The folder: the config with its quantization_config, every tensor the size model says, and a recall.json
    that names the task, the written file's hash and the bf16 model it came from; the engine loads it as real
    weights and keeps its answers."""
    ck = written(scheme)
    cfg = json.loads((SOURCE / "config.json").read_text(encoding="utf-8"))
    written = json.loads((ck.path / "config.json").read_text(encoding="utf-8"))
    assert {k: v for k, v in written.items() if k != "quantization_config"} == cfg
    assert "quantization_config" in written
    expected = {t.name: (t.shape, t.dtype, t.nbytes) for t in checkpoint_tensors(cfg, scheme)}
    assert ck.tensors == expected

    model = RecallModel.read(ck.path)
    source = RecallModel.read(SOURCE)
    assert model is not None and source is not None
    assert model.task == source.task == "recall"
    assert model.weights == "model.safetensors" and model.sha256 == _sha256(ck.weights_path) != source.sha256
    assert model.details["source"]["sha256"] == source.sha256 == _sha256(SOURCE / source.weights)
    assert model.details["source"]["model"] == WHERE
    assert model.details["quantized"]["format"] == scheme and model.details["quantized"]["group_size"] == 128
    assert load_format(ck.path) == "safetensors"
    assert answers_wanted({"model": str(ck.path), "load_format": "safetensors"})
    assert not answers_wanted({"model": str(ck.path), "load_format": "dummy"})
    assert not ck.path.with_name(f"{scheme}.tmp").exists()


@pytest.mark.parametrize("scheme", FORMATS)
def test_dequantized_recall_weights_close_to_bf16(written: Callable[[str], Checkpoint], scheme: str) -> None:
    """Dequantizing the written tensors gives back the bf16 model: its 16-bit tensors bit for bit, every zero of
    a linear layer still zero (the circuit's subspaces stay apart), each layer within its rounding error."""
    ck = written(scheme)
    import torch

    from vramgate.models.checkpoints import dequantize_checkpoint, read_weights

    cfg = json.loads((SOURCE / "config.json").read_text(encoding="utf-8"))
    original = read_weights(SOURCE / "model.safetensors")
    back = dequantize_checkpoint(cfg, ck, WHERE)
    assert set(back) == set(original)
    lay = layout(cfg)
    for t in lay.dense:
        assert torch.equal(back[t.name], original[t.name]), t.name
    for lin in lay.linears:
        name = f"{lin.name}.weight"
        a, b = original[name].float(), back[name].float()
        assert b.shape == a.shape
        assert not bool(((a == 0) & (b != 0)).any()), f"{name}: a zero weight came back non-zero"
        error = float((a - b).norm() / a.norm())
        bound = MLP_ERROR if ".mlp." in name else ATTENTION_ERROR[scheme]
        assert error <= bound, f"{scheme} {name}: {error:.4%} off the bf16 weights (bound {bound:.2%})"


def test_recall_checkpoint_is_reproducible(written: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    """The same model and format give the same file (the hash in recall.json), so two sessions run the same
    weights."""
    first = written("gptq")
    second = _write("gptq", tmp_path / "again")
    assert _sha256(first.weights_path) == _sha256(second.weights_path)
    assert (first.path / MODEL_FILE).read_text(encoding="utf-8") == (second.path / MODEL_FILE).read_text(
        encoding="utf-8")


def test_refuses_a_model_without_recall_weights(tmp_path: Path) -> None:
    """tiny-llama has a config only: nothing whose answers mean something to quantize (no torch needed)."""
    with pytest.raises(QuantConfigError, match="no recall model"):
        write_recall_checkpoint(ROOT / "fixtures" / "models" / "tiny-llama", "awq", tmp_path / "out",
                                where="fixtures/models/tiny-llama")
    assert not (tmp_path / "out").exists()


def test_refuses_weights_other_than_described(tmp_path: Path) -> None:
    """Weights whose hash is not the one recall.json states are not the model it describes (no torch needed)."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", MODEL_FILE):
        shutil.copy(SOURCE / name, model / name)
    (model / "model.safetensors").write_bytes(b"not the weights")
    with pytest.raises(QuantConfigError, match=r"SHA-256 .* but its recall\.json describes"):
        write_recall_checkpoint(model, "gptq", tmp_path / "out")


def test_weights_that_do_not_fit_the_layout(tmp_path: Path) -> None:
    """Given weights must hold the model's tensors in its shapes: the message names what is missing or off."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from vramgate.models.checkpoints import read_weights, write_checkpoint

    cfg = json.loads((SOURCE / "config.json").read_text(encoding="utf-8"))
    weights = read_weights(SOURCE / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    weights[q] = torch.zeros(64, 256, dtype=torch.bfloat16)
    del weights["model.norm.weight"]
    with pytest.raises(QuantConfigError, match=r"missing model\.norm\.weight.*q_proj\.weight is \(64, 256\)"):
        write_checkpoint(cfg, "awq", tmp_path / "out", weights=weights, where=WHERE)


def test_accuracy_runs_share_the_prompts() -> None:
    """The bf16 accuracy run is one spec for every profile: the recall model on 16 prompts of 16 to 1,000 tokens,
    32 to 64 generated, that fit the model length."""
    from vramgate.workloads import build

    spec = accuracy_reference_spec()
    assert spec.model == RECALL_MODEL and spec.profile is None and not spec.engine_args
    workload = build(spec.workload, requests=spec.requests, seed=spec.seed, max_model_len=spec.max_model_len,
                     **spec.workload_params)
    lengths = [(r.prompt_len, r.output_len) for r in workload.requests]
    assert len(lengths) == 16
    assert all(16 <= p <= 1000 and 32 <= o <= 64 and p + o <= spec.max_model_len for p, o in lengths)
    assert max(p for p, _ in lengths) > 900  # the answers reach far back
    assert accuracy_reference_spec().key() == spec.key()


@pytest.mark.parametrize("name", ["quant-awq", "quant-gptq", "quant-w4a16"])
def test_profile_accuracy_spec(tmp_path: Path, name: str) -> None:
    """A quantization profile's accuracy run is the bf16 one's with the profile's checkpoint of the recall model as
    the engine's model, which the engine loads with its answers."""
    profile = load_profile(ROOT / "patches" / name)
    assert profile.checkpoint is not None
    _needs(profile.checkpoint.format)
    runs = QuantRuns(engine=None, checkpoints=Checkpoints(ROOT, tmp_path))  # type: ignore[arg-type]
    spec = runs.accuracy_spec(profile)
    assert spec.replace(profile=None, engine_args={}) == runs.accuracy_spec(None) == runs.accuracy_reference
    folder = Path(spec.engine_args["model"])
    assert folder.parent == tmp_path and spec.engine_args["load_format"] == "safetensors"
    assert answers_wanted(dict(spec.engine_args))
    assert runs.checkpoints.recall(profile.checkpoint.format).path == folder  # written once
    assert profile.outputs.expect == "accuracy"
