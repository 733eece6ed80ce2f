"""vLLM's offline engine in a subprocess: specs, the runner, the worker, paired A/B runs.

Import this layer's public names from here (``from vramgate.engine import ...``), not from its modules,
which may split or move.
"""

from vramgate.engine.figures import KVFigures, LatencyFigures, MemoryFigures, SchedulerFigures
from vramgate.engine.looks import confirmed_rounds
from vramgate.engine.measure import fusion_problem
from vramgate.engine.memory_decision import MemoryDecision
from vramgate.engine.paired import (
    PairedEngines,
    latency_spec,
    paired_defaults,
)
from vramgate.engine.runner import (
    EngineCache,
    EngineError,
    EngineResult,
    engine_process_env,
    run_engine,
)
from vramgate.engine.spec import (
    KV_TOO_SMALL,
    UNPATCHED,
    EngineSpec,
    SpecError,
    UnsupportedHere,
    apply_loaded_profile,
    apply_profile,
    backend_problem,
    cpu_backend_problem,
    engine_tier,
    kernel_problem,
    kv_need,
    validate,
    with_session_profile,
)

__all__ = [
    "KV_TOO_SMALL",
    "UNPATCHED",
    "EngineCache",
    "EngineError",
    "EngineResult",
    "EngineSpec",
    "KVFigures",
    "LatencyFigures",
    "MemoryDecision",
    "MemoryFigures",
    "PairedEngines",
    "SchedulerFigures",
    "SpecError",
    "UnsupportedHere",
    "apply_loaded_profile",
    "apply_profile",
    "backend_problem",
    "confirmed_rounds",
    "cpu_backend_problem",
    "engine_process_env",
    "engine_tier",
    "fusion_problem",
    "kernel_problem",
    "kv_need",
    "latency_spec",
    "paired_defaults",
    "run_engine",
    "validate",
    "with_session_profile",
]
