"""Contract tests, on CPU, of what the GPU tier's first run depends on: engine arguments per tier, the
simulator's settings from an engine run, allocator figures read per rank, profiles' hardware needs against
the GPUs seen, shared kernel caches, and the check of the torch that `install-engine gpu` leaves."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from vramgate.engine import EngineSpec, engine_process_env
from vramgate.engine.arguments import GPU_HEADROOM_BYTES, GPU_UTILIZATION_MAX, gpu_utilization, llm_kwargs
from vramgate.engine.measure import worker_allocator
from vramgate.machine import hardware
from vramgate.profiles.manifest import find_profile, requirement_problem
from vramgate.sim import settings_of_engine
from vramgate.tools.install import gpu_torch_problem

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
SPEC = EngineSpec(model="tiny-llama", workload="fixed", requests=4, block_size=16, max_model_len=1024,
                  kv_budget_gib=0.25)


# -- 2. the start-up utilization of a GPU engine with a fixed KV budget -------------------------------------


def test_gpu_engine_asks_for_what_it_needs_not_92_percent() -> None:
    model_dir = ROOT / "fixtures" / "models" / "tiny-llama"
    kwargs = llm_kwargs(SPEC, model_dir, device_total_bytes=40 * GIB)  # an A100 40 GB
    assert kwargs["kv_cache_memory_bytes"] == GIB // 4
    util = kwargs["gpu_memory_utilization"]
    assert 0.1 < util < 0.2  # 0.25 GiB KV + ~34 MiB weights + 4 GiB headroom of 40 GiB
    assert util * 40 * GIB >= GIB // 4 + GPU_HEADROOM_BYTES
    # two paired engines start side by side, where 2 x 0.92 never could
    assert 2 * util < 1 < 2 * GPU_UTILIZATION_MAX


def test_each_tensor_parallel_rank_asks_for_its_share_of_the_weights() -> None:
    """Each of a TP=4 engine's ranks holds a quarter of the weights (vLLM shards the embedding and LM head by
    vocab too), so each asks for that share of its GPU, not the whole model's."""
    from vramgate.models.config import read_config
    from vramgate.models.quant import weight_size

    model_dir = ROOT / "fixtures" / "models" / "llama-3.1-8b"
    weights = weight_size(read_config(model_dir / "config.json"), "bf16").total_bytes
    spec = EngineSpec(model="llama-3.1-8b", kv_budget_gib=1.0)
    one = llm_kwargs(spec, model_dir, device_total_bytes=80 * GIB)["gpu_memory_utilization"]
    four = llm_kwargs(spec.replace(tensor_parallel_size=4), model_dir,
                      device_total_bytes=80 * GIB)["gpu_memory_utilization"]
    assert one * 80 * GIB - GIB - GPU_HEADROOM_BYTES == pytest.approx(weights, abs=80 * GIB / 1e4)  # 4 decimals
    assert four * 80 * GIB - GIB - GPU_HEADROOM_BYTES == pytest.approx(weights / 4, abs=80 * GIB / 1e4)
    assert four < 0.15 < 0.2 < one


def test_cpu_engine_arguments_are_unchanged_and_overrides_win() -> None:
    model_dir = ROOT / "fixtures" / "models" / "tiny-llama"
    assert "gpu_memory_utilization" not in llm_kwargs(SPEC, model_dir)
    own = SPEC.replace(engine_args={"gpu_memory_utilization": 0.5})
    assert llm_kwargs(own, model_dir, device_total_bytes=80 * GIB)["gpu_memory_utilization"] == 0.5


@pytest.mark.parametrize(("kv", "weights", "total", "expected"), [
    (0, 0, 1000 * GIB, 0.01), (200 * GIB, 0, 80 * GIB, GPU_UTILIZATION_MAX), (4 * GIB, 0, 80 * GIB, 0.1),
])
def test_gpu_utilization_is_clamped(kv: int, weights: int, total: int, expected: float) -> None:
    assert gpu_utilization(kv, weights, total) == pytest.approx(expected)
    with pytest.raises(ValueError, match="device memory must be positive"):
        gpu_utilization(kv, weights, 0)


# -- 1. the simulator runs with the engine's own async scheduling ----------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_simulator_settings_follow_the_engine(async_scheduling: bool) -> None:
    settings = settings_of_engine(SPEC.to_json(), block_size=16, num_gpu_blocks=513, prefix_caching=True,
                                  async_scheduling=async_scheduling)
    assert settings["async_scheduling"] is async_scheduling  # on CUDA vLLM turns it on by default
    assert settings["num_gpu_blocks"] == 513 and settings["max_num_seqs"] == SPEC.max_num_seqs


# -- 8. allocator figures are read in each rank's own process -------------------------------------------------


def test_allocator_figures_come_from_the_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, current_device=lambda: 3,
                                 max_memory_allocated=lambda d: 1000 + d, max_memory_reserved=lambda d: 2000 + d,
                                 memory_allocated=lambda d: 500 + d)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert worker_allocator(object()) == {"cuda_max_allocated_bytes": 1003, "cuda_max_reserved_bytes": 2003,
                                           "cuda_allocated_bytes": 503}
    cuda.is_available = lambda: False
    assert worker_allocator(object()) == {}


# -- 9. profiles' hardware needs against the GPUs this process sees -----------------------------------------------


@pytest.mark.parametrize(("gpus", "capability", "skips"), [
    (0, None, True), (1, (8, 0), True), (1, (9, 0), False), (2, (10, 0), False),
])
def test_flashmla_needs_a_hopper_or_blackwell_gpu(
    monkeypatch: pytest.MonkeyPatch, gpus: int, capability: tuple[int, int] | None, skips: bool
) -> None:
    seen = tuple(hardware.GPUInfo("GPU", 80 * GIB, capability) for _ in range(gpus))
    monkeypatch.setattr(hardware, "visible_gpus", lambda: seen)
    problem = requirement_problem(find_profile(ROOT, "attention-flashmla"), "cuda")
    assert (problem is not None) == skips
    assert requirement_problem(find_profile(ROOT, "attention-flashmla"), "cpu") is not None  # a GPU-tier profile


def test_a_profile_needing_gpus_runs_where_they_are(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import dataclasses

    from vramgate.profiles.manifest import Requirements

    profile = dataclasses.replace(find_profile(ROOT, "attention-triton-mla"),
                                  requires=Requirements(device="cuda", gpus=2))
    monkeypatch.setattr(hardware, "visible_gpus", lambda: (hardware.GPUInfo("GPU", GIB, (8, 0)),) * 2)
    assert requirement_problem(profile, "cuda") is None  # before: always "needs 2 GPU(s); 0 visible"
    monkeypatch.setattr(hardware, "visible_gpus", lambda: (hardware.GPUInfo("GPU", GIB, (8, 0)),))
    assert requirement_problem(profile, "cuda") == "profile attention-triton-mla needs 2 GPU(s); 1 visible"


# -- 10. compiled kernels are shared by the engines of a session ---------------------------------------------------


def test_kernel_caches_are_shared_by_a_sessions_engines(tmp_path: Path) -> None:
    shared = tmp_path / "vllm-cache"
    a = engine_process_env(SPEC, tmp_path / "run-a", cache_root=shared)
    b = engine_process_env(SPEC, tmp_path / "run-b", cache_root=shared)
    for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"):
        assert a[name] == b[name] and a[name].startswith(str(shared))
    assert a["TMPDIR"] != b["TMPDIR"]  # temporary files stay per run
    assert a["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


# -- 6. the torch that `install-engine gpu` leaves ------------------------------------------------------------------


def test_install_check_refuses_a_cpu_torch_and_an_old_driver() -> None:
    cpu = gpu_torch_problem("2.13.0+cpu", None, False, "13.0")
    assert cpu and "is a CPU build" in cpu and "--index-url" in cpu
    old = gpu_torch_problem("2.13.0", "13.0", False, "12.8")
    assert old and "the NVIDIA driver supports CUDA 12.8 only" in old
    assert "sees no GPU" in (gpu_torch_problem("2.13.0", "13.0", False, None) or "")
    assert gpu_torch_problem("2.13.0", "13.0", True, "13.0") is None
    assert gpu_torch_problem(None, None, False, None) == "torch is not installed"



def test_install_check_imports_vllms_cuda_extension(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A torch==2.13.0+cu128 satisfies vLLM's pin and sees the GPU, but vLLM 0.32.0's extension needs
    libcudart.so.13: the check imports the extension in the environment it made and says why it fails."""
    from vramgate.tools import install

    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "_C_stable_libtorch.py").write_text(
        "raise ImportError('libcudart.so.13: cannot open shared object file: No such file or directory')\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    error = install.extension_error()
    assert error is not None and "libcudart.so.13" in error
    problem = install.gpu_extension_problem(error, "2.13.0+cu128", "12.8")
    assert problem is not None and "vllm._C_stable_libtorch cannot be imported" in problem and "CUDA 12.8" in problem
    monkeypatch.setattr(install, "torch_facts", lambda python=None: {"version": "2.13.0+cu128", "cuda": "12.8",
                                                                      "available": True})
    monkeypatch.setattr(install, "driver_cuda_or_none", lambda: "13.0")
    with pytest.raises(SystemExit, match=r"libcudart\.so\.13"):
        install.check_gpu_torch(sys.executable)
    (site / "vllm" / "_C_stable_libtorch.py").write_text("")
    assert install.extension_error() is None
    install.check_gpu_torch(sys.executable)
    assert "vllm._C_stable_libtorch imports" in capsys.readouterr().out


# -- the dry run: what a GPU runner would run and skip ----------------------------------------------------------

PLAN_TESTS = """
import pytest

@pytest.mark.requires_gpus(2)
def test_tp():
    pass

@pytest.mark.requires_capability(9, 0)
def test_hopper():
    pass

@pytest.mark.requires_gpus(1)
@pytest.mark.requires_gpu_memory(40)
def test_one():
    pass

def test_cpu():
    pass
"""


def test_plan_says_what_a_gpu_runner_would_do(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    a100 = hardware.GPUInfo("NVIDIA A100-SXM4-40GB", 40 * 10**9, (8, 0))
    monkeypatch.setattr(hardware, "visible_gpus", lambda: (a100,))
    pytester.makepyfile(test_plan=PLAN_TESTS)
    result = pytester.runpytest("--collect-only", "-q", "--gate-plan", "--gate-hardware", "a100-box")
    result.stdout.fnmatch_lines([
        "vramgate plan: hardware a100-box (tier cpu); GPUs visible: NVIDIA A100-SXM4-40GB (37 GiB, capability 8.0)",
        "3 test(s) need a GPU: 1 would run here, 2 would skip",
        "*1 x requires_capability(9, 0): skips: *needs compute capability >= 9.0, NVIDIA A100-SXM4-40GB has 8.0",
        "*1 x requires_gpus(2): skips: requires_gpus(2): needs 2 CUDA GPU(s), 1 visible",
        "*1 x requires_gpu_memory(40), requires_gpus(1): runs",
    ])


def test_a_model_without_a_weight_model_still_gets_engine_arguments(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "hidden_size": 8}')
    kwargs = llm_kwargs(SPEC, tmp_path, device_total_bytes=80 * GIB)
    assert kwargs["gpu_memory_utilization"] == pytest.approx((GIB // 4 + GPU_HEADROOM_BYTES) / (80 * GIB), abs=1e-4)


# -- the hardware key counts the GPUs a test uses ------------------------------------------------------------------

KEY_TESTS = """
import pytest

def test_one_gpu(gate):
    gate.record("peak_bytes", 100, unit="B", scope="machine")

@pytest.mark.requires_gpus(4)
def test_four_gpus(gate):
    gate.record("peak_bytes", 400, unit="B", scope="machine")
"""


def test_a_tests_baselines_are_keyed_by_the_gpus_it_uses(pytester: pytest.Pytester,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [GPUs a test uses]: on an 8xH100 box a single-GPU test reads and writes the ``-x1`` baselines, a
    requires_gpus(4) test the ``-x4`` ones; each file's hardware names the GPUs its tests used."""
    import json

    h100 = hardware.GPUInfo("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0))
    monkeypatch.setattr(hardware, "probe_gpus", lambda: ((h100,) * 8, "580.1", "13.0"))
    pytester.makepyfile(test_keys=KEY_TESTS)
    plan = pytester.runpytest("--collect-only", "--gate-plan", "-v", "-p", "no:cacheprovider")
    plan.stdout.fnmatch_lines([
        "vramgate plan: hardware nvidia-h100-80gb-hbm3-80gb-x8 (tier cuda)*",
        "*test_keys.py::test_one_gpu [[]nvidia-h100-80gb-hbm3-80gb-x1[]]: compares nothing*",
        "*test_keys.py::test_four_gpus [[]nvidia-h100-80gb-hbm3-80gb-x4[]]: compares nothing*",
    ])
    pytester.runpytest("--gate-update", "-p", "no:cacheprovider").assert_outcomes(passed=2)
    one = json.loads((pytester.path / "baselines" / "nvidia-h100-80gb-hbm3-80gb-x1" / "keys.json").read_text())
    four = json.loads((pytester.path / "baselines" / "nvidia-h100-80gb-hbm3-80gb-x4" / "keys.json").read_text())
    assert list(one["tests"]) == ["test_keys.py::test_one_gpu"] and len(one["hardware"]["gpus"]) == 1
    assert list(four["tests"]) == ["test_keys.py::test_four_gpus"] and len(four["hardware"]["gpus"]) == 4
    assert not (pytester.path / "baselines" / "nvidia-h100-80gb-hbm3-80gb-x8").exists()
    result = pytester.runpytest("-p", "no:cacheprovider", "--gate-require-hardware")
    result.assert_outcomes(passed=2)
    # an overridden key names the whole machine: every test reads it
    plan = pytester.runpytest("--collect-only", "--gate-plan", "-v", "--gate-hardware", "my-box",
                              "-p", "no:cacheprovider")
    plan.stdout.fnmatch_lines(["*test_four_gpus [[]my-box[]]*"])


# -- the attention profiles' engine cases, with the tier faked to gpu --------------------------------------------


def _suite_module(path: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"suite_{Path(path).stem}", ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "engine_tier", lambda: "gpu")
    monkeypatch.setattr(module, "skip_unmet", lambda profile: None)
    monkeypatch.setattr(module, "runnable_candidate", lambda spec, profile, use_mla: spec.replace(profile=profile.name))
    return module


class _FakeEngine:
    """Engine.run stand-in: vLLM's KV figures at a fixed budget for the spec's block size (576 B per token and
    layer, 3 layers: tiny-deepseek-v2), the capacity moved by *shift* tokens for a profile's run."""

    def __init__(self, shift: int = 0) -> None:
        self.shift = shift
        self.specs: list[EngineSpec] = []

    def run(self, spec: EngineSpec) -> types.SimpleNamespace:
        self.specs.append(spec)
        budget = int((spec.kv_budget_gib or 0) * GIB)
        blocks = budget // (576 * 2 * spec.block_size * 3)
        capacity = blocks * spec.block_size + (self.shift if spec.profile else 0)
        return types.SimpleNamespace(
            kv=types.SimpleNamespace(capacity_tokens=capacity, block_size=spec.block_size, bytes_per_token=576 * 2 * 3),
            memory=types.SimpleNamespace(cuda_max_allocated_bytes=123 << 20))


def test_a_backend_profile_runs_its_block_size_and_keeps_the_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    from vramgate.pytest_plugin.fixture import Gate

    module = _suite_module("suites/attention/test_backend_engine.py", monkeypatch)
    flashmla = find_profile(ROOT, "attention-flashmla")
    engine = _FakeEngine()
    gate = Gate("t::capacity", "attention")
    module.test_backend_kv_capacity(gate, engine, flashmla)
    assert [s.block_size for s in engine.specs] == [64, 16]  # FlashMLA's, then the automatic choice's
    assert engine.specs[0].profile == "attention-flashmla" and not engine.specs[1].profile  # its reference: UNPATCHED
    assert gate.metrics["kv_block_size"].value == 64
    assert gate.metrics["peak_allocated_bytes"].effective_scope == "machine"
    with pytest.raises(AssertionError, match="moved the KV capacity at a fixed budget by 64 tokens"):
        module.test_backend_kv_capacity(Gate("t::moved", "attention"), _FakeEngine(shift=96), flashmla)


# -- "fusion on" must be fusion on --------------------------------------------------------------------------------


class AllReduceFusionPass:  # the name vLLM's pass has: the reading finds passes by class name
    def __init__(self, disabled: bool, matched: int | None = None) -> None:
        self.disabled = disabled
        if matched is not None:
            self.matched_count = matched


def test_a_disabled_fusion_pass_is_read_from_the_ranks_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [fusion pass state]: vLLM only warns and leaves AllReduceFusionPass disabled when FlashInfer's comm
    module is missing; the rank's pass objects say so, and the TP suite skips the "fusion on" run with that reason."""
    from vramgate.engine import fusion_problem
    from vramgate.engine.measure import FUSION_MODULE, worker_fusion_passes

    monkeypatch.setitem(sys.modules, FUSION_MODULE, types.SimpleNamespace(flashinfer_comm=None))
    off = AllReduceFusionPass(disabled=True)
    state = worker_fusion_passes(None)
    assert state == {"passes": {"AllReduceFusionPass": {"instances": 1, "enabled": False, "matched": None}},
                     "flashinfer_comm": False}
    problem = fusion_problem([state, state])
    assert problem and "rank 0: vLLM disabled its AllReduceFusionPass (FlashInfer's comm module is missing)" in problem
    del off
    on = AllReduceFusionPass(disabled=False, matched=12)
    monkeypatch.setitem(sys.modules, FUSION_MODULE, types.SimpleNamespace(flashinfer_comm=object()))
    state = worker_fusion_passes(None)
    assert state["passes"]["AllReduceFusionPass"] == {"instances": 1, "enabled": True, "matched": 12}
    assert fusion_problem([state, state]) is None
    assert "made no AllReduceFusionPass" in (fusion_problem([{"passes": {}}]) or "")
    assert "replaced no pattern" in (fusion_problem([{"passes": {"AllReduceFusionPass": {
        "instances": 1, "enabled": True, "matched": 0}}}]) or "")
    del on


# -- the cuda tier's portable figures, computed on CPU -------------------------------------------------------------

COMPUTE_TESTS = """
from vramgate.engine import UnsupportedHere, engine_tier

def test_figures(gate):
    assert engine_tier() == "gpu"
    gate.record("page_bytes", 8192, unit="B")
    gate.record("weights_bytes", 123, unit="B", scope="machine")

def test_engine():
    raise UnsupportedHere("an engine run needs the tier's own hardware")
"""


def test_the_cuda_tiers_portable_figures_are_computed_on_cpu(pytester: pytest.Pytester,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [a tier's portable figures computed on CPU]: the engine tier is the GPU's, engines skip, portable figures
    go under baselines/cuda/ saying where they were computed, machine-bound ones are neither compared nor written."""
    import json

    monkeypatch.setattr(hardware, "probe_gpus", lambda: ((), None, None))
    monkeypatch.delenv(hardware.COMPUTE_TIER_ENV, raising=False)
    pytester.makepyfile(test_computed=COMPUTE_TESTS)
    result = pytester.runpytest("--gate-compute-tier", "cuda", "--gate-update", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*not on this machine: an engine run needs the tier's own hardware*"])
    stored = json.loads((pytester.path / "baselines" / "cuda" / "computed.json").read_text())
    entry = stored["tests"]["test_computed.py::test_figures"]
    assert set(entry["metrics"]) == {"page_bytes"}
    assert entry["recorded"]["computed_on"].startswith("CPU from vLLM's own classes")
    assert [p.name for p in (pytester.path / "baselines").iterdir()] == ["cuda"]
    assert hardware.COMPUTE_TIER_ENV not in __import__("os").environ  # restored at the end
    # the computed figures are then compared: a change of vLLM's accounting is a finding
    pytester.makepyfile(test_computed=COMPUTE_TESTS.replace("8192", "16384"))
    again = pytester.runpytest("--gate-compute-tier", "cuda", "-p", "no:cacheprovider")
    again.assert_outcomes(failed=1, skipped=1)
    usage = pytester.runpytest("--gate-compute-tier", "cuda", "--gate-update-scope", "all", "-p", "no:cacheprovider")
    usage.stderr.fnmatch_lines(["*--gate-compute-tier cuda: writes portable baselines only*"])
    h100 = hardware.GPUInfo("NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0))
    monkeypatch.setattr(hardware, "probe_gpus", lambda: ((h100,), "580.1", "13.0"))
    refused = pytester.runpytest("--gate-compute-tier", "cuda", "-p", "no:cacheprovider")
    refused.stderr.fnmatch_lines(["*this machine has GPUs; run the gate on them*"])


def test_a_computed_tier_is_cuda_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hardware.COMPUTE_TIER_ENV, "rocm")
    with pytest.raises(ValueError, match="the only tier computed on another machine is 'cuda'"):
        hardware.computed_tier()
    monkeypatch.setenv(hardware.COMPUTE_TIER_ENV, "")
    assert hardware.computed_tier() is None


PLAN_ON_8_H100 = """
import sys, pytest
from vramgate.machine import hardware
h100 = hardware.GPUInfo("NVIDIA H100 80GB HBM3", 80 * 2**30, (9, 0))
hardware.probe_gpus = lambda: ((h100,) * 8, "580.1", "13.0")
sys.exit(pytest.main(["suites", "--collect-only", "--gate-plan", "-p", "no:cacheprovider", "-p", "no:xdist"]))
"""


def test_a_gpu_runners_first_plan_compares_what_vllm_computes_without_a_device() -> None:
    """--gate-plan on a faked 8xH100 box: the suites whose portable figures vLLM computes without a device compare
    every test with baselines/cuda/ (computed on CPU, Note [a tier's portable figures computed on CPU]); a
    single-GPU test reads the -x1 key, the TP tests their own GPU counts."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop(hardware.COMPUTE_TIER_ENV, None)
    out = subprocess.run([sys.executable, "-c", PLAN_ON_8_H100], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = {line.split(":")[0].strip(): line for line in out.stdout.splitlines() if line.startswith("  ")}
    for suite in ("kv_cache", "capacity", "growth", "simulator", "waste"):
        assert suite in lines and ", 0 have none" in lines[suite], lines.get(suite, out.stdout[-3000:])
        assert "under nvidia-h100-80gb-hbm3-80gb-x1," in lines[suite], lines[suite]
    assert "-x2, nvidia-h100-80gb-hbm3-80gb-x4, nvidia-h100-80gb-hbm3-80gb-x8," in lines["tp_overlap"]
