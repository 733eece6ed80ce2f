"""Tensor-parallel runs as real process groups: specs and results, the launcher (no torch), the rank worker.

Import this layer's public names from here (``from vramgate.tp import ...``), not from its modules,
which may split or move.
"""

from vramgate.tp.launch import (
    Launcher,
    launcher,
    read_results,
    run_tp,
)
from vramgate.tp.spec import (
    DTYPE_BYTES,
    MLPShape,
    RankResult,
    TPError,
    TPSpec,
    TPSpecError,
    overlap_fraction,
    peak_change,
)

__all__ = [
    "DTYPE_BYTES",
    "Launcher",
    "MLPShape",
    "RankResult",
    "TPError",
    "TPSpec",
    "TPSpecError",
    "launcher",
    "overlap_fraction",
    "peak_change",
    "read_results",
    "run_tp",
]
