"""vLLM's offline engine in a subprocess: specs, the runner, the worker, paired A/B runs.

Import this layer's public names from here (``from vramgate.engine import ...``), not from its modules,
which may split or move.
"""

from vramgate.engine.paired import (
    PairedEngines,
    PairedResult,
    paired_defaults,
)
from vramgate.engine.runner import (
    KV_TOO_SMALL,
    EngineCache,
    EngineError,
    EngineResult,
    EngineSpec,
    SpecError,
    UnsupportedHere,
    backend_problem,
    cpu_backend_problem,
    engine_tier,
    kernel_problem,
    kv_need,
    run_engine,
    validate,
)

__all__ = [
    "KV_TOO_SMALL",
    "EngineCache",
    "EngineError",
    "EngineResult",
    "EngineSpec",
    "PairedEngines",
    "PairedResult",
    "SpecError",
    "UnsupportedHere",
    "backend_problem",
    "cpu_backend_problem",
    "engine_tier",
    "kernel_problem",
    "kv_need",
    "paired_defaults",
    "run_engine",
    "validate",
]
