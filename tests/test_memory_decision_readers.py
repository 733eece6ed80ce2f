"""What the readers that run inside vLLM's model workers find, on stand-ins for torch and vLLM's modules shaped as
tests/test_vllm_memory_contracts.py pins them: the CUDA-graph pool of whichever model runner the worker built
(Note [automatic KV] in vramgate.engine.memory_decision), the estimate's applied flag of an eager engine, and the
fusion passes after vLLM froze the worker's heap (Note [fusion pass state] in vramgate.engine.measure)."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from module_fakes import fake_modules

GIB = 1 << 30


def fake_vllm(monkeypatch: pytest.MonkeyPatch, runners: dict[str, type],
              estimate_flag: bool = True) -> types.ModuleType:
    """Stand-ins for torch (CUDA present) and the vLLM modules the GPU readers import; *runners* maps the runner
    modules that exist (``vllm.v1.worker.gpu_model_runner``, ``vllm.v1.worker.gpu.model_runner``) to their
    ``GPUModelRunner``. The fake ``gpu_worker`` module."""
    import contextlib

    @contextlib.contextmanager
    def memory_profiling(snapshot: object, weights_memory: int = 0) -> Iterator[Any]:
        yield SimpleNamespace(weights_memory=weights_memory, torch_peak_increase=0, non_torch_increase=0,
                              total_consumed=0, transient_peak_headroom=0, non_kv_cache_memory=0)

    for name in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu", "vllm.v1.worker.gpu.model_runner"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    modules = fake_modules(monkeypatch, {
        "torch": {"cuda": SimpleNamespace(is_available=lambda: True)},
        "vllm": {"envs": SimpleNamespace(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=estimate_flag)},
        "vllm.v1.worker.gpu_worker": {"memory_profiling": memory_profiling},
        **{name: {"GPUModelRunner": runner} for name, runner in runners.items()},
    })
    gpu_worker = modules["vllm.v1.worker.gpu_worker"]
    return gpu_worker


def test_the_v2_runner_alone_is_hooked_and_only_its_real_capture_is_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32.0 builds ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` on CUDA by default; the hooks need no
    V1 runner module, and the capture ``profile_cudagraph_memory`` runs (``profile_only=True``) is not the pool."""
    from vramgate.engine import memory_decision as md

    class GPUModelRunner:
        def capture_model(self, *, profile_only: bool = False) -> int:
            return GIB // 4 if profile_only else GIB

    fake_vllm(monkeypatch, {"vllm.v1.worker.gpu.model_runner": GPUModelRunner})
    md.install_hooks()
    runner = GPUModelRunner()
    worker = SimpleNamespace(requested_memory=72 * GIB, init_snapshot=SimpleNamespace(total_memory=80 * GIB),
                             cudagraph_memory_estimate=GIB, model_runner=runner)
    assert runner.capture_model(profile_only=True) == GIB // 4
    assert md.worker_memory_decision(worker)["cudagraph_bytes"] is None
    assert runner.capture_model() == GIB
    assert md.worker_memory_decision(worker)["cudagraph_bytes"] == GIB
    assert runner.capture_model(profile_only=True) == GIB // 4  # a later estimate leaves the real pool alone
    assert md.worker_memory_decision(worker)["cudagraph_bytes"] == GIB


def test_the_v1_runner_is_hooked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``VLLM_USE_V2_MODEL_RUNNER=0`` (or a config V2 does not support) builds the V1 runner, whose
    ``capture_model`` takes no argument."""
    from vramgate.engine import memory_decision as md

    class V1Runner:
        def capture_model(self) -> int:
            return 3 * GIB

    class V2Runner:
        def capture_model(self, *, profile_only: bool = False) -> int:
            raise AssertionError("not built")

    fake_vllm(monkeypatch, {"vllm.v1.worker.gpu_model_runner": V1Runner, "vllm.v1.worker.gpu.model_runner": V2Runner})
    md.install_hooks()
    md.install_hooks()  # idempotent: one wrapper, not two
    runner = V1Runner()
    assert runner.capture_model() == 3 * GIB
    worker = SimpleNamespace(requested_memory=72 * GIB, init_snapshot=SimpleNamespace(total_memory=80 * GIB),
                             cudagraph_memory_estimate=0, model_runner=runner)
    assert md.worker_memory_decision(worker)["cudagraph_bytes"] == 3 * GIB


@pytest.mark.parametrize("flag", [True, False])
def test_an_eager_engine_applies_no_graph_estimate(monkeypatch: pytest.MonkeyPatch, flag: bool) -> None:
    """An eager engine (``cudagraph_mode`` NONE) estimates 0 bytes for graphs: vLLM subtracts nothing, whatever
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` says, so the decision must not read "estimate applied"."""
    from vramgate.engine import memory_decision as md

    fake_vllm(monkeypatch, {}, estimate_flag=flag)
    worker = SimpleNamespace(requested_memory=72 * GIB, init_snapshot=SimpleNamespace(total_memory=80 * GIB),
                             cudagraph_memory_estimate=0, model_runner=SimpleNamespace())
    rank = md.worker_memory_decision(worker)
    assert rank["cudagraph_estimate_bytes"] == 0
    assert rank["cudagraph_estimate_applied"] is False
    assert rank["cudagraph_bytes"] is None
    worker.cudagraph_memory_estimate = GIB
    assert md.worker_memory_decision(worker)["cudagraph_estimate_applied"] is flag


class AllReduceFusionPass:  # the name vLLM's pass has: the reading finds passes by class name
    def __init__(self, disabled: bool, matched: int | None = None) -> None:
        self.disabled = disabled
        if matched is not None:
            self.matched_count = matched


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """A heap frozen as vLLM's ``freeze_gc_heap()`` leaves it at the end of ``compile_or_warm_up_model``; the
    collector's state is restored afterwards."""
    if gc.get_freeze_count():
        pytest.skip("the heap is already frozen: the test cannot restore it")
    enabled = gc.isenabled()
    try:
        yield
    finally:
        gc.unfreeze()
        (gc.enable if enabled else gc.disable)()
        gc.collect()  # what the test froze and left


def test_a_fusion_pass_in_a_frozen_heap_is_found(frozen_heap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM freezes the worker's heap (``gc.freeze()``) after warm-up, and ``gc.get_objects()`` does not return
    frozen objects: the passes made during compilation must be found all the same, and the heap stays frozen."""
    from vramgate.engine.measure import FUSION_MODULE, worker_fusion_passes

    monkeypatch.setitem(sys.modules, FUSION_MODULE, types.SimpleNamespace(flashinfer_comm=object()))
    on = AllReduceFusionPass(disabled=False, matched=12)
    gc.collect()
    gc.freeze()
    assert not any(obj is on for obj in gc.get_objects())  # what vLLM's freeze does to the plain reading
    frozen = gc.get_freeze_count()
    state = worker_fusion_passes(None)
    assert state == {"passes": {"AllReduceFusionPass": {"instances": 1, "enabled": True, "matched": 12}},
                     "flashinfer_comm": True}
    assert gc.get_freeze_count() >= frozen and gc.isenabled()
    assert not any(obj is on for obj in gc.get_objects())  # still frozen
    del on


def test_reading_a_frozen_heap_runs_no_collection(frozen_heap: None) -> None:
    """The heap is unfrozen only to be read: no collection runs meanwhile (nothing of vLLM's is finalized by the
    reading), and a collector that vLLM left disabled stays so."""
    from vramgate.engine.measure import worker_fusion_passes

    gc.collect()
    gc.freeze()
    gc.disable()
    collections: list[str] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        collections.append(phase)

    gc.callbacks.append(callback)
    try:
        garbage = [SimpleNamespace() for _ in range(3000)]  # past generation 0's threshold
        for item in garbage:
            item.self = item  # cycles: only a collection frees them
        del garbage
        worker_fusion_passes(None)
    finally:
        gc.callbacks.remove(callback)
    assert collections == [] and not gc.isenabled() and gc.get_freeze_count() > 0


def test_the_cpu_worker_keeps_the_file_backed_part_of_the_rss_it_sized_the_kv_cache_from(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [file-backed RSS]: on CPU the hooks wrap ``CPUWorker.determine_available_memory`` (once), which returns
    what vLLM gave the KV cache unchanged and leaves the worker's ``RssFile`` as the method returns; the rank's side
    of the decision carries it, and the decision's own non-KV memory is the rest."""
    from vramgate.engine import memory_decision as md
    from vramgate.machine.probes import cpu

    class CPUWorker:
        requested_cpu_memory = 2 * GIB

        def determine_available_memory(self) -> int:
            return GIB + GIB // 4

    fake_modules(monkeypatch, {"torch": {"cuda": SimpleNamespace(is_available=lambda: False)},
                               "vllm.v1.worker.cpu_worker": {"CPUWorker": CPUWorker}})
    monkeypatch.setattr(cpu, "file_rss_bytes", lambda pid=None: 200 << 20)
    md.install_hooks()
    md.install_hooks()  # idempotent: one wrapper, not two
    worker = CPUWorker()
    assert md.worker_memory_decision(worker)["rss_file_bytes"] is None  # not sized yet
    assert worker.determine_available_memory() == GIB + GIB // 4
    rank = md.worker_memory_decision(worker)
    assert rank == {"tier": "cpu", "requested_bytes": 2 * GIB, "rss_file_bytes": 200 << 20}
    core = SimpleNamespace(available_gpu_memory_for_kv_cache=GIB + GIB // 4)
    cache = SimpleNamespace(gpu_memory_utilization=0.085, num_gpu_blocks=100, kv_cache_size_tokens=3200,
                            kv_cache_max_concurrency=1.5)
    decision = md.decide(core, cache, SimpleNamespace(max_model_len=2048), [rank], None)
    assert decision.non_kv_bytes == 3 * GIB // 4 and decision.non_kv_own_bytes == 3 * GIB // 4 - (200 << 20)
    assert md.MemoryDecision.from_json(decision.to_json()) == decision


def test_the_file_backed_rss_is_this_processs_mapped_files() -> None:
    """``RssFile``: more than nothing (the interpreter's own mapped files), less than the whole resident set."""
    from vramgate.machine.probes.cpu import file_rss_bytes, rss_bytes

    assert 0 < file_rss_bytes() < rss_bytes()
