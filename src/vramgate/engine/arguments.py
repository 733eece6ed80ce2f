"""The engine arguments of one run: the keyword arguments of ``vllm.LLM`` for an :class:`EngineSpec`, on
either tier, and the start-up ``gpu_memory_utilization`` a GPU engine asks for (Note [GPU utilization]).

Imports neither torch nor vLLM at import time: the gate's own tests check these arguments without an engine.
:func:`engine_kwargs`, called inside an engine's own process, reads there what only that process can.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramgate.engine.spec import EngineSpec, kv_budget_bytes

#: What a GPU engine needs next to its weights and KV cache (CUDA context, activations of the profile run,
#: CUDA graphs, NCCL), for the start-up check that ``gpu_memory_utilization`` drives (Note [GPU utilization]).
GPU_HEADROOM_BYTES = 4 << 30
#: vLLM's default fraction; the gate never asks for more.
GPU_UTILIZATION_MAX = 0.92


def gpu_utilization(kv_bytes: int, weights_bytes: int, device_total_bytes: int) -> float:
    """The ``gpu_memory_utilization`` a GPU engine with a fixed KV budget starts with.

    Note [GPU utilization]: with ``kv_cache_memory_bytes`` set, vLLM 0.32.0
    sizes the KV cache from it and uses ``gpu_memory_utilization`` for one
    thing only: at start it refuses to run unless ``total x utilization``
    bytes are free (``v1/worker/utils.request_memory``). Left at 0.92, two
    paired engines, or one engine on a GPU that something else uses, cannot
    start. So the gate asks for what the run needs: the KV budget, the bf16
    weights (an upper bound for a quantized checkpoint) and
    :data:`GPU_HEADROOM_BYTES`, as a fraction of the device, between 1% and
    :data:`GPU_UTILIZATION_MAX`.

    Every tensor-parallel rank makes this check on its own GPU, and holds
    its own share of the weights: *weights_bytes* is one rank's, the bf16
    weights divided by ``tensor_parallel_size`` (:func:`llm_kwargs`). That
    share is close, not exact: vLLM shards the attention and MLP
    projections over the ranks and the embedding and LM head by vocab too
    (padded), but keeps the norms (a few KiB a layer) whole on every rank,
    and the K/V projections where the ranks outnumber the KV heads. The KV
    budget (``kv_cache_memory_bytes``) is already per rank, and so is the
    headroom.
    """
    if device_total_bytes <= 0:
        raise ValueError(f"device memory must be positive, got {device_total_bytes}")
    need = kv_bytes + weights_bytes + GPU_HEADROOM_BYTES
    return round(min(GPU_UTILIZATION_MAX, max(0.01, need / device_total_bytes)), 4)


def llm_kwargs(spec: EngineSpec, model_dir: Path, device_total_bytes: int | None = None,
               node_memory_bytes: int | None = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for *spec* (model config folder *model_dir*, dummy weights): the
    one place that builds vLLM's engine arguments, for both tiers. On a GPU (*device_total_bytes* given) the
    start-up utilization follows Note [GPU utilization] unless the spec's engine arguments set it.

    A spec without a KV budget (Note [automatic KV] in :mod:`vramgate.engine.memory_decision`) passes no
    ``kv_cache_memory_bytes``: vLLM sizes the KV cache at the spec's ``gpu_memory_utilization`` (GPU) or at the
    fraction of the NUMA node (*node_memory_bytes*) that ``cpu_memory_bytes`` is (CPU)."""
    budget = kv_budget_bytes(spec)
    if budget is None:
        return _automatic_kwargs(spec, model_dir, device_total_bytes, node_memory_bytes)
    kwargs = _base_kwargs(spec, model_dir)
    kwargs["kv_cache_memory_bytes"] = budget
    if device_total_bytes:
        kwargs["gpu_memory_utilization"] = gpu_utilization(kwargs["kv_cache_memory_bytes"],
                                                           rank_weights_bytes(spec, model_dir), device_total_bytes)
    kwargs.update(spec.engine_args)
    return kwargs


def rank_weights_bytes(spec: EngineSpec, model_dir: Path) -> int:
    """One tensor-parallel rank's share of the bf16 weights of the model in *model_dir* (Note [GPU utilization]:
    an upper bound for a quantized checkpoint); 0 for a model the weight-size model does not cover."""
    from vramgate.models.config import ModelConfigError, read_config
    from vramgate.models.quant import QuantConfigError, weight_size

    try:
        weights = weight_size(read_config(model_dir / "config.json"), "bf16").total_bytes
    except (ModelConfigError, QuantConfigError):  # a model the weight-size model does not cover: headroom only
        return 0
    return -(-weights // max(1, spec.tensor_parallel_size))


def load_format(model_dir: Path) -> str:
    """``safetensors`` for a model folder with made weights (Note [recall task] in :mod:`vramgate.models.recall`),
    else ``dummy``: the fixtures' configs have no weights, and vLLM fills dummy ones."""
    from vramgate.models.recall import RecallModel

    return "safetensors" if RecallModel.read(model_dir) is not None else "dummy"


def _base_kwargs(spec: EngineSpec, model_dir: Path) -> dict[str, Any]:
    """What every engine of *spec* passes, with a KV budget or without."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), load_format=load_format(model_dir), skip_tokenizer_init=True, dtype=spec.dtype,
        block_size=spec.block_size, max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens, kv_cache_dtype=spec.kv_cache_dtype,
        enforce_eager=spec.enforce_eager, enable_prefix_caching=spec.enable_prefix_caching,
        tensor_parallel_size=spec.tensor_parallel_size, seed=spec.seed, disable_log_stats=False,
    )
    if spec.attention_backend:
        kwargs["attention_backend"] = spec.attention_backend
    if spec.quantization:
        kwargs["quantization"] = spec.quantization
    return kwargs


def _automatic_kwargs(spec: EngineSpec, model_dir: Path, device_total_bytes: int | None,
                      node_memory_bytes: int | None) -> dict[str, Any]:
    """:func:`llm_kwargs` for a spec whose KV cache vLLM sizes itself: no ``kv_cache_memory_bytes``, the
    serving configuration's utilization, and CUDA graphs as the spec (vLLM's default: on) has them."""
    kwargs = _base_kwargs(spec, model_dir)
    if device_total_bytes is None and spec.cpu_memory_bytes is not None:
        if not node_memory_bytes:
            raise ValueError("a CPU engine with cpu_memory_bytes needs the NUMA node's memory to turn it into "
                             "gpu_memory_utilization")
        from vramgate.engine.memory_decision import cpu_utilization

        kwargs["gpu_memory_utilization"] = cpu_utilization(spec.cpu_memory_bytes, node_memory_bytes)
    elif spec.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
    kwargs.update(spec.engine_args)
    return kwargs


def engine_kwargs(spec: EngineSpec, model_dir: Path, *, cuda_context: bool = True) -> dict[str, Any]:
    """:func:`llm_kwargs` with what only the engine's own process can read: on a GPU the device's memory, for a
    CPU spec without a KV budget the NUMA node's (Note [automatic KV] in :mod:`vramgate.engine.memory_decision`).

    *cuda_context* False reads the device's memory through vLLM's platform (NVML) instead of torch, so that this
    process creates no CUDA context: vLLM's API server process, whose engine core holds the device (a context
    there would take device memory the engine sizes its KV cache from, and make vLLM spawn the core), and the
    offline engine's process, from which vLLM forks its tensor-parallel ranks only while CUDA is uninitialized there
    (Note [no CUDA before the ranks] in :mod:`vramgate.engine.worker`)."""
    from vramgate.engine.spec import engine_tier

    if engine_tier() == "gpu":
        if cuda_context:
            import torch

            from vramgate.engine.measure import device_total_bytes

            return llm_kwargs(spec, model_dir, device_total_bytes(torch))
        from vllm.platforms import current_platform

        return llm_kwargs(spec, model_dir, int(current_platform.get_device_total_memory(0)))
    node = None
    if kv_budget_bytes(spec) is None:
        from vramgate.engine.memory_decision import cpu_node_memory_bytes

        node = cpu_node_memory_bytes()
    return llm_kwargs(spec, model_dir, None, node)
