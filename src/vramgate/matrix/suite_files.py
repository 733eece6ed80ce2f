"""A project's suites as each declares itself beside its tests: ``suites/<name>/suite.toml``.

Note [suite files]: a suite folder may hold a ``suite.toml`` saying what the gate's tools need to know of the
suite before any of its tests is imported: its matrix rule (``[matrix]``: the metrics its tests record, which an
entry's budgets may name, and what it reads of an entry; Note [matrix suites]) and whether ``vramgate upgrade``
shows its figures side by side (``headline``). A file, not code, so that ``vramgate matrix`` and a pytest run read
the same declarations at the same point: the matrix is read (and checked) before collection, when no suite module
has been imported yet. :func:`vramgate.matrix.project_matrix` registers the project's declared suites before it
reads the matrix. The format (docs/matrix.md, "Suites")::

    headline = true                 # optional: vramgate upgrade shows this suite's figures side by side
    [matrix]                        # optional: matrix entries may name this suite
    metrics = ["page_bytes", ...]   # what its tests record (gate.record's names)
    kv_only = true                  # optional flags, default false: kv_only, serving, load, one_block_size
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from vramgate.matrix.loader import MatrixError, _Reader
from vramgate.matrix.suites import SuiteRule, register_suite

#: The folder of a project's suites, under its root.
SUITES_DIR = "suites"
#: The file in a suite's folder that declares it.
SUITE_FILE = "suite.toml"

_FLAGS = ("kv_only", "serving", "load", "one_block_size")


@dataclass(frozen=True)
class SuiteDeclaration:
    """What one suite's ``suite.toml`` declares (Note [suite files])."""

    name: str
    headline: bool = False
    """``vramgate upgrade`` shows its figures side by side, changed or not."""
    matrix: SuiteRule | None = None
    """Its matrix rule; None for a suite the matrix does not parametrize."""


def read_suite_file(path: Path, source: str | None = None) -> SuiteDeclaration:
    """The declaration in *path* (``<suite>/suite.toml``; the suite is named by its folder); :class:`MatrixError`
    naming *source* (default: the path) and the field when it is not one."""
    source = source or str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise MatrixError(f"{source}: cannot read the suite's declaration: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{source}: not valid TOML: {exc}") from None
    top = _Reader(source, "", data, ("headline", "matrix"))
    name = path.parent.name
    rule = None
    table = top.get("matrix", dict)
    if table is not None:
        r = _Reader(source, "matrix", table, ("metrics", *_FLAGS))
        metrics = r.items("metrics", str, ())
        if not metrics:
            raise r.fail("metrics", "missing field: the metrics the suite's tests record")
        rule = SuiteRule(name, metrics, *(bool(r.get(flag, bool, False)) for flag in _FLAGS))
    return SuiteDeclaration(name, bool(top.get("headline", bool, False)), rule)


def project_suites(root: Path) -> dict[str, SuiteDeclaration]:
    """The suites the project at *root* declares (``<root>/suites/*/suite.toml``), by name."""
    folder = root / SUITES_DIR
    if not folder.is_dir():
        return {}
    out = {}
    for path in sorted(folder.glob(f"*/{SUITE_FILE}")):
        declared = read_suite_file(path, str(path.relative_to(root)))
        out[declared.name] = declared
    return out


def declare_project_suites(root: Path) -> dict[str, SuiteDeclaration]:
    """Register the matrix rules the project at *root* declares (Note [suite files]); its declarations."""
    declared = project_suites(root)
    for suite in declared.values():
        if suite.matrix is not None:
            register_suite(suite.matrix)
    return declared
