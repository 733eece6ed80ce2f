"""Tensor-parallel runs as real process groups: the launcher (no torch) and the rank worker.

Import this layer's public names from here (``from vramgate.tp import ...``), not from its modules,
which may split or move.
"""

from vramgate.tp.launcher import (
    DTYPE_BYTES,
    Launcher,
    MLPShape,
    RankResult,
    TPError,
    TPSpec,
    TPSpecError,
    VariantResult,
    launcher,
    overlap_fraction,
    peak_change,
    run_tp,
)

__all__ = [
    "DTYPE_BYTES",
    "Launcher",
    "MLPShape",
    "RankResult",
    "TPError",
    "TPSpec",
    "TPSpecError",
    "VariantResult",
    "launcher",
    "overlap_fraction",
    "peak_change",
    "run_tp",
]
