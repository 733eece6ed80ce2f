"""A matrix suite declared in code: for a suite outside the project's ``suites/`` folder, whose declaration file
the matrix does not read (Note [suite files] in :mod:`vramgate.matrix.suite_files`)."""

from __future__ import annotations

from vramgate.matrix.suites import SuiteRule, register_suite


def matrix_suite(name: str, *, metrics: tuple[str, ...], kv_only: bool = False, serving: bool = False,
                 load: bool = False, one_block_size: bool = False) -> SuiteRule:
    """Declare suite *name* to the matrix: the metrics it records (which budgets may name) and what it reads of an
    entry (see :class:`~vramgate.matrix.suites.SuiteRule`). A suite under ``suites/<name>/`` declares itself in
    ``suite.toml`` there instead; one elsewhere calls this from the project's root ``conftest.py``, before the
    matrix is read."""
    return register_suite(SuiteRule(name, metrics, kv_only, serving, load, one_block_size))

