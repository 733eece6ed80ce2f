"""Run vLLM's offline engine in a subprocess: ``EngineSpec`` in, ``EngineResult`` out.

The parent does not run vLLM (it imports vLLM's attention-backend registry
only to ask a backend that a spec names what it runs). It validates the spec
(before any engine starts, where it can: :mod:`vramgate.engine.spec`), writes it to a per-run folder, and
starts ``python -m vramgate.engine.worker`` in a new session (its own process group,
Note [process groups] in :mod:`vramgate.runtime.process`)
with vLLM's caches, config and temporary files pointed into that folder. The
worker writes ``result.json``; the parent reads it. A crash, a timeout or an
out-of-memory kill becomes an :class:`EngineError` that carries the log tail,
and the whole process group is killed, so no engine process outlives its run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.core.answers import Outputs
from vramgate.core.records import record_fields
from vramgate.engine import diff_lines
from vramgate.engine.diff_lines import DiffLines
from vramgate.engine.figures import KVFigures, LatencyFigures, MemoryFigures, SchedulerFigures
from vramgate.engine.memory_decision import MemoryDecision
from vramgate.engine.spec import (
    ENGINE_RESULT_FORMAT,
    KV_TOO_SMALL,
    EngineSpec,
    apply_profile,
    engine_tier,
    kv_budget_bytes,
    kv_need,
    validate,
)
from vramgate.engine.vllm_plugin import ROPE_LAYOUT_ENV
from vramgate.machine import devices
from vramgate.machine.probes import nvml
from vramgate.models.config import ModelConfigError
from vramgate.runtime import process
from vramgate.runtime.engine_env import engine_python
from vramgate.runtime.exits import describe_exit
from vramgate.runtime.preload import PreloadError
from vramgate.runtime.vllm_env import ENGINE_LOG_LEVEL, child_environment, vllm_environment
from vramgate.store.shared import SharedResults


class EngineError(RuntimeError):
    """An engine run that crashed, timed out or ran out of memory; carries the log tail.

    ``cause`` is the short reason when the log names a known one (see
    :data:`KNOWN_CAUSES`), else ""; ``exception`` the last exception line of
    the log (``ValueError: ...``), else "". Both are in the message's first
    line, with ``details[cause]`` (the gate's own figures) where given.
    """

    def __init__(
        self, message: str, log_tail: str = "", run_dir: Path | None = None, details: dict[str, str] | None = None
    ) -> None:
        self.cause, self.exception = diagnose(log_tail)
        head = message
        if self.cause:
            head += f": {self.cause}"
            if details and details.get(self.cause):
                head += f" ({details[self.cause]})"
        if self.exception:
            head += f" ({self.exception})"
        super().__init__(head + (f"\n--- engine log tail ({run_dir}) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail
        self.run_dir = run_dir


#: Log patterns of failures with a known cause, and the cause as the gate names it (first match wins).
KNOWN_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"To serve at least one request with the model's max seq len"), KV_TOO_SMALL),
    (re.compile(r"No available memory for the cache blocks"), "no memory left for the KV cache"),
    (re.compile(r"is less than desired CPU memory utilization|on kv cache allocation is less than requested memory"),
     "the requested CPU memory is more than the node has free, or less than the engine uses before its KV cache"),
    (re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory"), "device out of memory"),
    (re.compile(r"DefaultCPUAllocator: can't allocate memory|\bMemoryError\b"), "host out of memory"),
)
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$")


def diagnose(log: str) -> tuple[str, str]:
    """(known cause, last exception line) found in an engine log; "" for what is not there."""
    lines = [line.strip() for line in log.splitlines()]
    exception = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), "")
    if len(exception) > 400:
        exception = exception[:400] + "..."
    for pattern, cause in KNOWN_CAUSES:
        if pattern.search(log):
            return cause, exception
    return "", exception



@dataclass
class EngineResult:
    """What one engine run measured (see :mod:`vramgate.engine.worker` for each field's source)."""

    spec: dict[str, Any]
    versions: dict[str, str]
    device: str
    kv: KVFigures
    memory: MemoryFigures
    scheduler: SchedulerFigures
    latency: LatencyFigures
    timing: dict[str, float]
    notes: list[str] = field(default_factory=list)
    run_dir: str = ""
    compilation: dict[str, Any] = field(default_factory=dict)
    """What vLLM's compilation did: ``fusion``, each tensor-parallel rank's communication-fusion passes (Note
    [fusion pass state] in :mod:`vramgate.engine.measure`; empty at TP 1)."""
    decision: MemoryDecision | None = None
    """What vLLM decided about memory when it sized the KV cache itself (Note [automatic KV]); None for a run
    with a KV budget."""
    outputs: Outputs | None = None
    """What it generated, on a recall model (Note [the same answer] in :mod:`vramgate.core.answers`): per request
    the tokens, their top-k logprobs and the task's expected answer; None on dummy weights (the JSON then has no
    ``outputs``)."""
    diff: DiffLines | None = None
    """Which of its profile's changed lines ran (Note [diff ran] in :mod:`vramgate.engine.diff_lines`); None where
    the run did not watch them."""

    @classmethod
    def from_json(cls, data: Any, where: str = "") -> EngineResult:
        """The result in *data* (:data:`ENGINE_RESULT_FORMAT`, migrated from its version); ``TypeError`` naming
        what is missing when it is not one. Fields it does not know (the worker's own, such as
        ``planted_delay``) are left out."""
        record = ENGINE_RESULT_FORMAT.load(data, where or "result", TypeError)
        fields = record_fields(cls, {k: v for k, v in record.items() if k != "schema"}, where, TypeError,
                               ignore_unknown=True)
        if fields.get("decision") is not None:
            fields["decision"] = MemoryDecision.from_json(fields["decision"], f"{where or 'result'}: decision")
        if fields.get("outputs") is not None:
            fields["outputs"] = Outputs.from_json(fields["outputs"], f"{where or 'result'}: outputs")
        if fields.get("diff") is not None:
            fields["diff"] = DiffLines.from_json(fields["diff"], f"{where or 'result'}: diff")
        prefix = f"{where}: " if where else ""
        for name, figures in (("kv", KVFigures), ("memory", MemoryFigures), ("scheduler", SchedulerFigures),
                              ("latency", LatencyFigures)):
            fields[name] = figures.from_json(fields[name], f"{prefix}{name}")
        return cls(**fields)

    def simulator_settings(self) -> dict[str, Any]:
        """The simulator's settings that reproduce this run (:func:`vramgate.sim.settings_of_engine`)."""
        from vramgate.sim import settings_of_engine

        return settings_of_engine(self.spec, block_size=self.kv.block_size, num_gpu_blocks=self.kv.num_gpu_blocks,
                                  prefix_caching=self.scheduler.prefix_caching,
                                  async_scheduling=self.scheduler.async_scheduling)

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON object (what :meth:`from_json` reads), with its schema; ``outputs`` only where
        there are some."""
        data = {"schema": ENGINE_RESULT_FORMAT.current,
                **dataclasses.asdict(dataclasses.replace(self, outputs=None, diff=None))}
        del data["outputs"]
        data["diff"] = self.diff.to_json() if self.diff is not None else None
        if self.outputs is not None:
            data["outputs"] = self.outputs.to_json()
        return data


def engine_process_env(
    spec: EngineSpec, run_dir: Path, extra_pythonpath: list[Path] | None = None, cache_root: Path | None = None
) -> dict[str, str]:
    """The environment of an engine subprocess: vLLM's (:mod:`vramgate.runtime.vllm_env`, logging at INFO),
    plus the engine's own settings.

    *cache_root* (default ``run_dir/cache``) lets the runs of one gate session share
    vLLM's cache of model inspections and the compiled Triton and Inductor kernels,
    which saves seconds per engine start on CPU and minutes of recompiling on a GPU.
    """
    env = child_environment()  # Note [a clean start for every child] in vramgate.runtime.vllm_env
    env.update(vllm_environment(run_dir, cache_root=cache_root, log_level=ENGINE_LOG_LEVEL))
    env.update({
        "PYTHONUNBUFFERED": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # torch.cuda.is_available() through NVML, creating no CUDA state that would make vLLM spawn its ranks
        # (Note [no CUDA before the ranks] in vramgate.engine.worker); vLLM sets it too, when it is imported.
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        # Note [CPU rotary layout] in vramgate.engine.cpu_rope: in every process of vLLM's, through the plugin
        ROPE_LAYOUT_ENV: "1",
    })
    # Note [KV budget] in vramgate.engine.worker: the budget goes in as kv_cache_memory_bytes.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # One OpenMP thread per engine on CPU: with two threads on a two-core machine, any other
    # load makes OpenMP barriers stall decode steps by an order of magnitude.
    env.setdefault("OMP_NUM_THREADS", "1")
    # CUDA numbers devices in NVML's (PCI bus) order, so that CUDA_VISIBLE_DEVICES indices name the GPUs the
    # gate's NVML readings name (Note [CUDA_VISIBLE_DEVICES] in vramgate.machine.devices).
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    env.update(spec.env)
    # vLLM takes full GPU UUIDs only (Note [full UUIDs for vLLM] in vramgate.machine.devices).
    visible = nvml.engine_visible_devices(env.get(devices.ENV))
    if visible is not None:
        env[devices.ENV] = visible
    env["PYTHONPATH"] = process.pythonpath(env, first=extra_pythonpath or ())
    return env


def _kv_figures(spec: EngineSpec, root: Path) -> str:
    """The KV budget against one max_model_len request's need, in the gate's own figures."""
    from vramgate.core.metrics import format_value

    try:
        per_token, need = kv_need(spec, root)
    except ModelConfigError:
        return ""
    budget = kv_budget_bytes(spec)
    if budget is None:
        return f"vLLM sized the KV cache itself; one request of max_model_len {spec.max_model_len} tokens needs " \
               f"{format_value(need, 'B', precise=True)} at {per_token} B/token"
    return (f"KV budget {format_value(budget, 'B', precise=True)}; one request of max_model_len "
            f"{spec.max_model_len} tokens needs {format_value(need, 'B', precise=True)} at {per_token} B/token")


def preload_folder(base_dir: Path) -> Path | None:
    """Where the preloaded engine interpreter of a gate process keeps its files (under *base_dir*), or None
    where engines start fresh: on the GPU tier, whose CUDA a forked child may not be able to use (Note
    [preloaded engines] in :mod:`vramgate.runtime.preload`)."""
    return base_dir / "preload" if engine_tier() == "cpu" else None


def run_engine(
    spec: EngineSpec, root: Path, run_dir: Path, *, extra_pythonpath: list[Path] | None = None,
    cache_root: Path | None = None, preload: Path | None = None,
) -> EngineResult:
    """Run *spec* in a subprocess with its files in *run_dir*; :class:`EngineError` on failure.

    With *preload* (a folder) it may be forked from a preloaded interpreter (Note [preloaded engines] in
    :mod:`vramgate.runtime.preload`)."""
    validate(spec, root)
    if kv_budget_bytes(spec) is None:
        # Note [automatic KV] in vramgate.engine.memory_decision: vLLM's CPU worker gives the KV cache its requested
        # memory minus its RSS, and a child forked from the preloaded interpreter has another RSS than a fresh one
        # (its parent's pages). A serving run starts fresh, as a team's server does.
        preload = None
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = run_dir / "spec.json", run_dir / "result.json", run_dir / "engine.log"
    spec_path.write_text(json.dumps({"spec": spec.to_json(), "root": str(root)}, indent=2, sort_keys=True))
    with contextlib.suppress(FileNotFoundError):
        result_path.unlink()
    cmd = [spec.python or engine_python(), "-m", "vramgate.engine.worker", str(spec_path), str(result_path)]
    start = time.monotonic()
    env = engine_process_env(spec, run_dir, extra_pythonpath, cache_root)
    traced = spec.env.get(diff_lines.TRACE_ENV) == "1" and bool(extra_pythonpath)
    if traced:  # Note [diff ran]: an untimed run of a profile's diff watches its lines
        env.update(diff_lines.prepare(list(extra_pythonpath or []), run_dir))
    proc = process.launch(cmd, log_path, env=env, cwd=run_dir, preload=preload)
    try:
        rc = process.wait_or_kill(proc, spec.timeout_s)  # the worker's own children (vLLM's engine core) go with it
    except PreloadError as exc:
        raise EngineError(f"engine for {spec.model}: {exc}", process.tail(log_path), run_dir) from None
    if rc is None:
        raise EngineError(f"engine for {spec.model} timed out after {spec.timeout_s:g} s and was killed",
                          process.tail(log_path), run_dir)
    wall = time.monotonic() - start
    if rc != 0:
        raise EngineError(f"engine for {spec.model} {describe_exit(rc)}", process.tail(log_path), run_dir,
                          details={KV_TOO_SMALL: _kv_figures(spec, root)})
    try:
        data = json.loads(result_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(
            f"engine for {spec.model} left no readable result ({exc})", process.tail(log_path), run_dir
        ) from None
    try:
        result = EngineResult.from_json(data)
    except (TypeError, AttributeError) as exc:
        raise EngineError(
            f"engine for {spec.model} left {result_path.name} that is not an engine result ({exc})",
            process.tail(log_path), run_dir,
        ) from None
    result.timing["subprocess_wall_s"] = wall
    result.run_dir = str(run_dir)
    if traced:
        result.diff = diff_lines.lines_ran(run_dir, list(extra_pythonpath or []))
    return result


class EngineCache:
    """Runs each distinct spec once per session and hands out the same result after: once per process, and
    with *shared* (a folder of the session) once for all pytest-xdist workers (Note [shared results])."""

    def __init__(self, root: Path, base_dir: Path, *, cache_root: Path | None = None,
                 shared: Path | None = None) -> None:
        self.root = root
        self.base_dir = base_dir
        self.shared = SharedResults(shared)
        self.cache_root = cache_root or base_dir / "vllm-cache"
        """vLLM's caches (model inspections, compiled kernels), shared by every run: nothing in them depends on
        the run; the suites share one between pytest-xdist workers too."""
        self._results: dict[str, EngineResult | EngineError] = {}

    def run(self, spec: EngineSpec) -> EngineResult:
        """The result of *spec* (its profile applied), run now or earlier in this session; the same
        :class:`EngineError` again for a spec that failed."""
        key = spec.key()
        if key not in self._results:
            def run() -> EngineResult:
                resolved, paths = apply_profile(spec, self.root, self.base_dir / "overlays")
                return run_engine(resolved, self.root, self.base_dir / f"{spec.model}-{key}",
                                  extra_pythonpath=paths, cache_root=self.cache_root,
                                  preload=preload_folder(self.base_dir))

            try:
                self._results[key] = self.shared.get(f"engine {key}", run, EngineResult.to_json,
                                                     EngineResult.from_json)
            except EngineError as exc:
                self._results[key] = exc
        outcome = self._results[key]
        if isinstance(outcome, EngineError):
            raise outcome
        return outcome
