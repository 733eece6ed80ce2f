"""Models: the one reader of ``fixtures/models/<name>/config.json`` and the analytic sizes built on it
(KV cache, attention, fused MoE, quantized weights), plus tiny quantized checkpoints. Names are imported from their
modules (``from vramgate.models.config import load_model``, ``from vramgate.models.quant import weight_size``).
"""
