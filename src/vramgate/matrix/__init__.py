"""The declared matrix (``vramgate.toml``): models, workloads, and which suites run them where, under which
budgets. The testing layer parametrizes the suites from it; ``vramgate matrix`` prints and checks it."""

from vramgate.matrix.default import DEFAULT_SOURCE, DEFAULT_TOML, default_matrix
from vramgate.matrix.loader import (
    MATRIX_FILE,
    TIERS,
    Budget,
    Entry,
    Matrix,
    MatrixError,
    Model,
    Serving,
    ServingLoad,
    Workload,
    load_matrix,
    parse_budget,
    parse_matrix,
)
from vramgate.matrix.project import matrix_path, project_matrix
from vramgate.matrix.select import Machine, collection_problem, gpu_count_problem, missing_trace
from vramgate.matrix.suites import SuiteRule, register_suite, suite_rules

__all__ = [
    "DEFAULT_SOURCE",
    "DEFAULT_TOML",
    "MATRIX_FILE",
    "TIERS",
    "Budget",
    "Entry",
    "Machine",
    "Matrix",
    "MatrixError",
    "Model",
    "Serving",
    "ServingLoad",
    "SuiteRule",
    "Workload",
    "collection_problem",
    "default_matrix",
    "gpu_count_problem",
    "load_matrix",
    "matrix_path",
    "missing_trace",
    "parse_budget",
    "parse_matrix",
    "project_matrix",
    "register_suite",
    "suite_rules",
]
