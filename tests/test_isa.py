"""The CPU's ISA class, the hardware key that names it, the cap that runs the lower class's code, and the kernel
checks that skip what vLLM's CPU kernels cannot run, before an engine starts."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from vramgate.engine import EngineSpec, SpecError, UnsupportedHere, kernel_problem, validate
from vramgate.machine import hardware, isa

ROOT = Path(__file__).resolve().parents[1]
#: Flags as /proc/cpuinfo lists them (abridged): an AVX2-only EPYC (family 23) and an AVX-512 EPYC with BF16.
ZEN2 = "fpu sse4_2 avx f16c fma avx2 bmi2 sha_ni"
ZEN5 = ZEN2 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni avx512vbmi"
SAPPHIRE = ZEN5 + " amx_bf16 amx_tile amx_int8"


@pytest.mark.parametrize(("flags", "expected"), [
    ("fpu sse4_2", "x86-64"), (ZEN2, "avx2"), (ZEN2 + " avx512f avx512dq avx512bw avx512vl", "avx512"),
    (ZEN2 + " avx512f avx512bw avx512vl", "avx2"),  # torch's AVX-512 check wants DQ too
    (ZEN5, "avx512-bf16"), (SAPPHIRE, "amx"),
])
def test_isa_class_from_flags(flags: str, expected: str) -> None:
    assert isa.isa_class(flags.split(), "x86_64") == expected


def test_other_architectures_are_their_own_class() -> None:
    assert isa.isa_class(["asimd", "sve"], "aarch64") == "aarch64"
    assert isa.kernel_problem("wna16", "aarch64") is None


def test_flags_are_read_from_cpuinfo_text() -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: " + ZEN5 + "\n\nprocessor\t: 1\n"
    assert "avx512_bf16" in isa.cpu_flags(text)


@pytest.mark.parametrize(("detected", "cap", "expected"), [
    ("avx512-bf16", None, "avx512-bf16"), ("avx512-bf16", "avx2", "avx2"), ("avx512-bf16", "avx512", "avx512"),
    ("avx2", "amx", "avx2"),  # a cap never raises the class
])
def test_cap_lowers_never_raises(detected: str, cap: str | None, expected: str) -> None:
    assert isa.capped(detected, cap) == expected


def test_unknown_cap_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardware, "probe_gpus", lambda: ((), None, None))  # a CPU fingerprint, on any box
    monkeypatch.setenv(isa.CAP_ENV, "avx1024")
    with pytest.raises(isa.ISAError, match="VRAMGATE_CPU_ISA='avx1024' is not an ISA class; accepted: x86-64, avx2"):
        isa.cap()
    with pytest.raises(ValueError, match="not an ISA class"):
        hardware.detect()


def test_cap_on_another_architecture_is_refused() -> None:
    with pytest.raises(isa.ISAError, match="applies to x86 CPUs only"):
        isa.capped("aarch64", "avx2")


@pytest.mark.parametrize(("cls", "library"), [
    ("avx2", "_C_AVX2"), ("x86-64", "_C_AVX2"), ("avx512", "_C_AVX512"), ("avx512-bf16", "_C"), ("amx", "_C"),
])
def test_vllm_kernel_library_follows_import_kernels(cls: str, library: str) -> None:
    assert isa.vllm_kernel_library(cls) == library


def test_kernel_problems_name_the_class_and_library() -> None:
    assert "needs AVX-512 or AMX for an fp8 KV cache; this run's ISA class is avx2 (kernel library _C_AVX2)" in (
        isa.kernel_problem("fp8_kv", "avx2") or "")
    assert "cpu_gemm_wna16" in (isa.kernel_problem("wna16", "avx2") or "")
    assert isa.kernel_problem("fp8_kv", "avx512") is None
    assert isa.kernel_problem("wna16", "avx512-bf16") is None
    assert isa.kernel_problem("fp8_linear", "avx512-bf16") is not None
    assert isa.kernel_problem("fp8_linear", "amx") is None
    with pytest.raises(ValueError, match="unknown kernel feature"):
        isa.kernel_problem("int3", "amx")


def fake_cpu(monkeypatch: pytest.MonkeyPatch, flags: str, cap: str | None) -> None:
    monkeypatch.setattr(isa, "cpu_flags", lambda cpuinfo=None: frozenset(flags.split()))
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    if cap:
        monkeypatch.setenv(isa.CAP_ENV, cap)
    else:
        monkeypatch.delenv(isa.CAP_ENV, raising=False)


@pytest.mark.parametrize(("flags", "cap", "key"), [
    (ZEN5, None, "cpu-x86_64-avx512-bf16-amd-epyc"), (ZEN5, "avx2", "cpu-x86_64-avx2-amd-epyc"),
    (ZEN2, None, "cpu-x86_64-avx2-amd-epyc"),  # the capped AVX-512 box and a real AVX2 box share a key
])
def test_cpu_key_names_the_isa_class(monkeypatch: pytest.MonkeyPatch, flags: str, cap: str | None, key: str) -> None:
    fake_cpu(monkeypatch, flags, cap)
    monkeypatch.setattr(hardware, "probe_gpus", lambda: ((), None, None))
    monkeypatch.setattr(hardware, "_cpu_model", lambda: "AMD EPYC")
    monkeypatch.setattr(hardware.platform, "machine", lambda: "x86_64")
    fp = hardware.detect()
    assert fp.key == key and fp.tier == "cpu" and fp.portable_key == "cpu"
    assert fp.to_json()["tier"] == "cpu" and "avx2" in fp.to_json()["flags"]
    assert fp.extra["isa_detected"] == isa.isa_class(flags.split(), "x86_64")
    assert ("isa_cap" in fp.extra) == (cap is not None)


def test_gpu_fingerprint_is_the_cuda_tier() -> None:
    gpu = hardware.GPUInfo("NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0))
    fp = hardware.Fingerprint(key=hardware.gpu_key((gpu,)), device="cuda", arch="x86_64", cpu_model="x",
                              cpu_count=1, memory_bytes=1, gpus=(gpu,))
    assert fp.key == "nvidia-h100-80gb-hbm3-80gb-x1" and fp.tier == "gpu" and fp.portable_key == "cuda"


def test_apply_cap_lowers_the_checks_vllm_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, SAPPHIRE, "avx2")
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.setenv(name, "")  # so that the test's own changes are undone after it
        monkeypatch.delenv(name)
    cpu = types.SimpleNamespace(**{check: (lambda: True) for check in (
        "_is_avx2_supported", "_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")})
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cpu=cpu))
    assert isa.apply_cap() == "avx2"
    assert cpu._is_avx2_supported() is True
    assert not cpu._is_avx512_supported() and not cpu._is_avx512_bf16_supported() and not cpu._is_amx_tile_supported()
    import os

    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2" and os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_apply_cap_without_a_cap_touches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, ZEN5, None)
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch would fail: nothing may try
    assert isa.apply_cap() is None


def test_engine_spec_with_fp8_kv_is_unsupported_before_the_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, ZEN5, "avx2")
    spec = EngineSpec(model="tiny-llama", workload="fixed", requests=2, block_size=32, max_model_len=256,
                      kv_budget_gib=0.25, engine_args={"kv_cache_dtype": "fp8"})
    problem = kernel_problem(spec, "cpu")
    assert problem and problem.startswith("kv_cache_dtype 'fp8': vLLM's CPU attention needs AVX-512")
    with pytest.raises(UnsupportedHere) as info:
        validate(spec, ROOT, tier="cpu")
    assert isinstance(info.value, SpecError)
    awq = spec.replace(engine_args={"quantization": "awq"})
    assert "cpu_gemm_wna16" in (kernel_problem(awq, "cpu") or "")
    assert kernel_problem(spec, "gpu") is None  # the GPU tier's kernels are not the CPU build's
    fake_cpu(monkeypatch, ZEN5, None)
    assert kernel_problem(spec, "cpu") is None and kernel_problem(awq, "cpu") is None


def test_mla_backends_by_isa() -> None:
    # Note [CPU MLA backends]: AMX_MLA on a CPU with AMX tiles (multiples of 32, bfloat16), CPU_MLA elsewhere (16).
    assert isa.mla_backend("amx") == "AMX_MLA" and isa.mla_backend("avx512-bf16") == "CPU_MLA"
    assert isa.mla_backend("aarch64") == "CPU_MLA"
    assert isa.mla_problem(16, "bfloat16", "avx512-bf16") is None and isa.mla_problem(32, "bfloat16", "amx") is None
    assert "multiples of 32, not 16" in (isa.mla_problem(16, "bfloat16", "amx") or "")
    assert "bfloat16 only" in (isa.mla_problem(64, "float16", "amx") or "")
    assert "block size 16 only" in (isa.mla_problem(32, "bfloat16", "avx2") or "")


def test_an_mla_block_size_of_the_other_cpu_is_unsupported_here(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = EngineSpec(model="tiny-deepseek-v2", workload="fixed", requests=2, block_size=16, max_model_len=256,
                      kv_budget_gib=0.25)
    fake_cpu(monkeypatch, SAPPHIRE, None)
    with pytest.raises(UnsupportedHere, match="AMX_MLA on this CPU"):
        validate(spec, ROOT, tier="cpu")
    validate(spec.replace(block_size=32), ROOT, tier="cpu")
    assert kernel_problem(spec, "cpu") is None  # the rule is the MLA backend's: a model without MLA is not asked
    fake_cpu(monkeypatch, SAPPHIRE, "avx512-bf16")  # capped below AMX: torch reports no AMX tiles, vLLM runs CPU_MLA
    validate(spec, ROOT, tier="cpu")
    with pytest.raises(UnsupportedHere, match="CPU_MLA on this CPU"):
        validate(spec.replace(block_size=32), ROOT, tier="cpu")


def test_a_class_selector_takes_a_class_or_its_negation() -> None:
    assert isa.class_selector("amx") == ("amx", False) and isa.class_selector("not avx512") == ("avx512", True)
    assert isa.selects("amx", "amx") and not isa.selects("avx512-bf16", "amx") and isa.selects("avx2", "not avx512")
    with pytest.raises(isa.ISAError, match="unknown ISA class 'amx2'"):
        isa.class_selector("amx2")
