"""vLLM's offline engine in a subprocess: specs, the runner, the worker, paired A/B runs."""
