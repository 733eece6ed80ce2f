"""The gate's own hooks, for a project's ``conftest.py`` or a plugin (as pytest-benchmark's
``pytest_benchmark_generate_machine_info``)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec
def pytest_vramgate_machine_info(config: pytest.Config, machine_info: dict[str, str]) -> None:
    """Add facts about this machine to *machine_info* (name -> text), such as a runner's pool, its BIOS or
    power settings, a cloud instance type. They go into the fingerprint's ``extra`` (each baseline file's
    ``hardware``, the report), next to what the gate detects; they do not change the hardware key. Called once
    per session, when the fingerprint is first read; a name the gate detected is not replaced."""


@pytest.hookspec
def pytest_vramgate_test_inputs(item: pytest.Item) -> list[Any] | None:
    """The inputs of *item* that the gate cannot see by itself (a list of
    :class:`~vramgate.pytest_plugin.affected.TestInput`): files of the project it reads, each with an optional
    finer check. ``--gate-affected`` keeps a test when one of them changed (Note [each test's inputs] in
    :mod:`vramgate.pytest_plugin.affected`). The suites' plugin declares the profile a case runs and the matrix
    entry it takes."""
