"""The gate's own hooks, for a project's ``conftest.py`` or a plugin (as pytest-benchmark's
``pytest_benchmark_generate_machine_info``)."""

from __future__ import annotations

import pytest


@pytest.hookspec
def pytest_vramgate_machine_info(config: pytest.Config, machine_info: dict[str, str]) -> None:
    """Add facts about this machine to *machine_info* (name -> text), such as a runner's pool, its BIOS or
    power settings, a cloud instance type. They go into the fingerprint's ``extra`` (each baseline file's
    ``hardware``, the report), next to what the gate detects; they do not change the hardware key. Called once
    per session, when the fingerprint is first read; a name the gate detected is not replaced."""
