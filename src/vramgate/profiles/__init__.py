"""Optimization profiles: ``patches/<name>/manifest.toml`` and its ordered diffs against vLLM."""
