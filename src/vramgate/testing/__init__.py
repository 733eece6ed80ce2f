"""What the suites build on: typed fixtures (a pytest plugin, :mod:`vramgate.testing.fixtures`) and helpers.

The project's root ``conftest.py`` loads the plugin. Here: the class each
fixture hands out (``from vramgate.testing import Engine``), the matrix mark's
case and suite declaration, and the gate's session. The helpers, and the names
of the layers below that suites use, are in topic modules:
:mod:`~vramgate.testing.engines` (specs, results, the small runs),
:mod:`~vramgate.testing.serving` (loads, memory slopes),
:mod:`~vramgate.testing.models` (shapes, KV layouts, attention, MoE),
:mod:`~vramgate.testing.quantization`, :mod:`~vramgate.testing.profiles`,
:mod:`~vramgate.testing.simulator` (and workloads), :mod:`~vramgate.testing.tp`,
:mod:`~vramgate.testing.machine` (probes, timers, versions),
:mod:`~vramgate.testing.answers`, :mod:`~vramgate.testing.claims` and
:mod:`~vramgate.testing.matrix`. Suites import from these, not from the layers
below, whose modules may split or move.
"""

from vramgate.pytest_plugin.plugin import gate_session
from vramgate.testing.engines import Engine
from vramgate.testing.matrix import MatrixCase
from vramgate.testing.matrix_suites import matrix_suite
from vramgate.testing.models import ModelLoader
from vramgate.testing.quantization import Checkpoints, QuantRuns
from vramgate.testing.serving import Servers
from vramgate.testing.simulator import Simulator
from vramgate.testing.tp import TPRunner

__all__ = [
    "Checkpoints",
    "Engine",
    "MatrixCase",
    "ModelLoader",
    "QuantRuns",
    "Servers",
    "Simulator",
    "TPRunner",
    "gate_session",
    "matrix_suite",
]
