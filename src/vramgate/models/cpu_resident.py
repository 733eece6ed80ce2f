"""What vLLM 0.32.0's CPU engine keeps as model parameters after loading a quantized checkpoint.

Built on the checkpoint's tensors (:mod:`vramgate.models.quant`) and the CPU's ISA class
(:mod:`vramgate.machine.isa`); Note [CPU resident weights] says where it differs from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramgate.machine import isa
from vramgate.models.quant import (
    CHECKPOINT_FORMATS,
    DEFAULT_GROUP_SIZE,
    DTYPE_BYTES,
    SCHEMES,
    QuantConfigError,
    checkpoint_tensors,
    layout,
)


@dataclass(frozen=True)
class Resident:
    """What vLLM 0.32.0's CPU engine keeps as model parameters after loading a checkpoint."""

    parameter_bytes: int
    differences: tuple[tuple[str, int], ...]
    """(what, bytes) that the parameters differ from the checkpoint by (negative: not kept)."""


#: Llama-style HF modules vLLM 0.32.0 fuses into one layer: q/k/v -> qkv_proj, gate/up -> gate_up_proj.
_LLAMA_VLLM_MODULES_PER_LAYER = 4


def vllm_cpu_resident(cfg: dict[str, Any], scheme: str, group_size: int = DEFAULT_GROUP_SIZE,
                      where: str = "config", *, isa_class: str, dtype: str = "bfloat16",
                      int4_w4a8: bool = True) -> Resident:
    """Parameter bytes vLLM 0.32.0's CPU engine holds after loading a *scheme* checkpoint of a Llama-style *cfg*,
    on a CPU of ISA class *isa_class* (:mod:`vramgate.machine.isa`), the engine's model *dtype*, and vLLM's
    ``VLLM_CPU_INT4_W4A8`` (*int4_w4a8*, on by default).

    Note [CPU resident weights]: what vLLM keeps differs from the checkpoint,
    deterministically (read in vLLM 0.32.0's source, confirmed by the
    quantization suite's engine runs):

    - 16-bit, AVX-512 and up: every unquantized ``nn.Linear`` of the decoder
      layers is handed to oneDNN (``dispatch_cpu_unquantized_gemm(remove_weight=True)``):
      its packed copy lives outside the module and the parameter becomes empty.
      The LM head keeps its parameter (``remove_weight=False``) next to its
      oneDNN copy. So the parameters hold embeddings, norms and the LM head
      only; the linear weights are still in memory, invisible to a parameter
      count. Below AVX-512 oneDNN cannot create a bf16 matmul ("Failed to
      create oneDNN linear, fallback to torch linear"): the weights stay
      parameters (measured on tiny-llama's bf16 checkpoint: 35,129,856 B with
      ``VRAMGATE_CPU_ISA=avx2``, 32,770,560 B on AVX-512 + BF16; with
      ``VRAMGATE_CPU_ISA=avx512`` the resident weights are those of AVX-512 + BF16,
      33,294,880 B in the capacity suite).
    - ``awq``: ``qweight``, ``qzeros`` and ``scales`` are repacked in place
      for ``CPUWNA16LinearKernel`` at the same sizes (fp16 scales become the
      model dtype, also 2 bytes).
    - ``gptq``: the kernel drops the zeros of a symmetric checkpoint, and vLLM
      0.32.0 registers no ``g_idx`` parameter (activation reordering is no
      longer supported), so both are not kept.
    - ``w4a16``: vLLM fuses q/k/v and gate/up, keeping one ``weight_shape``
      (16 B) per fused layer instead of one per checkpoint module.
    - 4-bit on a CPU with AMX, bfloat16 activations and ``VLLM_CPU_INT4_W4A8``
      on: ``CPUWNA16LinearKernel`` takes its int4 x int8 path
      (``_process_gptq_weights_w4a8``) and ``convert_weight_packed_scale_zp``
      blocks each layer by 32 output channels. Per output channel and group
      (N x K/group of each layer) the weights gain a 4-byte sum, the zero
      points become one byte each (a symmetric checkpoint gets them too: the
      kernel always needs them) and the scales four (fp32). Measured on
      tiny-llama's checkpoints on an Intel Xeon with AMX: +59,904 B (awq),
      +64,512 B (w4a16) against the checkpoint, gptq 33,443,328 B.
    """
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise QuantConfigError(f"{where}: the CPU resident-bytes model covers llama-style models only "
                               f"(model_type {cfg.get('model_type')!r})")
    lay = layout(cfg, where)
    ckpt = checkpoint_tensors(cfg, scheme, group_size, where)
    total = sum(t.nbytes for t in ckpt)
    diffs: list[tuple[str, int]] = []
    if SCHEMES[scheme].bits == 16:
        linear_names = {f"{lin.name}.weight" for lin in lay.linears}
        if isa.at_least(isa_class, "avx512"):
            diffs.append(("decoder linear weights moved into oneDNN handles (not parameters)",
                          -sum(t.nbytes for t in ckpt if t.name in linear_names)))
    elif scheme == "gptq":
        diffs.append(("qzeros of a symmetric checkpoint, dropped by CPUWNA16LinearKernel",
                      -sum(t.nbytes for t in ckpt if t.name.endswith(".qzeros"))))
        diffs.append(("g_idx, not a parameter in vLLM 0.32.0",
                      -sum(t.nbytes for t in ckpt if t.name.endswith(".g_idx"))))
    elif scheme == "w4a16":
        shapes = [t for t in ckpt if t.name.endswith(".weight_shape")]
        kept = _LLAMA_VLLM_MODULES_PER_LAYER * int(cfg["num_hidden_layers"]) * DTYPE_BYTES["I64"] * 2
        diffs.append(("weight_shape: one per fused vLLM layer (qkv_proj, gate_up_proj) instead of one per module",
                      kept - sum(t.nbytes for t in shapes)))
    elif scheme != "awq":
        raise QuantConfigError(f"scheme {scheme!r}: no CPU resident-bytes model; accepted: bf16, fp16, "
                               f"{', '.join(CHECKPOINT_FORMATS)}")
    if SCHEMES[scheme].bits == 4 and isa.at_least(isa_class, "amx") and dtype == "bfloat16" and int4_w4a8:
        diffs = [d for d in diffs if not d[0].startswith("qzeros")]  # the w4a8 path keeps (or makes) zero points
        channel_groups = sum(lin.out_features * max(1, lin.in_features // group_size if group_size > 0 else 1)
                             for lin in lay.linears if lin.quantized)
        scales = sum(t.nbytes for t in ckpt if t.name.endswith((".scales", ".weight_scale")))
        zeros = sum(t.nbytes for t in ckpt if t.name.endswith((".qzeros", ".weight_zero_point")))
        diffs += [("AMX int4 blocks: a 4-byte sum per output channel and group", 4 * channel_groups),
                  ("AMX int4 blocks: fp32 scales", 4 * channel_groups - scales),
                  ("AMX int4 blocks: an int8 zero point per output channel and group", channel_groups - zeros)]
    return Resident(total + sum(d for _, d in diffs), tuple(diffs))
