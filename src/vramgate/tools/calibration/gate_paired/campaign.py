"""The per-gate-run campaign's trials taken: each profile's paired test beside the rest of the pre-merge gate
(Note [per-gate-run campaign] in :mod:`vramgate.tools.calibration.gate_paired`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramgate.tools.calibration.gate_paired.trials import CONDITIONS, floor_sums


def _busy_loop(root: Path, out: Path, stop: Path) -> Any:
    """The other worker: the rest of the pre-merge gate (without the paired latency tests), run after run, in its
    own process group (:func:`vramgate.runtime.process.launch`; ``busy.log`` says how each run ended)."""
    from vramgate.runtime import process

    script = (
        "import pathlib, subprocess, sys\n"
        f"stop, out = pathlib.Path({str(stop)!r}), pathlib.Path({str(out)!r})\n"
        "n = 0\n"
        "while not stop.exists():\n"
        "    with open(out / f'busy-{n}.log', 'wb') as log:\n"
        "        rc = subprocess.call([sys.executable, '-m', 'pytest', 'suites', '-m', 'not gate_nightly',\n"
        "                              '-p', 'no:xdist', '-p', 'no:cacheprovider', '-q',\n"
        "                              '--deselect', 'suites/latency/test_paired_latency.py',\n"
        "                              '--gate-report', str(out / f'busy-report-{n}'),\n"
        "                              '--basetemp', str(out / f'busy-tmp-{n}')],\n"
        "                             stdout=log, stderr=subprocess.STDOUT)\n"
        "    print(f'run {n}: exit {rc}', flush=True)\n"
        "    n += 1\n"
    )
    return process.launch([sys.executable, "-c", script], out / "busy.log", env=dict(os.environ), cwd=root)


def run(root: Path, out: Path, minutes: float, profiles: Sequence[str], busy: bool, rounds: int | None,
        quiet_looks: bool = False, together: bool | None = None,
        conditions: Sequence[str] = ("unchanged", "delay-10%"), stat: str | None = None,
        both_ways: bool = False) -> None:
    """Trials until *minutes* have passed (see the module's docstring), appended to ``out/trials.jsonl``; of the
    *conditions* named (:data:`CONDITIONS`) only; of *stat* (default the tier's; ``step_floor``: Note [step
    floor]); *both_ways*: each profile and condition's trial is taken with rounds together and then one after the
    other, back to back, so that the two ways of Note [rounds together] meet the same host state (an A/B in turns
    that ``analyze --together`` reads one way at a time)."""
    import pytest

    from vramgate.engine import engine_tier
    from vramgate.engine.paired import PairedEngines, latency_spec, paired_defaults
    from vramgate.profiles import find_profile
    from vramgate.runtime import quiet
    from vramgate.testing.profiles import runnable_candidate

    settings = paired_defaults(engine_tier())
    n_rounds = rounds or settings.rounds
    if both_ways and together is not None:
        raise ValueError("both ways takes trials together and one after the other: give no together setting")
    ways = (True, False) if both_ways else (settings.together if together is None else together,)
    stat = stat or settings.stat
    out.mkdir(parents=True, exist_ok=True)
    stop = out / "stop"
    stop.unlink(missing_ok=True)
    # The other worker and the trials share one session lock, as a gate session's workers do (Note [quiet sections]).
    os.environ[quiet.QUIET_LOCK_ENV] = str(out / "quiet.lock")
    other = _busy_loop(root, out, stop) if busy else None
    # A campaign stopped by a signal still stops its other worker (the finally below), however many come.
    def stop_here(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop_here)
    reference = latency_spec("tiny-llama")
    candidates = {}
    for name in profiles:  # as the test takes its candidate: a profile this machine cannot run is left out
        try:
            candidates[name] = runnable_candidate(reference, find_profile(root, name), use_mla=False)
        except pytest.skip.Exception as exc:
            print(f"{name}: left out: {exc}", flush=True)
    deadline = time.monotonic() + minutes * 60
    index = sum(1 for _ in (out / "trials.jsonl").open()) if (out / "trials.jsonl").exists() else 0
    cycle = 0
    try:
        while time.monotonic() < deadline:
            cycle += 1
            for condition, delay in [(c, d) for c, d in CONDITIONS if c in conditions]:
                for name, candidate in candidates.items():
                    if delay:
                        candidate = candidate.replace(env={"VRAMGATE_PLANT_DELAY": str(delay)})
                    for together in ways if cycle % 2 else ways[::-1]:  # neither way always goes first
                        run_dir = out / "engines" / f"{index}"
                        t0 = time.time()
                        with contextlib.ExitStack() as stack:
                            got = stack.enter_context(quiet.quiet()) if quiet_looks else None
                            engines = stack.enter_context(PairedEngines(reference, candidate, root, run_dir,
                                                                        cache_root=out / "cache"))
                            result = engines.run(n_rounds, seed=index, together=together)
                        if stat == "step_floor":
                            ref = floor_sums([r.steps_s for r in result.a])
                            cand = floor_sums([r.steps_s for r in result.b])
                        else:
                            ref, cand = result.stats(stat)
                        line = {"profile": name, "condition": condition, "index": index, "ref": ref, "cand": cand,
                                "stat": stat,
                                "ref_steps": [r.steps_s for r in result.a], "cand_steps": [r.steps_s for r in result.b],
                                "busy": busy, "started": t0, "seconds": time.time() - t0, "isa": os.environ.get(
                                    "VRAMGATE_CPU_ISA", ""), "quiet": bool(got and got.quiet),
                                "waited_s": got.waited_s if got else 0.0, "together": together}
                        with (out / "trials.jsonl").open("a", encoding="utf-8") as f:
                            f.write(json.dumps(line) + "\n")
                        way = "together" if together else "one after the other"
                        print(f"trial {index}: {name} {condition} ({way}): {time.time() - t0:.1f} s", flush=True)
                        index += 1
                        if time.monotonic() >= deadline:
                            return
    finally:
        stop.write_text("stop")
        if other is not None:
            from vramgate.runtime import process

            process.kill_group(other)
