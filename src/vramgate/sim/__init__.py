"""The simulator: vLLM's real scheduler and KV cache manager driven by a synthetic model runner.

Import this layer's public names from here (``from vramgate.sim import ...``), not from its modules,
which may split or move.
"""

from vramgate.sim.probe import SchedulerProbe
from vramgate.sim.simulator import (
    SimResult,
    SimulationError,
    settings_of_engine,
    simulate,
)

__all__ = [
    "SchedulerProbe",
    "SimResult",
    "SimulationError",
    "settings_of_engine",
    "simulate",
]
