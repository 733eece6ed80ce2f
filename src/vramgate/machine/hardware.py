"""Hardware fingerprint and the key baselines are stored under.

Nothing here probes hardware at import. :func:`detect` looks, in order, at
NVML (``nvidia-ml-py``), at torch's CUDA runtime when torch is installed, and
at the CPU (``/proc/cpuinfo``). Keys are short, lower-case and stable:

- GPU: ``<name>-<memory GiB>gb-x<count>``, e.g. ``nvidia-h200-141gb-x1``
  (driver and CUDA versions are recorded in the fingerprint, not the key: a
  driver update should be reported, not orphan every baseline). The count is
  the number of GPUs a test uses, not the number the box has (Note [GPUs a test
  uses]).
- CPU: ``cpu-<arch>-<ISA class>-<model name>``, e.g. ``cpu-x86_64-avx512-bf16-amd-epyc``. The ISA
  class (:mod:`vramgate.machine.isa`) decides which kernels vLLM, torch and
  oneDNN run, so two CPUs of one model name but another class get two keys.
  Other architectures have no class in the key.

Each fingerprint also names its *portable key* (``cpu`` or ``cuda``): the key under
which portable metrics, figures that no machine of the tier changes, are
stored and compared on every machine of that tier (:mod:`vramgate.core.metrics`).
Its *tier* is the engine tier's word (``cpu`` or ``gpu``), as everywhere in the gate
(the matrix's ``tier``, :func:`vramgate.engine.engine_tier`); records keep the
portable key in their ``tier`` field.
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass, field
from typing import Any

#: Keys of the tiers, where portable metrics live; never a hardware key.
TIER_KEYS = ("cuda", "cpu")
#: Set to ``cuda`` to compute the cuda tier's portable figures on this (CPU) machine (Note [a tier's portable
#: figures computed on CPU]); ``--gate-compute-tier`` sets it.
COMPUTE_TIER_ENV = "VRAMGATE_COMPUTE_TIER"


def computed_tier() -> str | None:
    """The tier whose portable figures this run computes instead of its own (``cuda``), or None.

    Note [a tier's portable figures computed on CPU]: much of what the cuda tier's portable metrics hold needs no
    device: vLLM's KV accounting (pages and blocks at a budget, with the CUDA backends' block sizes), its scheduler
    under the simulator (GPU-like settings), checkpoint bytes. vLLM's Python is the same in its CPU and CUDA builds,
    so a CPU machine can compute them for the cuda tier: the suites run with the engine tier taken as the GPU's (its
    matrix entries, block sizes and models), every engine refused (``UnsupportedHere``: a skip), machine-bound
    figures left uncompared, and what passes is written under ``baselines/cuda/`` with its provenance saying
    "computed on CPU". A GPU runner then compares its portable figures from its first run, and a difference on
    real hardware is a finding; what only a GPU can produce its first run records (``--gate-update-scope
    portable``)."""
    value = os.environ.get(COMPUTE_TIER_ENV, "").strip()
    if not value:
        return None
    if value != "cuda":
        raise ValueError(f"{COMPUTE_TIER_ENV}={value!r}: the only tier computed on another machine is 'cuda'")
    return value


def normalize(text: str) -> str:
    """Lower-case *text* and squeeze everything but letters and digits into ``-``."""
    text = re.sub(r"\((?:r|tm)\)", "", text.lower())
    text = re.sub(r"\b(?:cpu|processor|\d+-core)\b", " ", text)
    text = re.sub(r"@.*$", "", text)
    return re.sub(r"[^a-z0-9._]+", "-", text).strip("-._") or "unknown"


@dataclass(frozen=True)
class GPUInfo:
    """One visible GPU."""

    name: str
    memory_bytes: int
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class Fingerprint:
    """What the hardware is; ``key`` names the baseline folder."""

    key: str
    device: str  # "cuda" or "cpu"
    arch: str
    cpu_model: str
    cpu_count: int
    memory_bytes: int
    gpus: tuple[GPUInfo, ...] = ()
    driver: str | None = None
    cuda: str | None = None
    source: str = "detected"
    extra: dict[str, str] = field(default_factory=dict)
    isa: str | None = None
    """CPU ISA class in force (capped by ``VRAMGATE_CPU_ISA``); None on a GPU fingerprint."""
    flags: tuple[str, ...] = ()
    """The CPU flags that decide the ISA class (AVX2, AVX-512, AMX), as ``/proc/cpuinfo`` lists them."""

    @property
    def portable_key(self) -> str:
        """The key portable metrics are stored under: ``cuda`` or ``cpu``."""
        return TIER_KEYS[0] if self.device == "cuda" else TIER_KEYS[1]

    @property
    def tier(self) -> str:
        """This machine's tier in the gate's one vocabulary: ``gpu`` or ``cpu``."""
        return "gpu" if self.device == "cuda" else "cpu"

    def for_gpus(self, count: int) -> Fingerprint:
        """This fingerprint as a test that uses *count* GPUs sees it (Note [GPUs a test uses]): the first *count*
        visible GPUs and their key; itself on a CPU fingerprint, under an overridden key (``--gate-hardware``
        names the whole machine), or where *count* is not fewer than the GPUs visible.

        Note [GPUs a test uses]: a test's figures belong to the GPU class and the number of GPUs the test runs
        on: a single-GPU engine run on one H200 of an 8-GPU box measures what it measures on a 1-GPU box, and a
        tensor-parallel run of 4 what it measures on any box of 4 or more. So a GPU test's machine-bound
        baselines are keyed ``<class>-x<GPUs it uses>`` (``requires_gpus(n)``, else 1): an 8xH200 runner reads
        the ``nvidia-h200-140gb-x1`` baselines for its single-GPU tests and ``-x4`` for its TP=4 ones."""
        if self.device != "cuda" or self.source != "detected" or not 0 < count < len(self.gpus):
            return self
        gpus = self.gpus[:count]
        return Fingerprint(**{**self.__dict__, "key": gpu_key(gpus), "gpus": gpus})

    def to_json(self) -> dict[str, Any]:
        """This fingerprint as JSON data (capabilities and flags as lists), with its portable key as ``tier``."""
        data = asdict(self)
        data["gpus"] = [
            {**asdict(g), "capability": list(g.capability) if g.capability else None}
            for g in self.gpus
        ]
        data["flags"] = list(self.flags)
        data["tier"] = self.portable_key  # the record field keeps the portable key (baselines/<tier>/)
        return data


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _gpus_from_nvml() -> tuple[tuple[GPUInfo, ...], str | None, str | None] | None:
    from vramgate.machine.devices import device_handle, visible_devices
    from vramgate.machine.probes.nvml import NVMLUnavailable, open_nvml

    try:
        pynvml = open_nvml()
    except NVMLUnavailable:  # no nvidia-ml-py, NVML library missing or no driver: no GPU here.
        return None

    try:
        gpus = []
        for device in visible_devices(pynvml):
            handle = device_handle(pynvml, device)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            mem = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            try:
                cap = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(device_handle(pynvml, device, parent=True)))
            except Exception:
                cap = None
            gpus.append(GPUInfo(str(name), mem, cap))  # type: ignore[arg-type]
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda_v = pynvml.nvmlSystemGetCudaDriverVersion()
        cuda = f"{cuda_v // 1000}.{cuda_v % 1000 // 10}"
        return tuple(gpus), (driver.decode() if isinstance(driver, bytes) else str(driver)), cuda
    finally:
        pynvml.nvmlShutdown()


def _gpus_from_torch() -> tuple[tuple[GPUInfo, ...], str | None, str | None] | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(GPUInfo(props.name, int(props.total_memory), (props.major, props.minor)))
    return tuple(gpus), None, torch.version.cuda


def probe_gpus() -> tuple[tuple[GPUInfo, ...], str | None, str | None]:
    """Visible GPUs (``CUDA_VISIBLE_DEVICES`` applied as CUDA applies it, see :mod:`vramgate.machine.devices`),
    driver version and CUDA version; ``((), None, None)`` without a GPU."""
    nvml = _gpus_from_nvml()
    if nvml is not None:
        return nvml
    return _gpus_from_torch() or ((), None, None)


def visible_gpus() -> tuple[GPUInfo, ...]:
    """The GPUs this process can use (empty on a CPU machine). Probes lazily."""
    return probe_gpus()[0]


def matches_gpu_class(key: str, gpu_class: str) -> bool:
    """Whether the hardware *key* is of the class *gpu_class* (``h100``, ``A100-SXM4``, ``l40s``, ``cpu``): the
    class, spelled as keys are (lower case, words joined by ``-``), is a run of whole words of the key, so ``l4``
    matches ``nvidia-l4-24gb-x1`` and not ``nvidia-l40s-48gb-x1``, ``h100`` matches
    ``nvidia-h100-80gb-hbm3-80gb-x8``."""
    words = key.split("-")
    wanted = re.sub(r"[^a-z0-9._]+", "-", gpu_class.lower()).strip("-._").split("-")
    return any(words[i:i + len(wanted)] == wanted for i in range(len(words) - len(wanted) + 1))


def gpu_key(gpus: tuple[GPUInfo, ...]) -> str:
    """The hardware key of *gpus*: the first GPU's normalized name, its GiB and the count (``nvidia-h200-140gb-x1``)."""
    first = gpus[0]
    gib = round(first.memory_bytes / 2**30)
    return f"{normalize(first.name)}-{gib}gb-x{len(gpus)}"


def detect() -> Fingerprint:
    """Probe this machine and return its fingerprint (GPU if one is visible)."""
    arch = platform.machine() or "unknown"
    cpu_model = _cpu_model()
    gpus, driver, cuda = probe_gpus()
    common: dict[str, Any] = dict(
        arch=arch, cpu_model=cpu_model, cpu_count=os.cpu_count() or 0, memory_bytes=_memory_bytes()
    )
    if gpus:
        return Fingerprint(key=gpu_key(gpus), device="cuda", gpus=gpus, driver=driver, cuda=cuda, **common)
    from vramgate.machine import isa

    cpu_flags = isa.cpu_flags()
    try:
        described = isa.describe(cpu_flags)
    except isa.ISAError as exc:
        raise ValueError(str(exc)) from None
    cls = described.pop("isa")
    return Fingerprint(key=cpu_key(arch, cls, cpu_model), device="cpu", isa=cls,
                       flags=tuple(sorted(f for f in cpu_flags if f in ISA_FLAGS)), extra=described, **common)


#: The CPU flags a fingerprint records: those that decide the ISA class and the kernels vLLM runs.
ISA_FLAGS = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                       "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16"})


def cpu_key(arch: str, isa_class: str, cpu_model: str) -> str:
    """``cpu-<arch>-<ISA class>-<model>``; other architectures than x86 carry no class (it is their arch)."""
    arch_part = normalize(arch)
    if isa_class and normalize(isa_class) != arch_part:
        return f"cpu-{arch_part}-{normalize(isa_class)}-{normalize(cpu_model)}"
    return f"cpu-{arch_part}-{normalize(cpu_model)}"


def with_key(fp: Fingerprint, key: str) -> Fingerprint:
    """*fp* under an overridden key (``--gate-hardware``)."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", key):
        raise ValueError(
            f"hardware key {key!r} is not valid: use lower-case letters, digits, '.', '_' and '-'"
        )
    if key in TIER_KEYS:
        raise ValueError(f"hardware key {key!r} is a tier's key (where portable metrics live), not a machine's")
    return Fingerprint(**{**fp.__dict__, "key": key, "source": "overridden"})
