"""The CPU's instruction-set class: what decides which kernels vLLM, torch and oneDNN run on a CPU.

vLLM's CPU build ships three kernel libraries and picks one in
``CpuPlatform.import_kernels`` from torch's CPU checks: ``_C`` with AVX-512
and AVX-512 BF16, ``_C_AVX512`` with AVX-512 alone, ``_C_AVX2`` otherwise.
Some kernels exist only in the AVX-512 libraries (the WNA16 linear kernel
``cpu_gemm_wna16``), and vLLM's CPU attention refuses an fp8 KV cache without
AVX-512 or AMX. oneDNN and torch's own kernels follow the same lines. So two
CPUs of the same model name but another ISA class run other code, with other
timings and, for some figures, other byte counts: the class is part of the
CPU hardware key (:mod:`vramgate.machine.hardware`).

Classes, lowest first: ``x86-64`` (no AVX2), ``avx2``, ``avx512`` (F, BW, VL,
DQ, as torch's ``_is_avx512_supported`` asks), ``avx512-bf16`` (plus
AVX512_BF16), ``amx`` (plus AMX tiles with BF16). Other architectures have one
class, their own name.

Note [ISA cap]: ``VRAMGATE_CPU_ISA=<class>`` makes an AVX-512 machine run the
lower class's code paths, so the other path can be tested anywhere: the
hardware key names the capped class, vLLM imports the capped kernel library
(torch's CPU checks that vLLM reads are capped before vLLM is imported),
``ATEN_CPU_CAPABILITY`` caps torch's own kernels and ``ONEDNN_MAX_CPU_ISA``
oneDNN's. The environment variables reach every engine the gate starts; each
of its processes that imports vLLM or torch calls :func:`apply_cap` first.
Nothing here imports torch unless a cap is in force.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from typing import Any

#: x86 ISA classes, lowest first.
X86_CLASSES: tuple[str, ...] = ("x86-64", "avx2", "avx512", "avx512-bf16", "amx")
CAP_ENV = "VRAMGATE_CPU_ISA"
#: The CPU flags (``/proc/cpuinfo``) that each class needs beyond the one below it.
_NEEDS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512-bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_bf16"),
}
#: What torch's kernels and oneDNN may use under each class (Note [ISA cap]).
_ATEN = {"x86-64": "default", "avx2": "avx2", "avx512": "avx512", "avx512-bf16": "avx512", "amx": "avx512"}
_ONEDNN = {"x86-64": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512-bf16": "AVX512_CORE_BF16",
           "amx": "AVX512_CORE_AMX"}
#: torch's CPU checks that vLLM 0.32.0 reads, and the lowest class at which each is true.
_TORCH_CHECKS = {"_is_avx2_supported": "avx2", "_is_avx512_supported": "avx512",
                 "_is_avx512_bf16_supported": "avx512-bf16", "_is_vnni_supported": "avx512",
                 "_is_amx_tile_supported": "amx", "_is_amx_fp16_supported": "amx"}


class ISAError(ValueError):
    """A bad ``VRAMGATE_CPU_ISA`` value, or a cap above what the CPU has."""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (or from the text *cpuinfo*); empty where unreadable."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            return frozenset(value.split())
    return frozenset()


def isa_class(flags: Iterable[str], arch: str | None = None) -> str:
    """The ISA class of a CPU with *flags* (the highest class whose flags it has all of)."""
    arch = arch or platform.machine() or "unknown"
    if arch.lower() not in ("x86_64", "amd64", "i686", "x86"):
        return arch.lower()
    have = set(flags)
    best = X86_CLASSES[0]
    for cls in X86_CLASSES[1:]:
        if not set(_NEEDS[cls]) <= have:
            break
        best = cls
    return best


def cap() -> str | None:
    """The class ``VRAMGATE_CPU_ISA`` caps this run at, or None; :class:`ISAError` for an unknown one."""
    value = os.environ.get(CAP_ENV, "").strip().lower()
    if not value:
        return None
    if value not in X86_CLASSES:
        raise ISAError(f"{CAP_ENV}={value!r} is not an ISA class; accepted: {', '.join(X86_CLASSES)}")
    return value


def capped(detected: str, limit: str | None) -> str:
    """*detected* lowered to *limit*; :class:`ISAError` when *limit* cannot apply to this CPU."""
    if limit is None:
        return detected
    if detected not in X86_CLASSES:
        raise ISAError(f"{CAP_ENV}={limit!r} applies to x86 CPUs only; this CPU's class is {detected!r}")
    return limit if X86_CLASSES.index(limit) < X86_CLASSES.index(detected) else detected


def detected_isa() -> str:
    """This CPU's own ISA class, whatever the cap."""
    return isa_class(cpu_flags())


def effective_isa() -> str:
    """The ISA class this run's code paths use: the CPU's, lowered by ``VRAMGATE_CPU_ISA``."""
    return capped(detected_isa(), cap())


def at_least(isa: str, wanted: str) -> bool:
    """Whether class *isa* includes class *wanted* (False for other architectures)."""
    return isa in X86_CLASSES and X86_CLASSES.index(isa) >= X86_CLASSES.index(wanted)


def vllm_kernel_library(isa: str) -> str:
    """The kernel library vLLM 0.32.0's CPU build imports under *isa* (``CpuPlatform.import_kernels``)."""
    if isa not in X86_CLASSES:
        return "_C"
    if at_least(isa, "avx512"):
        return "_C" if at_least(isa, "avx512-bf16") else "_C_AVX512"
    return "_C_AVX2"


def kernel_problem(feature: str, isa: str) -> str | None:
    """Why vLLM 0.32.0's CPU kernels cannot run *feature* under *isa*, or None.

    The rules are vLLM's own: ``fp8_kv`` is refused by its CPU attention
    (``cpu_attn._get_attn_isa``: "FP8 KV cache on CPU requires x86 with AVX-512
    or AMX"); ``wna16`` (AWQ, GPTQ and compressed-tensors 4-bit linear layers,
    ``CPUWNA16LinearKernel``) calls ``cpu_gemm_wna16``, which the ``_C_AVX2``
    library does not contain; ``fp8_linear`` needs AMX (``scaled_mm/cpu.py``).
    """
    lib = vllm_kernel_library(isa)
    if isa not in X86_CLASSES:
        return None
    if feature == "fp8_kv" and not at_least(isa, "avx512"):
        return (f"vLLM's CPU attention needs AVX-512 or AMX for an fp8 KV cache; this run's ISA class is {isa} "
                f"(kernel library {lib})")
    if feature == "wna16" and not at_least(isa, "avx512"):
        return (f"vLLM's CPU 4-bit linear kernel (cpu_gemm_wna16) exists only in its AVX-512 kernel libraries; "
                f"this run's ISA class is {isa} (kernel library {lib})")
    if feature == "fp8_linear" and not at_least(isa, "amx"):
        return f"vLLM's CPU fp8 linear kernels need AMX; this run's ISA class is {isa} (kernel library {lib})"
    if feature not in ("fp8_kv", "wna16", "fp8_linear"):
        raise ValueError(f"unknown kernel feature {feature!r}; known: fp8_kv, wna16, fp8_linear")
    return None


def class_selector(text: str) -> tuple[str, bool]:
    """A CPU class selector (the matrix's ``cpu_isa``): ``"amx"`` (CPUs of that class or above) or ``"not amx"``
    (those below it) as (class, negated); :class:`ISAError` for a class that is not one of :data:`X86_CLASSES`."""
    negated = text.startswith("not ")
    cls = text.removeprefix("not ").strip()
    if cls not in X86_CLASSES:
        raise ISAError(f"unknown ISA class {cls!r}; accepted: {', '.join(X86_CLASSES)}, each alone or after \"not \"")
    return cls, negated


def selects(isa: str, selector: str) -> bool:
    """Whether a CPU of class *isa* is one *selector* (:func:`class_selector`) names; another architecture is below
    every x86 class."""
    cls, negated = class_selector(selector)
    return at_least(isa, cls) != negated


def mla_backend(isa: str) -> str:
    """The attention backend vLLM 0.32.0's CPU platform runs an MLA model (DeepSeek-V2/V3) with under *isa*.

    Note [CPU MLA backends]: ``CpuPlatform.get_attn_backend_cls`` takes ``AMX_MLA`` on an x86 CPU whose torch
    reports AMX tiles (``torch.cpu._is_amx_tile_supported``, which the cap lowers: Note [ISA cap]) unless
    ``CPU_MLA`` is asked for by name, and ``CPU_MLA`` otherwise. The two run different block sizes:
    ``CPU_MLA``'s decode kernel is built for 16 only (``check_and_update_config`` overrides any other block size
    to 16, with a warning), while ``AMXMLABackend.supports_block_size`` takes multiples of 32 and vLLM fails a 16
    at start ("No common block size for 16 (AMX_MLA: [MultipleOf(32)])"); ``AMX_MLA`` also runs bfloat16 only.
    So an MLA engine spec that runs on one CPU may not on another: a machine's limit, not a spec's error."""
    return "AMX_MLA" if at_least(isa, "amx") else "CPU_MLA"


def mla_problem(block_size: int, dtype: str, isa: str) -> str | None:
    """Why vLLM 0.32.0's CPU MLA backend of *isa* (:func:`mla_backend`) cannot run block size *block_size* and
    model dtype *dtype*, or None (Note [CPU MLA backends])."""
    backend = mla_backend(isa)
    if backend == "AMX_MLA":
        if block_size % 32:
            return (f"vLLM runs MLA with AMX_MLA on this CPU (ISA class {isa}), which takes block sizes that are "
                    f"multiples of 32, not {block_size} (16 is CPU_MLA's, on CPUs without AMX)")
        if dtype != "bfloat16":
            return f"vLLM runs MLA with AMX_MLA on this CPU (ISA class {isa}), which runs bfloat16 only, not {dtype}"
        return None
    if block_size != 16:
        return (f"vLLM runs MLA with CPU_MLA on this CPU (ISA class {isa}, no AMX), which runs block size 16 only "
                f"(it would override {block_size}; multiples of 32 are AMX_MLA's, on CPUs with AMX)")
    return None


def cap_environment(isa: str) -> dict[str, str]:
    """The environment that caps torch's and oneDNN's kernels at class *isa* (x86 only)."""
    if isa not in X86_CLASSES:
        return {}
    return {"ATEN_CPU_CAPABILITY": _ATEN[isa], "ONEDNN_MAX_CPU_ISA": _ONEDNN[isa]}


def apply_cap() -> str | None:
    """Put the cap of ``VRAMGATE_CPU_ISA`` in force in this process (see Note [ISA cap]); the capped class.

    Sets the environment for torch, oneDNN and every process started after
    this, and lowers torch's CPU checks that vLLM reads to pick its kernel
    library and kernels. Call it before vLLM is imported. Nothing happens
    without a cap, or when the cap is not below the CPU's own class.
    """
    limit = cap()
    detected = detected_isa()
    isa = capped(detected, limit)
    if limit is None or isa == detected:
        return None
    for name, value in cap_environment(isa).items():
        os.environ.setdefault(name, value)
    try:
        import torch
    except ImportError:
        return isa
    cpu: Any = torch.cpu
    for check, lowest in _TORCH_CHECKS.items():
        if hasattr(cpu, check) and not at_least(isa, lowest):
            setattr(cpu, check, _false)
    return isa


def _false() -> bool:
    return False


def describe(flags: Iterable[str] | None = None) -> dict[str, str]:
    """What the fingerprint records about the ISA: detected class (from *flags*, default this CPU's), cap, class
    in force, vLLM's kernel library."""
    detected = isa_class(cpu_flags() if flags is None else flags)
    limit = cap()
    isa = capped(detected, limit)
    out = {"isa": isa, "isa_detected": detected, "vllm_kernel_library": vllm_kernel_library(isa)}
    if limit is not None:
        out["isa_cap"] = limit
    return out
