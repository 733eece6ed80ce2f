"""What an engine run measured, as typed records: its KV cache, memory, scheduler and latency figures.

The engine worker (:mod:`vramgate.engine.worker`) writes them as the JSON objects of its result; the runner reads
them back into these records (each field checked, unknown ones left out), so a suite reads ``result.kv.page_bytes``
where a type checker sees it, not a string key. Where each figure comes from is the worker's to say.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from vramgate.core.records import record_fields

_T = TypeVar("_T")


def _record(cls: type[_T], data: object, where: str) -> _T:
    return cls(**record_fields(cls, data, where, TypeError, ignore_unknown=True))


@dataclass(frozen=True)
class KVFigures:
    """The KV cache vLLM allocated (its ``CacheConfig`` and KV cache config)."""

    block_size: int
    num_gpu_blocks: int
    usable_blocks: int
    """Blocks a request can use: all but vLLM's null block."""
    capacity_tokens: int
    """vLLM's ``kv_cache_size_tokens``."""
    num_layers: int
    page_bytes: int
    """One block of one layer (the first KV cache group's); 0 for a model without a KV cache."""
    bytes_per_token: int
    """All layers, per token; 0 for a model without a KV cache."""
    budget_bytes: int | None = None
    """The ``kv_cache_memory_bytes`` the engine was given; None where vLLM sized the cache itself."""
    groups: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: object, where: str = "kv") -> KVFigures:
        """The figures in *data*; ``TypeError`` naming what is missing."""
        return _record(cls, data, where)


@dataclass(frozen=True)
class MemoryFigures:
    """The engine's memory: its process's peak RSS, the model's and the KV tensors' bytes, per rank, and the CUDA
    allocator's figures of rank 0 (Note [allocator peak] in :mod:`vramgate.engine.measure`)."""

    peak_rss_bytes: int
    weights_bytes: int
    parameter_bytes: int
    kv_tensor_bytes: int
    vllm_model_memory_usage: int | None = None
    """vLLM's own loading figure (GPU tier)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Each tensor-parallel rank's figures (weights, KV tensors, allocator), in rank order."""
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    cuda_allocated_bytes: int | None = None
    memory_history: list[str] | None = None
    """The allocator histories the ranks dumped (Note [memory history]), None where none was recorded."""

    @classmethod
    def from_json(cls, data: object, where: str = "memory") -> MemoryFigures:
        """The figures in *data*; ``TypeError`` naming what is missing."""
        return _record(cls, data, where)


@dataclass(frozen=True)
class SchedulerFigures:
    """What vLLM's scheduler did, as the gate's probe watched it (:class:`vramgate.sim.SchedulerProbe`)."""

    steps: int
    peak_blocks_in_use: int
    preemptions: int
    recomputed_tokens: int
    preemptions_by_request: int = 0
    """The preemptions vLLM's per-request metrics count (the probe's, counted another way)."""
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    cached_prompt_tokens: int = 0
    internal_waste_mean: float = 0.0
    internal_waste_max: float = 0.0
    chunked_prefill: bool = True
    prefix_caching: bool = False
    async_scheduling: bool = False

    @classmethod
    def from_json(cls, data: object, where: str = "scheduler") -> SchedulerFigures:
        """The figures in *data*; ``TypeError`` naming what is missing."""
        return _record(cls, data, where)


@dataclass(frozen=True)
class LatencyFigures:
    """Per-request latencies from vLLM's request metrics, their percentiles and the run's throughput."""

    ttft_s: list[float]
    tpot_s: list[float]
    e2e_s: list[float]
    output_lens: list[int]
    queue_s: list[float] = field(default_factory=list)
    ttft: dict[str, float] = field(default_factory=dict)
    tpot: dict[str, float] = field(default_factory=dict)
    e2e: dict[str, float] = field(default_factory=dict)
    output_tokens: int = 0
    prompt_tokens: int = 0
    output_throughput_tokens_per_s: float = 0.0

    @classmethod
    def from_json(cls, data: object, where: str = "latency") -> LatencyFigures:
        """The figures in *data*; ``TypeError`` naming what is missing."""
        return _record(cls, data, where)
