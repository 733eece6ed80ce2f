"""The simulator: vLLM's real scheduler and KV cache manager driven by a synthetic model runner."""
