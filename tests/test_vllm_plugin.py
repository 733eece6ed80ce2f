"""What an engine without a KV budget reads in every tensor-parallel rank (Note [automatic KV] in
vramgate.engine.memory_decision), on stand-ins for torch and vLLM: the vLLM plugin that installs the hooks where vLLM
runs its workers, the engine driver that leaves CUDA alone until vLLM has started them, the decision over the ranks,
and the load's peak of the engine's own memory."""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from module_fakes import fake_modules
from vramgate.engine import memory_decision as md
from vramgate.engine.spec import EngineSpec

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


def _entry_point() -> str:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    plugins = data["project"].get("entry-points", {}).get("vllm.general_plugins", {})
    assert plugins, "pyproject.toml declares no vllm.general_plugins entry point"
    assert list(plugins) == ["vramgate"], plugins
    return str(plugins["vramgate"])


def test_the_vllm_plugin_is_declared_and_installs_the_hooks_only_when_the_engine_asks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    target = _entry_point()
    module_name, _, function = target.partition(":")
    plugin = importlib.import_module(module_name)
    register = getattr(plugin, function)
    calls: list[str] = []
    monkeypatch.setattr(md, "install_hooks", lambda: calls.append("hooks"))
    monkeypatch.delenv(plugin.MEMORY_HOOKS_ENV, raising=False)
    register()  # vLLM loads it in every process it runs (a user's too): nothing unless the engine asked
    assert calls == []
    monkeypatch.setenv(plugin.MEMORY_HOOKS_ENV, "0")
    register()
    assert calls == []
    monkeypatch.setenv(plugin.MEMORY_HOOKS_ENV, "1")
    register()
    assert calls == ["hooks"]
    assert plugin.MEMORY_HOOKS_ENV.startswith("VRAMGATE_")


def _rank(requested: int, available: int, weights: int) -> dict[str, Any]:
    return {"tier": "gpu", "requested_bytes": requested, "total_bytes": 80 * GIB, "available_kv_bytes": available,
            "cudagraph_estimate_bytes": GIB, "cudagraph_estimate_applied": True, "cudagraph_bytes": GIB,
            "weights_memory": weights, "torch_peak_increase": GIB // 2, "non_torch_increase": GIB // 4,
            "non_kv_cache_memory": requested - available - GIB}


def test_a_tensor_parallel_decision_is_the_smallest_ranks() -> None:
    """vLLM gives every rank the KV cache of the rank with the least memory (``get_kv_cache_configs``: the smallest
    block count), while the engine core keeps rank 0's figure: the decision is the limiting rank's."""
    core = SimpleNamespace(available_gpu_memory_for_kv_cache=60 * GIB)  # rank 0's, as vLLM keeps it
    cache = SimpleNamespace(gpu_memory_utilization=0.9, num_gpu_blocks=1000, kv_cache_size_tokens=16000,
                            kv_cache_max_concurrency=7.8125)
    ranks = [_rank(72 * GIB, 60 * GIB, 8 * GIB), _rank(72 * GIB, 58 * GIB, 8 * GIB + 1)]
    d = md.decide(core, cache, SimpleNamespace(max_model_len=2048), ranks, 70 * GIB)
    assert d.available_kv_bytes == 58 * GIB
    assert d.non_kv_bytes == 14 * GIB and d.weights_bytes == 8 * GIB + 1  # the limiting rank's breakdown
    # TP 1, or ranks alike: the engine core's figure
    d = md.decide(core, cache, SimpleNamespace(max_model_len=2048), ranks[:1], None)
    assert (d.available_kv_bytes, d.non_kv_bytes) == (60 * GIB, 12 * GIB)


def test_each_gpu_rank_reports_the_kv_memory_it_found() -> None:
    worker = SimpleNamespace(requested_memory=72 * GIB, init_snapshot=SimpleNamespace(total_memory=80 * GIB),
                             available_kv_cache_memory_bytes=58 * GIB, model_runner=SimpleNamespace())
    with pytest.MonkeyPatch.context() as mp:
        fake_modules(mp, {"torch": {"cuda": SimpleNamespace(is_available=lambda: True)},
                          "vllm": {"envs": SimpleNamespace(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=True)},
                          "vllm.v1.worker.gpu_worker": {}})
        assert md.worker_memory_decision(worker)["available_kv_bytes"] == 58 * GIB


# -- The engine driver: CUDA untouched until vLLM has started its workers


class _CudaTouched(AssertionError):
    pass


class _Started(Exception):
    pass


def _fake_torch(touched: list[str]) -> SimpleNamespace:
    """A torch whose CUDA calls are recorded; ``is_available`` counts as touching CUDA unless torch would answer it
    through NVML (``PYTORCH_NVML_BASED_CUDA_CHECK``), which creates no CUDA state a forked rank inherits."""
    import os

    def is_available() -> bool:
        if os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") != "1":
            touched.append("is_available")
        return True

    def touch(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            touched.append(name)
            raise _CudaTouched(f"torch.cuda.{name} in the engine driver before vLLM started its workers")
        return call

    cuda = SimpleNamespace(is_available=is_available, is_initialized=lambda: bool(touched))
    for name in ("get_device_properties", "current_device", "mem_get_info", "memory_reserved", "init", "set_device",
                 "get_device_name", "device_count", "max_memory_reserved", "memory_stats"):
        setattr(cuda, name, touch(name))
    cuda.memory = SimpleNamespace(_record_memory_history=touch("memory._record_memory_history"))
    return SimpleNamespace(cuda=cuda)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_engine_driver_leaves_cuda_alone_until_vllm_started_its_workers(
        tp: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM forks its tensor-parallel ranks from the driver unless CUDA is initialized there (then it spawns them,
    and what the driver installed never reaches them). On the GPU tier the driver reads the device's size through
    vLLM's platform (NVML), and the engine's environment makes torch answer ``is_available`` through NVML."""
    import os

    from vramgate.engine import runner, worker

    spec = EngineSpec(model="tiny-llama", kv_budget_gib=None, gpu_memory_utilization=0.9, tensor_parallel_size=tp,
                      requests=2, max_model_len=512, max_num_batched_tokens=512)
    monkeypatch.setattr("vramgate.engine.runner.nvml.engine_visible_devices", lambda value: value)
    env = runner.engine_process_env(spec, tmp_path)  # what the engine's process starts with
    for key in ("PYTORCH_NVML_BASED_CUDA_CHECK", "VLLM_ENABLE_V1_MULTIPROCESSING", "VRAMGATE_MEMORY_HOOKS"):
        monkeypatch.setenv(key, env.get(key, ""))  # restored after the test, whatever run() sets
        if key not in env:
            monkeypatch.delenv(key)
    touched: list[str] = []
    seen: dict[str, Any] = {}

    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            seen["kwargs"], seen["touched"] = kwargs, list(touched)
            seen["environ"] = dict(os.environ)
            raise _Started

    fake_modules(monkeypatch, {
        "vllm": {"LLM": LLM, "SamplingParams": dict},
        "vllm.platforms": {"current_platform": SimpleNamespace(
            get_device_total_memory=lambda device_id=0: 80 * GIB, is_cpu=lambda: False)},
    })
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(touched))
    monkeypatch.setattr("vramgate.engine.spec.engine_tier", lambda: "gpu")
    monkeypatch.setattr(worker, "install_hooks", lambda: seen.setdefault("hooks", list(touched)))
    monkeypatch.setattr("vramgate.machine.probes.memory_history.start", lambda torch: torch.cuda.memory
                        ._record_memory_history())
    with pytest.raises(_Started):
        worker.run(spec, ROOT, tmp_path if tp > 1 else None)
    assert seen["touched"] == [], f"CUDA touched before vLLM started: {seen['touched']}"
    assert seen["kwargs"]["tensor_parallel_size"] == tp and seen["kwargs"]["gpu_memory_utilization"] == 0.9
    from vramgate.engine.vllm_plugin import MEMORY_HOOKS_ENV

    assert seen["environ"].get(MEMORY_HOOKS_ENV) == "1", "the ranks vLLM starts are not asked for the hooks"


@pytest.mark.parametrize(("tier", "eager", "off"), [("cpu", True, True), ("cpu", False, False), ("gpu", True, False)])
def test_dynamo_is_off_for_an_eager_cpu_engine(tier: str, eager: bool, off: bool, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [eager sampler helpers] in vramgate.engine.worker: an eager CPU engine runs vLLM's compiled sampler
    helpers as plain torch (Dynamo off before vLLM starts); a compiled CPU engine and a GPU engine keep Dynamo."""
    from vramgate.engine import worker

    spec = EngineSpec(model="tiny-llama", kv_budget_gib=0.25, requests=2, max_model_len=512,
                      max_num_batched_tokens=512, enforce_eager=eager)
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VRAMGATE_MEMORY_HOOKS"):
        monkeypatch.delenv(key, raising=False)  # restored after the test, whatever run() sets
    seen: dict[str, Any] = {}
    config = SimpleNamespace(disable=False)

    class LLM:
        def __init__(self, **kwargs: Any) -> None:
            seen["disable"] = config.disable
            raise _Started

    fake_modules(monkeypatch, {
        "vllm": {"LLM": LLM, "SamplingParams": dict},
        "vllm.platforms": {"current_platform": SimpleNamespace(
            get_device_total_memory=lambda device_id=0: 80 * GIB, is_cpu=lambda: tier == "cpu")},
    })
    touched: list[str] = []
    torch = _fake_torch(touched)
    torch.cuda.is_available = lambda: tier == "gpu"
    torch._dynamo = SimpleNamespace(config=config)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr("vramgate.engine.spec.engine_tier", lambda: tier)
    monkeypatch.setattr(worker, "install_hooks", lambda: None)
    with pytest.raises(_Started):
        worker.run(spec, ROOT)
    assert seen["disable"] is off


# -- The load's peak: the engine's own memory, as vLLM budgets it


@dataclass
class _Device:
    """One GPU as torch and vLLM read it: the allocator of the rank's process, and memory outside it (the rank's
    CUDA context and NCCL buffers, other processes)."""

    total: int = 80 * GIB
    reserved: int = 0
    peak_reserved: int = 0
    allocated: int = 0
    own_outside: int = 0
    others: int = 0
    log: list[str] = field(default_factory=list)

    @property
    def free(self) -> int:
        return self.total - self.reserved - self.own_outside - self.others


def _gpu_stand_ins(device: _Device, monkeypatch: pytest.MonkeyPatch) -> type:
    class MemorySnapshot:  # vllm.utils.mem_utils.MemorySnapshot, measured as vLLM measures it
        def __init__(self, device: Any = None, auto_measure: bool = True) -> None:
            self.device = device
            self.torch_peak = dev.allocated
            self.free_memory, self.total_memory = dev.free, dev.total
            self.cuda_memory = self.total_memory - self.free_memory
            self.torch_memory = dev.reserved
            self.non_torch_memory = self.cuda_memory - self.torch_memory

    dev = device
    cuda = SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, current_device=lambda: 0,
        mem_get_info=lambda d=None: (dev.free, dev.total), memory_reserved=lambda d=None: dev.reserved,
        max_memory_reserved=lambda d=None: dev.peak_reserved, memory_allocated=lambda d=None: dev.allocated,
        max_memory_allocated=lambda d=None: dev.allocated)
    fake_modules(monkeypatch, {"torch": {"cuda": cuda}, "vllm.utils.mem_utils": {"MemorySnapshot": MemorySnapshot}})
    return MemorySnapshot


def _load_peak(others: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """A rank's peak after a load: 1 GiB of CUDA context and NCCL before vLLM's init snapshot, then weights, profile
    run, KV cache and graphs (62 GiB at the allocator's peak, 60 GiB held after) and 512 MiB more outside torch."""
    dev = _Device(own_outside=GIB, others=others)
    snapshot_cls = _gpu_stand_ins(dev, monkeypatch)
    init = snapshot_cls(device="cuda:0")  # Worker.init_device: after NCCL, before the weights
    dev.reserved, dev.peak_reserved, dev.allocated = 60 * GIB, 62 * GIB, 59 * GIB
    dev.own_outside += GIB // 2
    worker = SimpleNamespace(init_snapshot=init, device="cuda:0", requested_memory=72 * GIB)
    return md.worker_load_peak(worker)


def test_the_load_peak_is_the_engines_own_memory_since_vllms_init_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's budget (``requested_memory``) covers what the engine takes after its init snapshot: the CUDA context,
    NCCL's buffers and other processes' memory are outside it, and so outside the load's peak; a device that also
    holds another process's 2 GiB reads the same fraction."""
    alone = _load_peak(0, monkeypatch)
    shared = _load_peak(2 * GIB, monkeypatch)
    assert alone == shared == 62 * GIB + GIB // 2
    cache = SimpleNamespace(gpu_memory_utilization=0.9, num_gpu_blocks=1000, kv_cache_size_tokens=16000,
                            kv_cache_max_concurrency=7.8125)
    rank = _rank(72 * GIB, 60 * GIB, 8 * GIB)
    d = md.decide(SimpleNamespace(available_gpu_memory_for_kv_cache=60 * GIB), cache,
                  SimpleNamespace(max_model_len=2048), [rank], shared)
    assert d.load_peak_fraction == pytest.approx(62.5 / 72)
