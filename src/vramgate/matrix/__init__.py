"""The declared matrix (``vramgate.toml``): models, workloads, and which suites run them where, under which
budgets. The testing layer parametrizes the suites from it; ``vramgate matrix`` prints and checks it."""

from vramgate.matrix.default import DEFAULT_SOURCE, default_matrix, default_matrix_path, default_matrix_text
from vramgate.matrix.loader import (
    MATRIX_FILE,
    Budget,
    Entry,
    Matrix,
    MatrixError,
    ServingLoad,
    load_matrix,
    parse_matrix,
)
from vramgate.matrix.project import project_matrix
from vramgate.matrix.select import Machine, collection_problem, gpu_count_problem, missing_trace
from vramgate.matrix.suite_files import SuiteDeclaration, project_suites
from vramgate.matrix.suites import SuiteRule, suite_rules

__all__ = [
    "DEFAULT_SOURCE",
    "MATRIX_FILE",
    "Budget",
    "Entry",
    "Machine",
    "Matrix",
    "MatrixError",
    "ServingLoad",
    "SuiteDeclaration",
    "SuiteRule",
    "collection_problem",
    "default_matrix",
    "default_matrix_path",
    "default_matrix_text",
    "gpu_count_problem",
    "load_matrix",
    "missing_trace",
    "parse_matrix",
    "project_matrix",
    "project_suites",
    "suite_rules",
]
