"""What vLLM decided about memory when it sized the KV cache itself: :class:`MemoryDecision`, read from vLLM's
own objects in the engine worker, on both tiers.

Note [automatic KV]: an engine spec without a KV budget (``kv_budget_gib = None``, a serving configuration of
the matrix) passes no ``kv_cache_memory_bytes``, so vLLM 0.32.0 sizes the KV cache as it does for a serving team:

* GPU (``v1/worker/gpu_worker.py`` ``determine_available_memory``): ``requested_memory`` (the device's total
  x ``gpu_memory_utilization``) minus what its memory profiling found the engine to need
  (``memory_profiling``'s ``non_kv_cache_memory = total_consumed + transient_peak_headroom``: the device's free
  memory lost between the worker's first snapshot and the end of the profile run, whatever took it (weights,
  CUDA context, NCCL, what torch still holds), plus the profile run's torch peak above what torch still holds
  at its end) minus the CUDA-graph estimate (``profile_cudagraph_memory``) when
  ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` applies it (an eager engine estimates 0: nothing applied). The
  profiling result's ``weights_memory``, ``torch_peak_increase`` and ``non_torch_increase`` are kept too, but
  the sum is not made of them. After the KV cache, ``compile_or_warm_up_model`` captures the graphs: the model
  runner's ``capture_model()`` returns the pool's real size. On CUDA the worker builds the V2 runner
  (``v1/worker/gpu/model_runner.py``) unless ``VLLM_USE_V2_MODEL_RUNNER=0``, Triton is missing or the config
  needs V1 (``VllmConfig.use_v2_model_runner``); the V2 estimate runs the same ``capture_model`` once before,
  with ``profile_only=True``, into a throwaway pool.
* CPU (``v1/worker/cpu_worker.py``): ``requested_cpu_memory`` (the NUMA node's total x the same
  ``gpu_memory_utilization``) minus the worker's RSS after its warm-up (``warming_up_model``). The gate splits that
  RSS, as vLLM leaves ``determine_available_memory``, into the worker's own memory and its file-backed pages (Note
  [file-backed RSS]).

Both end in the engine core's ``available_gpu_memory_for_kv_cache`` and the cache config's
``num_gpu_blocks``, ``kv_cache_size_tokens`` and ``kv_cache_max_concurrency``: those are read after start-up,
and the worker's own attributes through ``collective_rpc`` (:func:`worker_memory_decision`). Two figures vLLM
keeps only in locals are caught as vLLM returns them: the profiling result (``memory_profiling`` in
``gpu_worker``'s namespace) and the graph pool (``GPUModelRunner.capture_model`` of both runners, the real
capture only), by :func:`install_hooks` before the engine starts. ``tests/test_vllm_memory_contracts.py`` pins
every name read here, and what vLLM does with it, against the source of vLLM 0.31.0, 0.32.0 and 0.33.0.

With tensor parallelism each rank finds its own KV memory and vLLM gives every rank the smallest (Note [the
smallest rank decides] in :func:`decide`); the hooks reach every rank's process through the gate's vLLM plugin
(Note [hooks in every rank] in :mod:`vramgate.engine.vllm_plugin`). The load's peak (:func:`worker_load_peak`) counts
what vLLM's budget counts: on GPU what the engine took since its init snapshot, not the CUDA context before it.

On CPU the team's utilization is a fraction of the machine's memory, which differs between machines of one
hardware key; a serving configuration gives the requested memory in bytes (``cpu_memory``) and the worker turns
it into the fraction of this node (:func:`cpu_utilization`), so the figures compare across such machines.

Note [file-backed RSS]: the RSS vLLM's CPU worker subtracts counts the pages of torch's and vLLM's libraries the
worker has mapped, and how many of those are resident after the same imports and warm-up depends on the page cache,
not on the engine: after the library files were read or written whole (an install, a copy) a page fault maps more of
them (likely the page cache's larger folios) than after they were faulted in page by page. The anonymous memory does
not move. So a KV cache size that vLLM derives from that RSS moves with the machine's history, and the
serving-capacity suite judges the part that does not: the non-KV memory less its file-backed pages
(:attr:`MemoryDecision.non_kv_own_bytes`), with the file-backed pages and the KV cache vLLM gave recorded beside it.
The file-backed part is read from ``/proc/self/status`` (``RssFile``) as the worker leaves
``determine_available_memory``, milliseconds after vLLM's reading (:func:`install_hooks`). What a fresh and a
settled environment read on one box: docs/serving.md, "The page cache moves vLLM's CPU KV cache".

Nothing here imports vLLM at module level; the functions that run inside vLLM's workers import what they read.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vramgate.core.records import record_fields

#: The profiling result's fields a decision keeps (``vllm.utils.mem_utils.MemoryProfilingResult``):
#: ``non_kv_cache_memory`` and the two terms it is the sum of, then the breakdown vLLM logs.
PROFILE_FIELDS = ("non_kv_cache_memory", "total_consumed", "transient_peak_headroom", "weights_memory",
                  "torch_peak_increase", "non_torch_increase")
#: The modules of the model runners vLLM's CUDA worker builds (V2, its default, and V1), whose ``capture_model``
#: :func:`install_hooks` hooks where the module exists.
RUNNER_MODULES = ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner")


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
    """What the KV cache was given: the engine core's ``available_gpu_memory_for_kv_cache``, with tensor parallelism
    the smallest rank's (Note [the smallest rank decides] in :func:`decide`)."""
    num_blocks: int
    capacity_tokens: int
    """``kv_cache_size_tokens``: the tokens the KV cache holds."""
    max_concurrency: float
    """``kv_cache_max_concurrency``: requests of ``max_model_len`` tokens the KV cache holds at once."""
    max_model_len: int
    non_kv_bytes: int
    """``requested - available``: on CPU the worker's RSS after warm-up; on GPU vLLM's ``non_kv_cache_memory``
    (:attr:`total_consumed_bytes` + :attr:`transient_peak_headroom_bytes`, Note [automatic KV]) plus the
    CUDA-graph estimate where applied (and a multimodal model's frontend reservation)."""
    total_consumed_bytes: int | None = None
    """GPU: the device's free memory lost from the worker's first snapshot to the end of the profile run."""
    transient_peak_headroom_bytes: int | None = None
    """GPU: the profile run's torch peak above what torch still held at its end."""
    weights_bytes: int | None = None
    """GPU: the profiling breakdown (``weights_memory``, ``torch_peak_increase``, ``non_torch_increase``), kept as
    vLLM logs it; ``non_kv_bytes`` is not their sum."""
    torch_peak_increase_bytes: int | None = None
    non_torch_increase_bytes: int | None = None
    cudagraph_estimate_bytes: int | None = None
    cudagraph_estimate_applied: bool | None = None
    """Whether vLLM took the estimate from the KV cache: the flag on and an estimate above 0."""
    cudagraph_bytes: int | None = None
    """The CUDA graph pool after capture (``capture_model``'s result); None where no graphs were captured."""
    rss_file_bytes: int | None = None
    """CPU: the file-backed part of the worker's RSS as vLLM read it (Note [file-backed RSS]); None on a GPU."""
    load_peak_bytes: int | None = None
    """The peak during the run's load of the engine's memory as vLLM's budget counts it (:func:`worker_load_peak`),
    the highest rank's: on CPU the engine process's peak RSS; on GPU what the engine took since vLLM's init snapshot,
    without the CUDA context, NCCL's buffers and what other processes held then."""

    @property
    def cudagraph_estimate_error(self) -> float | None:
        """(estimate - real pool) / real pool, when both are known and the pool is not empty."""
        if not self.cudagraph_bytes or self.cudagraph_estimate_bytes is None:
            return None
        return (self.cudagraph_estimate_bytes - self.cudagraph_bytes) / self.cudagraph_bytes

    @property
    def non_kv_own_bytes(self) -> int | None:
        """CPU: the non-KV memory less its file-backed pages: the worker's own memory, which the page cache's state
        does not move (Note [file-backed RSS]); None where the split was not read (a GPU)."""
        return None if self.rss_file_bytes is None else self.non_kv_bytes - self.rss_file_bytes

    @property
    def load_peak_fraction(self) -> float | None:
        """The load's peak as a fraction of the requested memory (above 1: past what the team gave vLLM; on CPU a
        healthy engine reads a little above 1, by what its process grows after the warm-up vLLM measured)."""
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
    (the runner's ``_vramgate_cudagraph_bytes``), on both model runners (:data:`RUNNER_MODULES`, those that exist):
    the worker builds one of them. Only the real capture is kept: the V2 runner's estimate runs the same method
    with ``profile_only=True`` into a throwaway pool. On CPU: the file-backed part of the RSS the worker sized the
    KV cache from (``_vramgate_rss_file_bytes``, Note [file-backed RSS]). Idempotent."""
    import importlib

    import torch

    if not torch.cuda.is_available():
        _hook_cpu_worker()
        return
    from vllm.v1.worker import gpu_worker

    if not getattr(gpu_worker, "_vramgate_hooked", False):
        profiling = gpu_worker.memory_profiling

        @contextlib.contextmanager
        def memory_profiling(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with profiling(*args, **kwargs) as result:
                gpu_worker._vramgate_last_profile = result
                yield result

        gpu_worker.memory_profiling = memory_profiling
        gpu_worker._vramgate_hooked = True
    for name in RUNNER_MODULES:
        try:
            runner = importlib.import_module(name).GPUModelRunner
        except (ImportError, AttributeError):  # a release without this runner
            continue
        if not vars(runner).get("_vramgate_hooked", False):
            runner.capture_model = _recording_capture(runner.capture_model)
            runner._vramgate_hooked = True


def _hook_cpu_worker() -> None:
    """Keep on vLLM's CPU worker the file-backed part of its RSS as ``determine_available_memory`` returns (Note
    [file-backed RSS])."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    from vramgate.machine.probes.cpu import file_rss_bytes

    if vars(CPUWorker).get("_vramgate_hooked", False):
        return
    determine = CPUWorker.determine_available_memory

    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        available = determine(self, *args, **kwargs)
        self._vramgate_rss_file_bytes = file_rss_bytes()
        return available

    CPUWorker.determine_available_memory = determine_available_memory
    CPUWorker._vramgate_hooked = True


def _recording_capture(capture: Any) -> Any:
    """*capture* (a runner's ``capture_model``), keeping on the runner the pool its real capture returns."""

    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        size = capture(self, *args, **kwargs)
        if not kwargs.get("profile_only", False):  # the estimate's capture, into a throwaway pool, is no pool
            self._vramgate_cudagraph_bytes = size
        return size

    return capture_model


def worker_memory_decision(worker: Any) -> dict[str, Any]:
    """This rank's side of the decision, read inside the model worker: requested and total memory and, on GPU,
    the profiling breakdown, the CUDA-graph estimate and whether it was applied, and the captured pool."""
    import torch

    if not torch.cuda.is_available():  # the node's memory: what the requested memory is the fraction of (decide)
        return {"tier": "cpu", "requested_bytes": int(worker.requested_cpu_memory),
                "rss_file_bytes": getattr(worker, "_vramgate_rss_file_bytes", None)}
    from vllm import envs
    from vllm.v1.worker import gpu_worker

    profile = getattr(gpu_worker, "_vramgate_last_profile", None)
    estimate = getattr(worker, "cudagraph_memory_estimate", None)
    figures: dict[str, Any] = {
        "tier": "gpu", "requested_bytes": int(worker.requested_memory),
        "total_bytes": int(worker.init_snapshot.total_memory),
        # this rank's KV memory: the smallest rank's is every rank's (Note [the smallest rank decides] in decide)
        "available_kv_bytes": getattr(worker, "available_kv_cache_memory_bytes", None),
        "cudagraph_estimate_bytes": estimate,
        # vLLM subtracts ``estimate if flag else 0``: an eager engine's estimate of 0 is no estimate applied
        "cudagraph_estimate_applied": bool(envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS) and (estimate or 0) > 0,
        "cudagraph_bytes": getattr(worker.model_runner, "_vramgate_cudagraph_bytes", None),  # V1's or V2's
    }
    for name in PROFILE_FIELDS:
        figures[name] = None if profile is None else int(getattr(profile, name))
    return figures


def worker_load_peak(worker: Any) -> int:
    """This rank's peak memory during the load, read inside the model worker after it, counted as vLLM's budget
    (``requested_memory`` / ``requested_cpu_memory``) counts it, so that the peak over the requested memory reads 1
    where the engine used all it was given:

    * GPU: what the engine took since vLLM's init snapshot (``Worker.init_device`` takes it after the CUDA context
      and NCCL's buffers, before the weights, and budgets what comes after it): the device's use now less at the
      snapshot, plus how far the allocator's reservation peaked above what it holds now; ``memory_profiling``
      counts the non-KV memory the same way (the free memory lost since the snapshot, plus the torch peak above what
      is held). Left out: the rank's CUDA context and NCCL's buffers, and what other processes held at the snapshot
      (another engine, the gate's own CUDA context); memory another process takes during the run is not, as it is
      not in vLLM's figure either (both read the device's free memory). Read with vLLM's own ``MemorySnapshot``.
    * CPU: the process's peak RSS since the load began (:func:`reset_cpu_peak`, called as it begins; the whole
      life's where the kernel cannot reset it), which vLLM's CPU budget counts whole (requested minus the RSS after
      warm-up): above 1 by what the process grew after the warm-up vLLM measured."""
    import torch

    if not torch.cuda.is_available():
        from vramgate.machine.probes.cpu import peak_rss_bytes

        return peak_rss_bytes()
    from vllm.utils.mem_utils import MemorySnapshot

    start, now = worker.init_snapshot, MemorySnapshot(device=worker.device)
    held_above = int(torch.cuda.max_memory_reserved(worker.device)) - int(now.torch_memory)
    return max(0, int(now.cuda_memory) - int(start.cuda_memory) + max(0, held_above))


def worker_reset_peak(worker: Any) -> bool:
    """Reset this rank's peak resident memory to what it holds now, so that :func:`worker_load_peak` reads the
    peak of what follows: the load's, not the import's, the model's load or the warm-up's transients (Note [full KV
    cache] in suites/profile_capacity). False where the kernel refuses (``reset_peak_rss`` of the CPU probes)."""
    from vramgate.machine.probes.cpu import reset_peak_rss

    return reset_peak_rss()


def decide(core: Any, cache: Any, model_config: Any, ranks: Sequence[Mapping[str, Any]],
           load_peak: int | None) -> MemoryDecision:
    """The decision from the engine core (*core*), vLLM's cache config (*cache*), its model config and every rank's
    side (:func:`worker_memory_decision`, in rank order), with the load's peak when measured.

    Note [the smallest rank decides]: each tensor-parallel rank finds its own KV memory, and vLLM gives every rank
    the KV cache of the one with the least (``get_kv_cache_configs`` cuts every rank's blocks to the smallest
    count), while the engine core keeps rank 0's figure (``available_gpu_memory_for_kv_cache`` is
    ``available_gpu_memory[0]``, one number). The decision is the limiting rank's: its KV memory, its requested
    memory and its breakdown. A GPU rank reports its ``available_kv_cache_memory_bytes``, which differs from what it
    returned to the core by a reservation the same on every rank (``reserve_mm_ipc_gpu_memory``: multimodal IPC
    memory, none for a text model), so the core's figure moves by the ranks' difference; a CPU rank keeps no such
    figure, and the core's (rank 0's) stands."""
    if not ranks:
        raise ValueError("no rank's figures to decide from")
    available = int(core.available_gpu_memory_for_kv_cache)
    rank = ranks[0]
    reported = [a for a in (r.get("available_kv_bytes") for r in ranks) if isinstance(a, int)]
    if len(reported) == len(ranks):
        limiting = min(range(len(ranks)), key=reported.__getitem__)  # the first of equals: rank 0 where all are
        available -= reported[0] - reported[limiting]
        rank = ranks[limiting]
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
        non_kv_bytes=requested - available, total_consumed_bytes=rank.get("total_consumed"),
        transient_peak_headroom_bytes=rank.get("transient_peak_headroom"), weights_bytes=rank.get("weights_memory"),
        torch_peak_increase_bytes=rank.get("torch_peak_increase"),
        non_torch_increase_bytes=rank.get("non_torch_increase"),
        cudagraph_estimate_bytes=rank.get("cudagraph_estimate_bytes"),
        cudagraph_estimate_applied=rank.get("cudagraph_estimate_applied"),
        cudagraph_bytes=rank.get("cudagraph_bytes"), rss_file_bytes=rank.get("rss_file_bytes"),
        load_peak_bytes=load_peak,
    )
