"""The built-in default matrix: the one a project without a ``vramgate.toml`` gets.

It declares the suites' own fixtures (the models, block sizes and KV dtypes of the kv_cache, capacity and latency
suites, the serving configurations and loads of the serving suites). It ships once, as package data
(``vramgate/matrix/default.toml``); the repository runs on it, and a team writes its own ``vramgate.toml`` to
run what it serves instead (``examples/team-matrix.toml``).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from vramgate.matrix.loader import Matrix, parse_matrix

#: The default matrix's file name in this package.
DEFAULT_FILE = "default.toml"
#: Where errors in the built-in default say it came from.
DEFAULT_SOURCE = "<built-in default matrix>"


def default_matrix_text() -> str:
    """The built-in default matrix's TOML text (package data)."""
    return resources.files(__package__).joinpath(DEFAULT_FILE).read_text(encoding="utf-8")


def default_matrix_path() -> Path | None:
    """The built-in default matrix's file, where the package is a folder of files (a checkout, an installed
    wheel); None where it is not (a zip)."""
    path = Path(__file__).with_name(DEFAULT_FILE)
    return path if path.is_file() else None


def default_matrix() -> Matrix:
    """The built-in default matrix (model configs not checked against a project: they are the repository's), the
    entries whose suites are declared (Note [matrix suites]): a project without the repository's kv_cache suite,
    say, runs the default's other entries."""
    return parse_matrix(default_matrix_text(), DEFAULT_SOURCE, undeclared=True)
