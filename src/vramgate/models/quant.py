"""Analytic weight sizes of quantized checkpoints, tensor by tensor (pure Python, no torch).

For a model config (``config.json`` of a Llama-style or DeepSeek-V2/V3 model)
and a scheme, :func:`checkpoint_tensors` lists every tensor the checkpoint
holds, with its name, shape and safetensors dtype, so its byte count can be
held against a real checkpoint to the byte. The layouts are the on-disk
formats vLLM loads:

- ``bf16`` / ``fp16``: every weight in 16 bits.
- ``awq`` (AutoAWQ GEMM, 4-bit, asymmetric): ``qweight`` int32 ``[in, out/8]``,
  ``qzeros`` int32 ``[groups, out/8]``, ``scales`` fp16 ``[groups, out]``.
- ``gptq`` (AutoGPTQ / GPTQModel format, 4-bit, symmetric): ``qweight`` int32
  ``[in/8, out]``, ``qzeros`` int32 ``[groups, out/8]`` (stored although a
  symmetric checkpoint does not need them), ``scales`` fp16 ``[groups, out]``,
  ``g_idx`` int32 ``[in]``.
- ``w4a16`` (compressed-tensors ``pack-quantized``, 4-bit, symmetric, as
  llm-compressor writes it): ``weight_packed`` int32 ``[out, in/8]``,
  ``weight_scale`` in the model dtype ``[out, groups]``, ``weight_shape``
  int64 ``[2]``.
- ``w8a16`` (compressed-tensors ``pack-quantized``, 8-bit, per output
  channel): ``weight_packed`` int32 ``[out, in/4]``, ``weight_scale``
  ``[out, 1]``, ``weight_shape`` int64 ``[2]``.
- ``fp8`` (compressed-tensors ``float-quantized``, FP8 E4M3 weights with one
  scale per output channel, dynamic activations: llm-compressor's
  ``FP8_DYNAMIC``): ``weight`` fp8 ``[out, in]``, ``weight_scale`` ``[out, 1]``.

``groups`` is ``ceil(in / group_size)``. Embeddings, the LM head, norms,
biases and MoE routers stay in 16 bits (DeepSeek-V3's router correction bias
in fp32, as its checkpoint stores it); every other linear layer of a decoder
layer is quantized. DeepSeek-V3's multi-token-prediction layers are not part
of the served model's weights and are left out.

What vLLM's CPU engine keeps of such a checkpoint after loading it is
:mod:`vramgate.models.cpu_resident`; ``config.json`` is read by
:func:`vramgate.models.config.read_config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Bytes per element of a safetensors dtype.
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "I8": 1, "F8_E4M3": 1}
#: safetensors dtype of a model dtype name.
MODEL_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
DEFAULT_GROUP_SIZE = 128


class QuantConfigError(ValueError):
    """A model config or scheme the size model cannot handle; names the field."""


@dataclass(frozen=True)
class Scheme:
    """How one scheme stores a linear layer's weight."""

    name: str
    description: str
    bits: int
    grouped: bool
    """One scale per ``group_size`` inputs (else per output channel, or none for 16-bit)."""
    quant_method: str | None
    """``quantization_config.quant_method`` of such a checkpoint (None: unquantized)."""


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("bf16", "bfloat16 weights", 16, False, None),
    Scheme("fp16", "float16 weights", 16, False, None),
    Scheme("awq", "AWQ GEMM: int4 packed along outputs, fp16 scales, packed int4 zeros", 4, True, "awq"),
    Scheme("gptq", "GPTQ: int4 packed along inputs, fp16 scales, packed zeros, int32 g_idx", 4, True, "gptq"),
    Scheme("w4a16", "compressed-tensors pack-quantized int4, symmetric, 16-bit scales", 4, True,
           "compressed-tensors"),
    Scheme("w8a16", "compressed-tensors pack-quantized int8 per output channel, 16-bit scales", 8, False,
           "compressed-tensors"),
    Scheme("fp8", "compressed-tensors FP8 E4M3 per output channel, 16-bit scales (FP8_DYNAMIC)", 8, False,
           "compressed-tensors"),
)}
#: Schemes whose checkpoints the packer (:mod:`vramgate.models.checkpoints`) writes.
CHECKPOINT_FORMATS = ("awq", "gptq", "w4a16")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint: name, shape and safetensors dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in its dtype."""
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Linear:
    """A linear layer of the model: HF module name, ``in_features`` x ``out_features``, quantized or not."""

    name: str
    in_features: int
    out_features: int
    quantized: bool = True


@dataclass(frozen=True)
class Layout:
    """A model's weights: the linear layers and every other (16-bit or fp32) tensor."""

    linears: tuple[Linear, ...]
    dense: tuple[TensorInfo, ...]


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise QuantConfigError(f"{where}: missing field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuantConfigError(f"{where}: field {key!r} must be an integer, got {value!r}")
    return value


def layout(cfg: dict[str, Any], where: str = "config") -> Layout:
    """The linear layers and other tensors of a Llama-style or DeepSeek-V2/V3 config, with HF tensor names."""
    model_type = cfg.get("model_type")
    hidden = _int(cfg, "hidden_size", where)
    layers = _int(cfg, "num_hidden_layers", where)
    vocab = _int(cfg, "vocab_size", where)
    dt = MODEL_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))
    if dt is None:
        raise QuantConfigError(f"{where}: field 'torch_dtype' = {cfg.get('torch_dtype')!r} is not one of "
                               f"{', '.join(MODEL_DTYPES)}")
    linears: list[Linear] = []
    dense: list[TensorInfo] = [TensorInfo("model.embed_tokens.weight", (vocab, hidden), dt)]

    def mlp(prefix: str, inter: int) -> None:
        linears.extend([Linear(f"{prefix}.gate_proj", hidden, inter), Linear(f"{prefix}.up_proj", hidden, inter),
                        Linear(f"{prefix}.down_proj", inter, hidden)])

    if model_type in ("llama", "mistral"):
        heads = _int(cfg, "num_attention_heads", where)
        kv_heads = _int(cfg, "num_key_value_heads", where, heads)
        head_dim = _int(cfg, "head_dim", where, hidden // heads)
        inter = _int(cfg, "intermediate_size", where)
        attn_bias, mlp_bias = bool(cfg.get("attention_bias")), bool(cfg.get("mlp_bias"))
        for i in range(layers):
            p = f"model.layers.{i}"
            dense.append(TensorInfo(f"{p}.input_layernorm.weight", (hidden,), dt))
            attn = [Linear(f"{p}.self_attn.q_proj", hidden, heads * head_dim),
                    Linear(f"{p}.self_attn.k_proj", hidden, kv_heads * head_dim),
                    Linear(f"{p}.self_attn.v_proj", hidden, kv_heads * head_dim),
                    Linear(f"{p}.self_attn.o_proj", heads * head_dim, hidden)]
            linears.extend(attn)
            if attn_bias:
                dense.extend(TensorInfo(f"{a.name}.bias", (a.out_features,), dt) for a in attn)
            dense.append(TensorInfo(f"{p}.post_attention_layernorm.weight", (hidden,), dt))
            start = len(linears)
            mlp(f"{p}.mlp", inter)
            if mlp_bias:
                dense.extend(TensorInfo(f"{a.name}.bias", (a.out_features,), dt) for a in linears[start:])
    elif model_type in ("deepseek_v2", "deepseek_v3"):
        heads = _int(cfg, "num_attention_heads", where)
        nope, rope = _int(cfg, "qk_nope_head_dim", where), _int(cfg, "qk_rope_head_dim", where)
        v_dim, kv_rank = _int(cfg, "v_head_dim", where), _int(cfg, "kv_lora_rank", where)
        q_rank = cfg.get("q_lora_rank")
        inter = _int(cfg, "intermediate_size", where)
        experts = _int(cfg, "n_routed_experts", where, 0)
        moe_inter = _int(cfg, "moe_intermediate_size", where, 0)
        shared = _int(cfg, "n_shared_experts", where, 0)
        first_dense = _int(cfg, "first_k_dense_replace", where, 0)
        freq = _int(cfg, "moe_layer_freq", where, 1)
        for i in range(layers):
            p = f"model.layers.{i}"
            dense.append(TensorInfo(f"{p}.input_layernorm.weight", (hidden,), dt))
            if q_rank:
                linears.append(Linear(f"{p}.self_attn.q_a_proj", hidden, int(q_rank)))
                dense.append(TensorInfo(f"{p}.self_attn.q_a_layernorm.weight", (int(q_rank),), dt))
                linears.append(Linear(f"{p}.self_attn.q_b_proj", int(q_rank), heads * (nope + rope)))
            else:
                linears.append(Linear(f"{p}.self_attn.q_proj", hidden, heads * (nope + rope)))
            linears.append(Linear(f"{p}.self_attn.kv_a_proj_with_mqa", hidden, kv_rank + rope))
            dense.append(TensorInfo(f"{p}.self_attn.kv_a_layernorm.weight", (kv_rank,), dt))
            linears.append(Linear(f"{p}.self_attn.kv_b_proj", kv_rank, heads * (nope + v_dim)))
            linears.append(Linear(f"{p}.self_attn.o_proj", heads * v_dim, hidden))
            dense.append(TensorInfo(f"{p}.post_attention_layernorm.weight", (hidden,), dt))
            if experts and i >= first_dense and i % freq == 0:
                dense.append(TensorInfo(f"{p}.mlp.gate.weight", (experts, hidden), dt))
                if cfg.get("topk_method") == "noaux_tc":
                    dense.append(TensorInfo(f"{p}.mlp.gate.e_score_correction_bias", (experts,), "F32"))
                for e in range(experts):
                    mlp(f"{p}.mlp.experts.{e}", moe_inter)
                if shared:
                    mlp(f"{p}.mlp.shared_experts", moe_inter * shared)
            else:
                mlp(f"{p}.mlp", inter)
    else:
        raise QuantConfigError(f"{where}: model_type {model_type!r} is not supported by the weight-size model; "
                               "supported: llama, mistral, deepseek_v2, deepseek_v3")
    dense.append(TensorInfo("model.norm.weight", (hidden,), dt))
    if not cfg.get("tie_word_embeddings", False):
        dense.append(TensorInfo("lm_head.weight", (vocab, hidden), dt))
    return Layout(tuple(linears), tuple(dense))


def linear_tensors(lin: Linear, scheme: str, group_size: int = DEFAULT_GROUP_SIZE,
                   dtype: str = "BF16") -> list[TensorInfo]:
    """The tensors one linear layer takes in a *scheme* checkpoint (*dtype*: the model's 16-bit dtype)."""
    s = _scheme(scheme)
    k, n, name = lin.in_features, lin.out_features, lin.name
    if s.bits == 16 or not lin.quantized:
        return [TensorInfo(f"{name}.weight", (n, k), "F16" if scheme == "fp16" else dtype)]
    if group_size < 1:
        raise QuantConfigError(f"group_size = {group_size}: need a positive number of inputs per group")
    groups = -(-k // group_size)
    if scheme in ("awq", "gptq", "w4a16") and (n % 8 or k % 8):
        raise QuantConfigError(f"{name}: {k} x {n} cannot be packed 8 int4 values per int32 (need multiples of 8)")
    if scheme == "awq":
        return [TensorInfo(f"{name}.qweight", (k, n // 8), "I32"),
                TensorInfo(f"{name}.qzeros", (groups, n // 8), "I32"),
                TensorInfo(f"{name}.scales", (groups, n), "F16")]
    if scheme == "gptq":
        return [TensorInfo(f"{name}.qweight", (k // 8, n), "I32"),
                TensorInfo(f"{name}.qzeros", (groups, n // 8), "I32"),
                TensorInfo(f"{name}.scales", (groups, n), "F16"),
                TensorInfo(f"{name}.g_idx", (k,), "I32")]
    if scheme == "w4a16":
        return [TensorInfo(f"{name}.weight_packed", (n, k // 8), "I32"),
                TensorInfo(f"{name}.weight_scale", (n, groups), dtype),
                TensorInfo(f"{name}.weight_shape", (2,), "I64")]
    if scheme == "w8a16":
        return [TensorInfo(f"{name}.weight_packed", (n, -(-k // 4)), "I32"),
                TensorInfo(f"{name}.weight_scale", (n, 1), dtype),
                TensorInfo(f"{name}.weight_shape", (2,), "I64")]
    # fp8
    return [TensorInfo(f"{name}.weight", (n, k), "F8_E4M3"), TensorInfo(f"{name}.weight_scale", (n, 1), dtype)]


def _scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise QuantConfigError(f"unknown scheme {name!r}; accepted: {', '.join(SCHEMES)}") from None


def checkpoint_tensors(cfg: dict[str, Any], scheme: str, group_size: int = DEFAULT_GROUP_SIZE,
                       where: str = "config") -> list[TensorInfo]:
    """Every tensor of a *scheme* checkpoint of the model *cfg*, in a stable order."""
    lay = layout(cfg, where)
    dt = "F16" if scheme == "fp16" else MODEL_DTYPES[str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")]
    out = [TensorInfo(t.name, t.shape, "F16" if scheme == "fp16" and t.dtype == "BF16" else t.dtype)
           for t in lay.dense]
    for lin in lay.linears:
        out.extend(linear_tensors(lin, scheme, group_size, dt))
    return out


@dataclass(frozen=True)
class WeightSize:
    """A checkpoint's bytes, split into quantized linear layers and tensors kept in 16 bits."""

    model: str
    scheme: str
    group_size: int | None
    total_bytes: int
    linear_bytes: int
    """Bytes of the linear layers in the scheme's format (packed weights, scales, zeros, indices)."""
    dense_bytes: int
    """Embeddings, LM head, norms, biases, routers: kept in 16 bits whatever the scheme."""
    linear_params: int
    dense_params: int

    @property
    def params(self) -> int:
        """Parameters of the whole checkpoint: linear plus dense."""
        return self.linear_params + self.dense_params

    @property
    def bits_per_linear_weight(self) -> float:
        """Bits per weight of the linear layers, scales and zeros included."""
        return 8 * self.linear_bytes / self.linear_params if self.linear_params else 0.0


def weight_size(cfg: dict[str, Any], scheme: str, group_size: int = DEFAULT_GROUP_SIZE, model: str = "",
                where: str = "config") -> WeightSize:
    """Analytic bytes of a *scheme* checkpoint of *cfg*."""
    s = _scheme(scheme)
    lay = layout(cfg, where)
    dt = "F16" if scheme == "fp16" else MODEL_DTYPES[str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")]
    linear_bytes = sum(t.nbytes for lin in lay.linears for t in linear_tensors(lin, scheme, group_size, dt))
    dense_bytes = sum(t.nbytes for t in lay.dense)
    return WeightSize(model=model, scheme=scheme, group_size=group_size if s.grouped else None,
                      total_bytes=linear_bytes + dense_bytes, linear_bytes=linear_bytes, dense_bytes=dense_bytes,
                      linear_params=sum(lin.in_features * lin.out_features for lin in lay.linears),
                      dense_params=sum(t.numel for t in lay.dense))


def quantization_config(scheme: str, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, Any]:
    """The ``quantization_config`` block of an ``awq`` or ``gptq`` checkpoint's ``config.json``.

    (A ``w4a16`` checkpoint's block is written by compressed-tensors itself, see
    :mod:`vramgate.models.checkpoints`.)
    """
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if scheme == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq", "lm_head": False}
    raise QuantConfigError(f"scheme {scheme!r} has no hand-written quantization_config; accepted: awq, gptq")


def kv_gain_tokens(freed_bytes: int, kv_budget_bytes: int, block_bytes: int, block_size: int) -> int:
    """Tokens of KV capacity that *freed_bytes* add to a KV budget (vLLM allocates whole blocks).

    *block_bytes* is one block across all layers (``page bytes x layers``). With
    a budget that is a whole number of blocks this is
    ``floor(freed / block_bytes) x block_size``, i.e. freed bytes / bytes per
    token rounded down to a whole block.
    """
    if block_bytes <= 0 or block_size <= 0:
        raise ValueError(f"block_bytes ({block_bytes}) and block_size ({block_size}) must be positive")
    before = kv_budget_bytes // block_bytes
    after = (kv_budget_bytes + freed_bytes) // block_bytes
    return (after - before) * block_size


def format_bytes(n: float) -> str:
    """``13.48 GB (12.55 GiB)`` for large sizes, ``1,234 B`` otherwise."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} GB ({n / 2**30:.2f} GiB)"
    if n >= 10**6:
        return f"{n / 1e6:.2f} MB ({n / 2**20:.2f} MiB)"
    return f"{int(n):,} B"
