"""Models: the one reader of ``fixtures/models/<name>/config.json`` and the analytic sizes built on it
(KV cache, attention, fused MoE, quantized weights), plus tiny quantized checkpoints."""
