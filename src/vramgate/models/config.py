"""Model configs in ``fixtures/models/<name>/config.json`` and their analytic KV sizes.

The analytic formulas are written from the model architecture, independently
of vLLM, so that a suite can hold vLLM's own accounting against them:

- full attention (MHA/GQA): ``2 (K and V) x num_kv_heads x head_dim x dtype bytes``
  per token and layer;
- MLA (DeepSeek-V2/V3): one latent of ``kv_lora_rank + qk_rope_head_dim``
  (512 + 64 = 576) elements per token and layer, no separate V, shared by
  all heads.

A page is ``block_size`` tokens of one layer; a KV budget holds
``budget // (page x layers)`` blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramgate.core.records import read_json

#: Bytes per element of a KV cache dtype; "auto" means the model's dtype.
KV_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")


class ModelConfigError(ValueError):
    """A model config that is missing, unreadable or lacks a field; names the file and field."""


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model config that size its KV cache."""

    name: str
    path: Path
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    use_mla: bool
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    dtype: str

    @property
    def kv_head_size(self) -> int:
        """Elements per KV head and token: head_dim, or the MLA latent (kv_lora_rank + rope dim)."""
        if self.use_mla:
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return self.kv_lora_rank + self.qk_rope_head_dim

        return self.head_dim

    def dtype_bytes(self, kv_cache_dtype: str) -> int:
        """Bytes per KV cache element for *kv_cache_dtype* (``auto``: the model's dtype); ValueError if unknown."""
        name = self.dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        try:
            return KV_DTYPE_BYTES[name]
        except KeyError:
            raise ValueError(
                f"KV cache dtype {kv_cache_dtype!r} (model dtype {self.dtype!r}) is not known; "
                f"accepted: auto, {', '.join(sorted(KV_DTYPE_BYTES))}"
            ) from None

    def bytes_per_token_layer(self, kv_cache_dtype: str = "auto") -> int:
        """KV bytes one token takes in one layer."""
        per_elem = self.dtype_bytes(kv_cache_dtype)
        if self.use_mla:
            return self.kv_head_size * per_elem
        return 2 * self.num_kv_heads * self.head_dim * per_elem

    def bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        """KV bytes one token takes across all layers."""
        return self.num_layers * self.bytes_per_token_layer(kv_cache_dtype)

    def page_bytes(self, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """Bytes of one page: ``block_size`` tokens of one layer."""
        return block_size * self.bytes_per_token_layer(kv_cache_dtype)

    def capacity_blocks(self, budget_bytes: int, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """Whole blocks (all layers) that fit in *budget_bytes*."""
        return budget_bytes // (self.page_bytes(block_size, kv_cache_dtype) * self.num_layers)

    def capacity_tokens(self, budget_bytes: int, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """Tokens of KV that fit in *budget_bytes* (whole blocks only)."""
        return self.capacity_blocks(budget_bytes, block_size, kv_cache_dtype) * block_size


def models_dir(root: Path) -> Path:
    """The folder of the model configs: ``<root>/fixtures/models``."""
    return root / "fixtures" / "models"


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object of a model's ``config.json``; :class:`ModelConfigError` names the file and what is wrong
    (it cannot be read, it is not JSON, or it is not a JSON object).

    The one reader of model configs: :func:`load_model` and the weight-size model
    (:mod:`vramgate.models.quant`) both read through it.
    """
    data = read_json(path, ModelConfigError)
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: must be a JSON object, not {type(data).__name__}")
    return data


def available_models(root: Path) -> list[str]:
    """Names of the model configs under ``<root>/fixtures/models``."""
    base = models_dir(root)
    return sorted(p.parent.name for p in base.glob("*/config.json"))


def _field(cfg: dict[str, Any], path: Path, *names: str, default: Any = None, required: bool = True) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if required and default is None:
        raise ModelConfigError(f"{path}: missing field {' or '.join(repr(n) for n in names)}")
    return default


def load_model(root: Path, name: str) -> ModelShape:
    """Read ``<root>/fixtures/models/<name>/config.json`` into a :class:`ModelShape`."""
    path = models_dir(root) / name / "config.json"
    if not path.is_file():
        known = ", ".join(available_models(root)) or "none"
        raise ModelConfigError(f"unknown model {name!r}: no {path}; available: {known}")
    cfg = read_config(path)
    model_type = str(_field(cfg, path, "model_type"))
    heads = int(_field(cfg, path, "num_attention_heads"))
    hidden = int(_field(cfg, path, "hidden_size"))
    use_mla = model_type in _MLA_TYPES and cfg.get("kv_lora_rank") is not None
    return ModelShape(
        name=name,
        path=path,
        model_type=model_type,
        num_layers=int(_field(cfg, path, "num_hidden_layers")),
        num_attention_heads=heads,
        num_kv_heads=int(_field(cfg, path, "num_key_value_heads", default=heads)),
        head_dim=int(_field(cfg, path, "head_dim", default=hidden // heads)),
        use_mla=use_mla,
        kv_lora_rank=int(cfg["kv_lora_rank"]) if use_mla else None,
        qk_rope_head_dim=int(_field(cfg, path, "qk_rope_head_dim")) if use_mla else None,
        dtype=str(_field(cfg, path, "torch_dtype", "dtype", default="bfloat16")),
    )
