"""A project's matrix: its ``vramgate.toml`` (or a file named explicitly), else the built-in default, read with
the suites the project declares (Note [suite files] in :mod:`vramgate.matrix.suite_files`)."""

from __future__ import annotations

from pathlib import Path

from vramgate.matrix.default import default_matrix
from vramgate.matrix.loader import MATRIX_FILE, Matrix, load_matrix
from vramgate.matrix.suite_files import declare_project_suites


def matrix_path(root: Path, file: str | Path | None = None) -> Path | None:
    """The matrix file of the project at *root*: *file* (relative to *root* unless absolute; it must exist),
    else ``<root>/vramgate.toml`` when present, else None (the built-in default applies)."""
    if file:
        path = Path(file)
        return path if path.is_absolute() else root / path
    default = root / MATRIX_FILE
    return default if default.is_file() else None


def project_matrix(root: Path, file: str | Path | None = None) -> Matrix:
    """The matrix of the project at *root* (see :func:`matrix_path`), its model configs checked against
    ``<root>/fixtures/models``, its suites those the project declares (``<root>/suites/*/suite.toml``, registered
    first) and any registered before."""
    declare_project_suites(root)
    path = matrix_path(root, file)
    return default_matrix() if path is None else load_matrix(path, root)
