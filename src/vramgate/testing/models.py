"""Model configs of ``fixtures/models`` by name, for the suites."""

from __future__ import annotations

from pathlib import Path

from vramgate.models.attention import TORCH_FLASH_EXTRA, AttentionShape, explain_splits, torch_flash_transient_bytes
from vramgate.models.config import ModelShape, load_model, read_config
from vramgate.models.cpu_resident import vllm_cpu_resident
from vramgate.models.moe import (
    MoEShape,
    expert_load,
    make_weights,
    naive_moe,
    reference_moe,
    reference_overhead_bound,
    route,
    workspace_bytes,
)
from vramgate.models.vllm_kv import vllm_kv_layout

__all__ = [
    "TORCH_FLASH_EXTRA",
    "AttentionShape",
    "MoEShape",
    "ModelLoader",
    "ModelShape",
    "expert_load",
    "explain_splits",
    "make_weights",
    "naive_moe",
    "read_config",
    "reference_moe",
    "reference_overhead_bound",
    "route",
    "torch_flash_transient_bytes",
    "vllm_cpu_resident",
    "vllm_kv_layout",
    "workspace_bytes",
]


class ModelLoader:
    """Loads a model config of ``<root>/fixtures/models`` by name: ``loader("deepseek-v3")``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, name: str) -> ModelShape:
        """The :class:`~vramgate.models.config.ModelShape` of model *name*."""
        return load_model(self.root, name)

    def path(self, name: str) -> Path:
        """The folder of model *name* (its ``config.json``), as vLLM takes it."""
        return load_model(self.root, name).path.parent
