"""vLLM's scheduler for the suites: memoized simulator runs, unpatched or with an optimization profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vramgate.profiles import Profile
from vramgate.sim import SimResult, simulate
from vramgate.sim.isolated import simulate_profile
from vramgate.store.shared import SharedResults
from vramgate.testing.models import ModelLoader
from vramgate.workloads import RequestSpec, Workload, build

__all__ = ["RequestSpec", "SimResult", "Simulator", "Workload", "build", "simulate"]


class Simulator:
    """vLLM's scheduler on a workload, memoized per session (same inputs, same figures).

    Unpatched and config-only profiles run in this process; a profile with diffs
    runs in a child process with its overlay (:mod:`vramgate.sim.isolated`),
    whose files go under *work_dir*. With *shared* (a folder of the session), a simulation that one
    pytest-xdist worker ran is read by the others instead of run again (Note [shared results]).
    """

    def __init__(self, loader: ModelLoader, work_dir: Path, shared: Path | None = None) -> None:
        self.loader = loader
        self.work_dir = work_dir
        self.shared = SharedResults(shared)
        self._results: dict[str, SimResult] = {}

    def run(self, model: str, workload: Workload, *, profile: Profile | None = None, **settings: Any) -> SimResult:
        """The figures of *workload* on model *model* through vLLM's scheduler, with *profile* applied if given.

        *settings* are :func:`vramgate.sim.simulate`'s keyword arguments (``block_size``,
        ``num_gpu_blocks``, ...).
        """
        applied = None if profile is None else [profile.name, profile.digest]
        key = json.dumps([model, workload.to_json(), applied, sorted(settings.items())], sort_keys=True, default=str)
        if key not in self._results:
            self._results[key] = self.shared.get(
                f"simulation {key}",
                lambda: simulate_profile(self.loader.path(model), workload, profile, work_dir=self.work_dir,
                                         **settings),
                lambda r: {**r.to_json(), "peak_blocks_by_step": r.peak_blocks_by_step},
                SimResult.from_json,
            )
        return self._results[key]
