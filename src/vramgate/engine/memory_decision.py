"""What vLLM decided about memory when it sized the KV cache itself: :class:`MemoryDecision`, read from vLLM's
own objects in the engine worker, on both tiers.

Note [automatic KV]: an engine spec without a KV budget (``kv_budget_gib = None``, a serving configuration of
the matrix) passes no ``kv_cache_memory_bytes``, so vLLM 0.32.0 sizes the KV cache as it does for a serving team:

* GPU (``v1/worker/gpu_worker.py`` ``determine_available_memory``): ``requested_memory`` (the device's total
  x ``gpu_memory_utilization``) minus what its memory profiling found the profile run to need
  (``memory_profiling``'s ``non_kv_cache_memory``: weights, the torch peak increase, non-torch memory) minus
  the CUDA-graph estimate (``profile_cudagraph_memory``) when ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``
  applies it; after the KV cache, ``compile_or_warm_up_model`` captures the graphs (``capture_model``
  returns the pool's real size).
* CPU (``v1/worker/cpu_worker.py``): ``requested_cpu_memory`` (the NUMA node's total x the same
  ``gpu_memory_utilization``) minus the worker's RSS after its warm-up (``warming_up_model``).

Both end in the engine core's ``available_gpu_memory_for_kv_cache`` and the cache config's
``num_gpu_blocks``, ``kv_cache_size_tokens`` and ``kv_cache_max_concurrency``: those are read after start-up,
and the worker's own attributes through ``collective_rpc`` (:func:`worker_memory_decision`). Two figures vLLM
keeps only in locals are caught as vLLM returns them: the profiling result (``memory_profiling`` in
``gpu_worker``'s namespace) and the graph pool (``GPUModelRunner.capture_model``), by :func:`install_hooks`
before the engine starts. ``tests/test_vllm_memory_contracts.py`` pins every name read here against the source of
vLLM 0.31.0, 0.32.0 and 0.33.0.

On CPU the team's utilization is a fraction of the machine's memory, which differs between machines of one
hardware key; a serving configuration gives the requested memory in bytes (``cpu_memory``) and the worker turns
it into the fraction of this node (:func:`cpu_utilization`), so the figures compare across such machines.

Nothing here imports vLLM at module level; the functions that run inside vLLM's workers import what they read.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vramgate.core.records import record_fields

#: The profiling result's fields a decision keeps (``vllm.utils.mem_utils.MemoryProfilingResult``).
PROFILE_FIELDS = ("weights_memory", "torch_peak_increase", "non_torch_increase", "non_kv_cache_memory")


@dataclass(frozen=True)
class MemoryDecision:
    """The KV cache vLLM gave itself at a ``gpu_memory_utilization``, and what it kept back (bytes throughout)."""

    tier: str
    """``cpu`` or ``gpu``: which of vLLM's two paths decided (Note [automatic KV])."""
    gpu_memory_utilization: float
    total_bytes: int
    """The device's memory (GPU) or the NUMA node's (CPU) that the utilization is a fraction of."""
    requested_bytes: int
    """vLLM's ``requested_memory`` / ``requested_cpu_memory``: utilization x total."""
    available_kv_bytes: int
    """The engine core's ``available_gpu_memory_for_kv_cache``: what the KV cache was given."""
    num_blocks: int
    capacity_tokens: int
    """``kv_cache_size_tokens``: the tokens the KV cache holds."""
    max_concurrency: float
    """``kv_cache_max_concurrency``: requests of ``max_model_len`` tokens the KV cache holds at once."""
    max_model_len: int
    non_kv_bytes: int
    """``requested - available``: on CPU the worker's RSS after warm-up, on GPU the profiled non-KV memory plus
    the CUDA-graph estimate where applied."""
    weights_bytes: int | None = None
    torch_peak_increase_bytes: int | None = None
    non_torch_increase_bytes: int | None = None
    cudagraph_estimate_bytes: int | None = None
    cudagraph_estimate_applied: bool | None = None
    cudagraph_bytes: int | None = None
    """The CUDA graph pool after capture (``capture_model``'s result); None where no graphs were captured."""
    load_peak_bytes: int | None = None
    """The peak during the run's load: the engine process's peak RSS on CPU, the device's peak use on GPU."""

    @property
    def cudagraph_estimate_error(self) -> float | None:
        """(estimate - real pool) / real pool, when both are known and the pool is not empty."""
        if not self.cudagraph_bytes or self.cudagraph_estimate_bytes is None:
            return None
        return (self.cudagraph_estimate_bytes - self.cudagraph_bytes) / self.cudagraph_bytes

    @property
    def load_peak_fraction(self) -> float | None:
        """The load's peak as a fraction of the requested memory (above 1: past what the team gave vLLM)."""
        return None if self.load_peak_bytes is None else self.load_peak_bytes / self.requested_bytes

    def utilization_for(self, kv_bytes: int) -> float:
        """The ``gpu_memory_utilization`` at which this engine's non-KV memory leaves *kv_bytes* for the KV cache
        (vLLM's advice for its CUDA-graph estimate, for the whole difference)."""
        return (kv_bytes + self.non_kv_bytes) / self.total_bytes

    def to_json(self) -> dict[str, Any]:
        """The decision as a JSON object (what :meth:`from_json` reads)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str = "memory decision") -> MemoryDecision:
        """The decision in *data*; ``TypeError`` naming *where* and the field when it is not one."""
        return cls(**record_fields(cls, data, where, TypeError))


def cpu_node_memory_bytes() -> int:
    """The memory of the NUMA node vLLM's CPU worker takes its fraction of (its first allowed CPU's node), read
    with vLLM's own functions (``vllm.utils.cpu_resource_utils``)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    return int(get_memory_node_info(get_allowed_cpu_list()[0].numa_node).total_memory)


def cpu_utilization(cpu_memory_bytes: int, node_bytes: int) -> float:
    """The ``gpu_memory_utilization`` that makes vLLM's CPU worker request *cpu_memory_bytes* of a node of
    *node_bytes* (Note [automatic KV]); ValueError when the node is smaller."""
    if not 0 < cpu_memory_bytes <= node_bytes:
        raise ValueError(f"the serving configuration requests {cpu_memory_bytes} B of CPU memory, but this NUMA node "
                         f"has {node_bytes} B: lower cpu_memory")
    return cpu_memory_bytes / node_bytes


def install_hooks() -> None:
    """Catch, on the GPU tier, the two figures vLLM keeps only in locals (Note [automatic KV]): each worker's
    memory profiling result (``gpu_worker._vramgate_last_profile``) and the CUDA graph pool ``capture_model`` returns
    (``_vramgate_cudagraph_bytes``). Idempotent; nothing on CPU, whose worker has neither."""
    import torch

    if not torch.cuda.is_available():
        return
    from vllm.v1.worker import gpu_model_runner, gpu_worker

    if getattr(gpu_worker, "_vramgate_hooked", False):
        return
    profiling = gpu_worker.memory_profiling

    @contextlib.contextmanager
    def memory_profiling(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with profiling(*args, **kwargs) as result:
            gpu_worker._vramgate_last_profile = result
            yield result

    capture = gpu_model_runner.GPUModelRunner.capture_model

    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        size = capture(self, *args, **kwargs)
        self._vramgate_cudagraph_bytes = size
        return size

    gpu_worker.memory_profiling = memory_profiling
    gpu_model_runner.GPUModelRunner.capture_model = capture_model
    gpu_worker._vramgate_hooked = True


def worker_memory_decision(worker: Any) -> dict[str, Any]:
    """This rank's side of the decision, read inside the model worker: requested and total memory and, on GPU,
    the profiling breakdown, the CUDA-graph estimate and whether it was applied, and the captured pool."""
    import torch

    if not torch.cuda.is_available():  # the node's memory: what the requested memory is the fraction of (decide)
        return {"tier": "cpu", "requested_bytes": int(worker.requested_cpu_memory)}
    from vllm import envs
    from vllm.v1.worker import gpu_worker

    profile = getattr(gpu_worker, "_vramgate_last_profile", None)
    figures: dict[str, Any] = {
        "tier": "gpu", "requested_bytes": int(worker.requested_memory),
        "total_bytes": int(worker.init_snapshot.total_memory),
        "cudagraph_estimate_bytes": getattr(worker, "cudagraph_memory_estimate", None),
        "cudagraph_estimate_applied": bool(envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS),
        "cudagraph_bytes": getattr(worker.model_runner, "_vramgate_cudagraph_bytes", None),
    }
    for name in PROFILE_FIELDS:
        figures[name] = None if profile is None else int(getattr(profile, name))
    return figures


def worker_load_peak(worker: Any) -> int:
    """This rank's peak memory during the load, read inside the model worker after it: on GPU the device's peak
    use (the allocator's peak reservation plus what the device holds outside the allocator now), on CPU the
    process's peak RSS."""
    import torch

    if not torch.cuda.is_available():
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    outside = (total - free) - torch.cuda.memory_reserved(device)
    return int(torch.cuda.max_memory_reserved(device) + max(0, outside))


def decide(core: Any, cache: Any, model_config: Any, rank: dict[str, Any], load_peak: int | None) -> MemoryDecision:
    """The decision from the engine core (*core*), vLLM's cache config (*cache*), its model config and rank 0's
    side (:func:`worker_memory_decision`), with the load's peak when measured."""
    available = int(core.available_gpu_memory_for_kv_cache)
    requested = int(rank["requested_bytes"])
    utilization = float(cache.gpu_memory_utilization)
    # GPU: the worker's own snapshot of the device; CPU: vLLM requested ceil(node x utilization), so the node's memory
    # as vLLM read it is requested / utilization (to a byte per 1 / utilization), not a second reading of it.
    total = int(rank["total_bytes"]) if rank.get("total_bytes") else round(requested / utilization)
    return MemoryDecision(
        tier=str(rank["tier"]), gpu_memory_utilization=utilization,
        total_bytes=total, requested_bytes=requested, available_kv_bytes=available,
        num_blocks=int(cache.num_gpu_blocks), capacity_tokens=int(cache.kv_cache_size_tokens),
        max_concurrency=float(cache.kv_cache_max_concurrency), max_model_len=int(model_config.max_model_len),
        non_kv_bytes=requested - available, weights_bytes=rank.get("weights_memory"),
        torch_peak_increase_bytes=rank.get("torch_peak_increase"),
        non_torch_increase_bytes=rank.get("non_torch_increase"),
        cudagraph_estimate_bytes=rank.get("cudagraph_estimate_bytes"),
        cudagraph_estimate_applied=rank.get("cudagraph_estimate_applied"),
        cudagraph_bytes=rank.get("cudagraph_bytes"), load_peak_bytes=load_peak,
    )
