"""The weight-size model (pure) and the checkpoint packer (torch, skipped without it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramgate.models.cpu_resident import vllm_cpu_resident
from vramgate.models.quant import (
    SCHEMES,
    QuantConfigError,
    checkpoint_tensors,
    kv_gain_tokens,
    layout,
    weight_size,
)
from vramgate.profiles import ProfileError, load_profile
from vramgate.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "torch_dtype": "float16"}
#: The ISA class the resident-bytes model is checked at, unless a test names another (oneDNN packs bf16 weights).
ZEN5 = "avx512-bf16"
#: A small Llama-style config for the packer: every linear a multiple of 128 inputs and 32 outputs.
SMALL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512,
         "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def test_llama2_7b_sizes_by_hand() -> None:
    """13.48 GB fp16 and 3.89 GB AWQ g128, against the arithmetic written out here."""
    h, i, layers, v = 4096, 11008, 32, 32000
    linear = layers * (4 * h * h + 3 * h * i)
    dense = 2 * v * h + (2 * layers + 1) * h
    assert weight_size(LLAMA2_7B, "fp16").total_bytes == 2 * (linear + dense) == 13_476_831_232
    # int4 weights + one fp16 scale and one packed 4-bit zero per 128 inputs per output; 16-bit dense tensors.
    awq = linear // 2 + linear // 128 * 2 + linear // 128 // 2 + 2 * dense
    assert weight_size(LLAMA2_7B, "awq").total_bytes == awq == 3_889_307_648
    # GPTQ adds one int32 g_idx per input of every linear layer.
    g_idx = 4 * layers * (6 * h + i)
    assert weight_size(LLAMA2_7B, "gptq").total_bytes == awq + g_idx
    assert round(awq / 1e9, 2) == 3.89 and round(awq / 2**30, 2) == 3.62
    assert round(weight_size(LLAMA2_7B, "fp16").total_bytes / awq, 2) == 3.47


def test_every_scheme_keeps_dense_tensors_in_16_bits() -> None:
    bf16 = weight_size(LLAMA2_7B, "bf16")
    for scheme in SCHEMES:
        size = weight_size(LLAMA2_7B, scheme)
        assert size.dense_bytes == bf16.dense_bytes
        assert size.params == bf16.params == 6_738_415_616


def test_checkpoint_layouts() -> None:
    tensors = {t.name: t for t in checkpoint_tensors(SMALL, "gptq")}
    q = "model.layers.0.self_attn.k_proj"
    assert tensors[f"{q}.qweight"].shape == (256 // 8, 128)
    assert tensors[f"{q}.qzeros"].shape == (2, 128 // 8)
    assert tensors[f"{q}.scales"].shape == (2, 128) and tensors[f"{q}.scales"].dtype == "F16"
    assert tensors[f"{q}.g_idx"].shape == (256,)
    awq = {t.name: t for t in checkpoint_tensors(SMALL, "awq")}
    assert awq[f"{q}.qweight"].shape == (256, 128 // 8) and f"{q}.g_idx" not in awq
    ct = {t.name: t for t in checkpoint_tensors(SMALL, "w4a16")}
    assert ct[f"{q}.weight_packed"].shape == (128, 256 // 8) and ct[f"{q}.weight_scale"].dtype == "BF16"
    assert ct["lm_head.weight"].dtype == "BF16" and ct["model.embed_tokens.weight"].shape == (512, 256)


def test_deepseek_layout() -> None:
    cfg = json.loads((ROOT / "fixtures" / "models" / "deepseek-v3" / "config.json").read_text())
    names = {lin.name for lin in layout(cfg).linears}
    assert "model.layers.3.mlp.experts.255.down_proj" in names and "model.layers.2.mlp.down_proj" in names
    assert "model.layers.0.self_attn.q_a_proj" in names and "model.layers.3.mlp.experts.0.up_proj" in names
    dense = {t.name: t for t in layout(cfg).dense}
    assert dense["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert "model.layers.2.mlp.gate.weight" not in dense  # the first three layers are dense


def test_bad_configs_name_the_field() -> None:
    with pytest.raises(QuantConfigError, match="model_type 'gpt2' is not supported"):
        layout({**SMALL, "model_type": "gpt2"})
    with pytest.raises(QuantConfigError, match="missing field 'hidden_size'"):
        layout({k: v for k, v in SMALL.items() if k != "hidden_size"}, "cfg.json")
    with pytest.raises(QuantConfigError, match="unknown scheme 'int3'"):
        weight_size(SMALL, "int3")
    with pytest.raises(QuantConfigError, match="cannot be packed"):
        weight_size({**SMALL, "intermediate_size": 300}, "awq")


def test_kv_gain_whole_blocks() -> None:
    # 1,746,432 B freed at 1,024 B per token, blocks of 32 tokens (32,768 B): 53 blocks, 1,696 tokens.
    assert kv_gain_tokens(1_746_432, 2**28, 32 * 1024, 32) == 1696
    assert kv_gain_tokens(32 * 1024 - 1, 0, 32 * 1024, 32) == 0
    assert kv_gain_tokens(1, 32 * 1024 - 1, 32 * 1024, 32) == 32  # a partly used budget completes a block
    with pytest.raises(ValueError):
        kv_gain_tokens(1, 0, 0, 32)


def test_cpu_resident_model() -> None:
    gptq = vllm_cpu_resident(SMALL, "gptq", isa_class=ZEN5)
    ckpt = sum(t.nbytes for t in checkpoint_tensors(SMALL, "gptq"))
    dropped = sum(t.nbytes for t in checkpoint_tensors(SMALL, "gptq") if t.name.endswith((".qzeros", ".g_idx")))
    assert gptq.parameter_bytes == ckpt - dropped
    awq_checkpoint = sum(t.nbytes for t in checkpoint_tensors(SMALL, "awq"))
    assert vllm_cpu_resident(SMALL, "awq", isa_class=ZEN5).parameter_bytes == awq_checkpoint
    assert vllm_cpu_resident(SMALL, "bf16", isa_class=ZEN5).parameter_bytes == weight_size(SMALL, "bf16").dense_bytes
    # below AVX-512 oneDNN takes no bf16 linear weights: they stay parameters, as in the checkpoint
    bf16_checkpoint = sum(t.nbytes for t in checkpoint_tensors(SMALL, "bf16"))
    assert vllm_cpu_resident(SMALL, "bf16", isa_class="avx2").parameter_bytes == bf16_checkpoint
    assert vllm_cpu_resident(SMALL, "bf16", isa_class="avx512").parameter_bytes < bf16_checkpoint
    # w4a16: seven weight_shape tensors per layer in the checkpoint, four fused vLLM layers keep one each.
    w4 = vllm_cpu_resident(SMALL, "w4a16", isa_class=ZEN5)
    assert w4.differences[0][1] == -3 * 16
    with pytest.raises(QuantConfigError, match="llama-style"):
        vllm_cpu_resident({**SMALL, "model_type": "deepseek_v2"}, "awq", isa_class=ZEN5)


def write_manifest(tmp_path: Path, checkpoint: str) -> Path:
    d = tmp_path / "patches" / "quant-x"
    d.mkdir(parents=True)
    (d / "manifest.toml").write_text(
        'name = "quant-x"\ndescription = "x"\n[target]\ndistribution = "vllm"\nversion = "==0.32.0"\n'
        f'[engine_args]\nquantization = "awq"\n{checkpoint}')
    return d


def test_profile_checkpoint_field(tmp_path: Path) -> None:
    prof = load_profile(write_manifest(tmp_path, '[checkpoint]\nformat = "gptq"\ngroup_size = 64\n'))
    assert prof.checkpoint is not None and (prof.checkpoint.format, prof.checkpoint.group_size) == ("gptq", 64)
    for body, message in (('format = "exl2"', "format 'exl2' is not one of awq, gptq, w4a16"),
                          ('format = "awq"\ngroup_size = 3', "group_size must be an even number"),
                          ('format = "awq"\nbits = 4', r"unknown field\(s\) bits"),
                          ('group_size = 128', "missing field 'format'")):
        with pytest.raises(ProfileError, match=message) as info:
            load_profile(write_manifest(tmp_path / message[:4].strip(), f"[checkpoint]\n{body}\n"))
        assert "[checkpoint]" in str(info.value)


def test_quant_profiles_in_tree() -> None:
    for name, fmt in (("quant-awq", "awq"), ("quant-gptq", "gptq"), ("quant-w4a16", "w4a16")):
        prof = load_profile(ROOT / "patches" / name)
        assert prof.checkpoint is not None and prof.checkpoint.format == fmt and "quantization" in prof.suites


def test_plan_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama-2-7b", "--scheme", "fp16", "--scheme", "awq", "--root", str(ROOT)]) == 0
    out = capsys.readouterr().out
    assert "13.48 GB (12.55 GiB)" in out and "3.89 GB (3.62 GiB)" in out
    assert main(["plan", "llama-2-7b", "--scheme", "int3", "--root", str(ROOT)]) == 2
    assert "unknown scheme(s) int3" in capsys.readouterr().err
    assert main(["plan", "tiny-llama", "--json", "--root", str(ROOT)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["scheme"] for r in rows} == set(SCHEMES)


def test_plan_command_names_a_broken_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama",')
    assert main(["plan", str(bad), "--root", str(ROOT)]) == 2
    assert capsys.readouterr().err.startswith(f"vramgate: error: {bad}: not valid JSON (line 1, column 24: ")


# -- the packer (torch) -------------------------------------------------------------------------------------------

def test_awq_nibble_order_and_round_trip() -> None:
    torch = pytest.importorskip("torch")
    from vramgate.models.checkpoints import AWQ_ORDER, _pack_rows, _unpack_rows, dequantize, pack_awq, reference_weights

    values = torch.arange(16, dtype=torch.int32).reshape(2, 8) % 16
    packed = _pack_rows(values, AWQ_ORDER)
    for k, col in enumerate(AWQ_ORDER):  # nibble k holds column AWQ_ORDER[k]
        assert int((packed[0, 0] >> (4 * k)) & 0xF) == int(values[0, col])
    assert torch.equal(_unpack_rows(packed, AWQ_ORDER), values)
    w = reference_weights(SMALL)["model.layers.0.mlp.down_proj.weight"]
    tensors = pack_awq(w, 128)
    error = float((dequantize("awq", tensors, 128) - w.float()).norm() / w.float().norm())
    assert 0.05 < error < 0.15  # 4-bit round-to-nearest on Gaussian weights: about 10%
    # The same tensors read in sequential nibble order are a different matrix: the order matters.
    wrong = _unpack_rows(tensors["qweight"])
    assert not torch.equal(wrong, _unpack_rows(tensors["qweight"], AWQ_ORDER))


def test_gptq_layout_and_grid() -> None:
    torch = pytest.importorskip("torch")
    from vramgate.models.checkpoints import dequantize, pack_gptq, reference_weights

    w = reference_weights(SMALL)["model.layers.0.self_attn.q_proj.weight"]
    t = pack_gptq(w, 128)
    assert t["qweight"].shape == (256 // 8, 256) and t["g_idx"].tolist() == [i // 128 for i in range(256)]
    assert bool((t["qzeros"] == 0x77777777).all())  # zero 8 stored minus one, as AutoGPTQ writes it
    deq = dequantize("gptq", t, 128)
    steps = deq.t() / t["scales"].float()[t["g_idx"].long()]
    assert torch.allclose(steps, steps.round(), atol=1e-4) and float(steps.abs().max()) <= 8


def test_w4a16_matches_symmetric_rtn() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    from vramgate.models.checkpoints import dequantize, pack_w4a16, reference_weights

    w = reference_weights(SMALL)["model.layers.0.mlp.up_proj.weight"]
    t = pack_w4a16(w, 128)
    scale = t["weight_scale"]
    groups = w.reshape(w.shape[0], -1, 128)
    # compressed-tensors divides in the weight's dtype (bf16), then rounds to the symmetric int4 grid -8..7.
    steps = torch.clamp(torch.round((groups / scale[..., None]).float()), -8, 7).reshape(w.shape)
    assert torch.equal(dequantize("w4a16", t, 128), steps * scale.float().repeat_interleave(128, dim=1))
    assert torch.allclose(scale.float(), (groups.float().abs().amax(dim=2) / 7.5).to(torch.bfloat16).float())


def test_written_checkpoint_matches_size_model(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from vramgate.models.checkpoints import write_checkpoint

    for scheme in ("bf16", "awq", "gptq"):
        ck = write_checkpoint(SMALL, scheme, tmp_path / scheme)
        expected = {t.name: (t.shape, t.dtype, t.nbytes) for t in checkpoint_tensors(SMALL, scheme)}
        assert ck.tensors == expected
        cfg = json.loads((ck.path / "config.json").read_text())
        assert ("quantization_config" in cfg) == (scheme != "bf16")
    with pytest.raises(QuantConfigError, match="unknown checkpoint format 'exl2'"):
        write_checkpoint(SMALL, "exl2", tmp_path / "x")


def test_cpu_resident_model_on_amx() -> None:
    # Note [CPU resident weights]: with AMX, bfloat16 and VLLM_CPU_INT4_W4A8 (vLLM's default), the int4 x int8 path
    # blocks the weights: per output channel and group, a 4-byte sum, an int8 zero point and an fp32 scale.
    cfg = json.loads((Path(__file__).resolve().parents[1] / "fixtures/models/tiny-llama/config.json").read_text())
    # vLLM 0.32.0's own parameter bytes for tiny-llama's checkpoints on an Intel Xeon with AMX
    assert vllm_cpu_resident(cfg, "awq", 128, isa_class="amx").parameter_bytes == 33_443_328
    assert vllm_cpu_resident(cfg, "gptq", 128, isa_class="amx").parameter_bytes == 33_443_328
    assert vllm_cpu_resident(cfg, "w4a16", 128, isa_class="amx").parameter_bytes == 33_443_456
    # the same checkpoints where the w4a16 path runs: below AMX, in float16, or with VLLM_CPU_INT4_W4A8=0
    for kwargs in ({"isa_class": "avx512-bf16"}, {"isa_class": "amx", "dtype": "float16"},
                   {"isa_class": "amx", "int4_w4a8": False}):
        assert vllm_cpu_resident(cfg, "awq", 128, **kwargs).parameter_bytes == 33_383_424  # type: ignore[arg-type]
    assert vllm_cpu_resident(cfg, "bf16", isa_class="amx") == vllm_cpu_resident(cfg, "bf16", isa_class="avx512-bf16")
