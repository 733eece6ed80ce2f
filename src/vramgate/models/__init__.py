"""Models: the one reader of ``fixtures/models/<name>/config.json`` and the analytic sizes built on it
(KV cache, attention, fused MoE, quantized weights), plus tiny quantized checkpoints.

The model-config names (the former ``vramgate.models`` module's) are exported here; the other modules'
names are imported from their modules (``from vramgate.models.quant import weight_size``).
"""

from vramgate.models.config import (
    KV_DTYPE_BYTES,
    ModelConfigError,
    ModelShape,
    available_models,
    load_model,
    models_dir,
    read_config,
)

__all__ = [
    "KV_DTYPE_BYTES",
    "ModelConfigError",
    "ModelShape",
    "available_models",
    "load_model",
    "models_dir",
    "read_config",
]
