"""The simulator with an optimization profile applied, or in another engine environment: in this process,
or in a child that imports the patched (or the other) vLLM.

A profile's engine arguments reach vLLM's config in any process. Its diff
series does not: the patched scheduler exists only in the profile's overlay,
which has to come first on the ``PYTHONPATH`` of a process that has not
imported vLLM yet (Note [overlay] in :mod:`vramgate.profiles.overlay`). So a
profile with diffs runs in a child process: the parent writes the request
(model folder, workload, settings) as JSON, the child runs :func:`simulate`
and writes the :class:`SimResult`'s JSON form back (``python -m
vramgate.sim.isolated REQUEST RESULT``). The child checks that vLLM's
scheduler came from the overlay; a run that imported the unpatched one fails.
So does every simulation when the engine environment is another interpreter
(:mod:`vramgate.runtime.engine_env`): its vLLM is not the one this process imports.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramgate.profiles import Profile, build_overlay
from vramgate.runtime import engine_env
from vramgate.runtime.exits import describe_exit
from vramgate.runtime.process import launch, pythonpath, tail, wait_or_kill
from vramgate.runtime.vllm_env import IN_PROCESS_LOG_LEVEL, child_environment, vllm_environment
from vramgate.sim.simulator import SimResult, SimulationError, simulate
from vramgate.workloads import Workload

#: How long a child simulation may run, far above what the suites' traces take (docs/engine.md, "What a simulation
#: costs").
TIMEOUT_S = 900.0


def simulate_profile(model_dir: Path, workload: Workload, profile: Profile | None, *, work_dir: Path,
                     timeout_s: float | None = TIMEOUT_S, **settings: Any) -> SimResult:
    """:func:`simulate` with *profile* applied (``None``: unpatched vLLM, in this process).

    The profile's engine arguments go to vLLM's config (``settings["engine_args"]`` win over them). A
    profile without diffs runs in this process; one with diffs runs in a child with its overlay, built
    under *work_dir* (which also holds each child's request, result and vLLM files).
    """
    env = engine_env.current()
    if profile is not None:
        settings = {**settings, "engine_args": {**profile.engine_args, **settings.get("engine_args", {})}}
    if env.is_gate_interpreter and (profile is None or not profile.series):
        return simulate(model_dir, workload, **settings)
    overlay = None
    if profile is not None and profile.series:
        target = None if env.is_gate_interpreter else (str(env.require_vllm().vllm), Path(str(env.vllm_package)))
        overlay = build_overlay(profile, work_dir / "overlays", target)
    name = profile.name if profile is not None else "unpatched"
    run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work_dir))
    return simulate_in_child(model_dir, workload, overlay=overlay, run_dir=run_dir, timeout_s=timeout_s, **settings)


def simulate_in_child(model_dir: Path, workload: Workload, *, overlay: Path | None, run_dir: Path,
                      timeout_s: float | None = TIMEOUT_S, **settings: Any) -> SimResult:
    """:func:`simulate` in a child process of the engine environment whose ``import vllm`` finds *overlay*
    first (None: the environment's own vLLM); its files in *run_dir*.

    The child inherits this process's environment; vLLM's variables this process
    has not set come from :func:`~vramgate.runtime.vllm_env.vllm_environment` on *run_dir*.
    Raises :class:`SimulationError` with the child's stderr tail when it fails or
    runs past *timeout_s* (None: no limit).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    request, result = run_dir / "request.json", run_dir / "result.json"
    request.write_text(json.dumps({"model_dir": str(model_dir), "workload": workload.to_json(),
                                   "settings": settings, "overlay": str(overlay) if overlay else None}),
                       encoding="utf-8")
    env = child_environment()  # Note [a clean start for every child] in vramgate.runtime.vllm_env
    for key, value in vllm_environment(run_dir, log_level=IN_PROCESS_LOG_LEVEL, temp=False).items():
        env.setdefault(key, value)
    env["PYTHONPATH"] = pythonpath(env, first=[overlay] if overlay else [])
    log = run_dir / "simulation.log"
    what = f"simulation with overlay {overlay.name}" if overlay else f"simulation under {engine_env.engine_python()}"
    proc = launch([engine_env.engine_python(), "-m", "vramgate.sim.isolated", str(request), str(result)], log,
                  env=env, cwd=run_dir)
    status = wait_or_kill(proc, timeout_s)
    if status is None:
        raise SimulationError(f"{what} ran past {timeout_s or 0:g} s --- log tail ({log}) ---\n{tail(log)}")
    if status != 0 or not result.is_file():
        raise SimulationError(f"{what} {describe_exit(status)} "
                              f"--- log tail ({log}) ---\n{tail(log)}")
    return SimResult.from_json(json.loads(result.read_text(encoding="utf-8")), str(result))


def main(argv: Sequence[str]) -> int:
    """The child: ``REQUEST RESULT``; run the request's simulation and write its result."""
    if len(argv) != 2:
        print("usage: python -m vramgate.sim.isolated REQUEST RESULT", file=sys.stderr)
        return 2
    from vramgate.machine import isa

    isa.apply_cap()  # Note [ISA cap]: before this process imports vLLM
    request_path, result_path = Path(argv[0]), Path(argv[1])
    request = json.loads(request_path.read_text(encoding="utf-8"))
    workload = Workload.from_json(request["workload"], str(request_path))
    result = simulate(Path(request["model_dir"]), workload, **request["settings"])
    module, overlay = Path(str(result.settings["scheduler_module"])), request["overlay"]
    if overlay is not None and not module.is_relative_to(overlay):
        raise SimulationError(f"vLLM's scheduler was imported from {module}, not from the overlay {overlay}")
    data = result.to_json()
    if request["settings"].get("keep_trace"):
        data["peak_blocks_by_step"] = result.peak_blocks_by_step  # not among the figures, asked for here
    result_path.write_text(json.dumps(data), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
