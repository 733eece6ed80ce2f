"""What a suite that parametrizes from the matrix lets an entry set: its registration, not a list in the loader.

Note [matrix suites]: an entry names suites, and the loader checks the entry against each suite's rule: the
metrics its budgets may name (a budget on a metric no suite of the entry records could never fail), whether the
suite reads vLLM's KV accounting only (so engine fields would be ignored), whether it runs the team's serving
configuration or load (``[entries.serving]``, ``[entries.load]``), whether it runs one block size per entry.
Each suite declares its rule beside its tests, in ``suites/<name>/suite.toml`` (Note [suite files] in
:mod:`vramgate.matrix.suite_files`), registered when the project's matrix is read; a suite outside the project's
``suites/`` folder registers from the root ``conftest.py`` (:func:`vramgate.testing.matrix_suite`). This layer
knows no suite.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SuiteRule:
    """What the matrix may set for one suite."""

    name: str
    metrics: tuple[str, ...]
    """The metrics the suite records, which an entry's budgets may name."""
    kv_only: bool = False
    """It reads vLLM's KV accounting only: an entry of such suites alone that sets an engine field is refused."""
    serving: bool = False
    """It runs the entry's serving configuration (``[entries.serving]``), which it then needs."""
    load: bool = False
    """It puts the entry's load on vLLM's server (``[entries.load]``), which it then needs."""
    one_block_size: bool = False
    """Its cases are named by the model: an entry gives it one block size."""


_SUITES: dict[str, SuiteRule] = {}


def register_suite(rule: SuiteRule) -> SuiteRule:
    """Make *rule*'s suite one an entry may name (Note [matrix suites]); registering it again replaces it."""
    if not rule.name:
        raise ValueError("a matrix suite needs a name")
    _SUITES[rule.name] = rule
    return rule


def suite_rules() -> dict[str, SuiteRule]:
    """The registered suites' rules by name (a copy)."""
    return dict(_SUITES)
