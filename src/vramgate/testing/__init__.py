"""What the suites build on: typed fixtures (a pytest plugin, :mod:`vramgate.testing.fixtures`) and helpers.

The project's root ``conftest.py`` loads the plugin. Suites import this
layer's public names from here (``from vramgate.testing import Engine``), not
from its modules, which may split or move.
"""

from vramgate.machine.hardware import computed_tier
from vramgate.testing.claims import check_claims
from vramgate.testing.engines import (
    PRESSURE_SPEC,
    SMALL_RUN_BLOCK_SIZE,
    SMALL_RUN_BUDGET_GIB,
    UNPAIRED_LATENCY_TOLERANCE,
    Engine,
    small_run_block_size,
    small_run_spec,
    unpaired_latency_tolerance,
)
from vramgate.testing.matrix import MatrixCase, apply_budgets, matrix_params, session_matrix
from vramgate.testing.models import ModelLoader
from vramgate.testing.profiles import runnable_candidate, skip_unmet, version_problem
from vramgate.testing.quantization import Checkpoints, QuantRuns, checkpoint_of, linear_kernel_problem
from vramgate.testing.serving import Servers, paired_burst, rate_load, sustained_loads, workload_trace
from vramgate.testing.simulator import Simulator
from vramgate.testing.tp import TPRunner

__all__ = [
    "PRESSURE_SPEC",
    "SMALL_RUN_BLOCK_SIZE",
    "SMALL_RUN_BUDGET_GIB",
    "UNPAIRED_LATENCY_TOLERANCE",
    "Checkpoints",
    "Engine",
    "MatrixCase",
    "ModelLoader",
    "QuantRuns",
    "Servers",
    "Simulator",
    "TPRunner",
    "apply_budgets",
    "check_claims",
    "checkpoint_of",
    "computed_tier",
    "linear_kernel_problem",
    "matrix_params",
    "paired_burst",
    "rate_load",
    "runnable_candidate",
    "session_matrix",
    "skip_unmet",
    "small_run_block_size",
    "small_run_spec",
    "sustained_loads",
    "unpaired_latency_tolerance",
    "version_problem",
    "workload_trace",
]
