"""The KV accounting's one vLLM-version difference: where the KV cache configs come from.

:func:`kv_cache_configs` turns per-layer KV specs and a memory budget into vLLM's
``KVCacheConfig`` list, as ``EngineCore._initialize_kv_caches`` does after memory
profiling (the gate's KV layout and the simulator's scheduler both go through it):

- vLLM 0.31.0 and 0.32.0: ``vllm.v1.core.kv_cache_utils.get_kv_cache_configs(config, specs, memory)``;
- vLLM 0.33.0 moved it to ``vllm.v1.core.kv_cache_planning`` and added an argument: the engine core first
  groups the layers of the whole model (``get_global_kv_cache_groups``), lets the config adjust the
  decode-context-parallel interleave to the groups, then passes the groups in.

vLLM is imported inside the functions; importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vramgate.core.versions import pick
from vramgate.machine.software import vllm_version


def _configs_utils(config: Any, specs: list[dict[str, Any]], memory: list[int]) -> list[Any]:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

    return list(get_kv_cache_configs(config, specs, memory))


def _configs_planning(config: Any, specs: list[dict[str, Any]], memory: list[int]) -> list[Any]:
    from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found, unused-ignore]
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )

    groups = get_global_kv_cache_groups(config, specs)
    config.adjust_dcp_kv_cache_interleave_size(groups)
    return list(get_kv_cache_configs(config, specs, memory, groups))


#: vLLM version specifier -> how KV specs and a budget become vLLM's KV cache configs.
KV_CACHE_CONFIGS: dict[str, Callable[[Any, list[dict[str, Any]], list[int]], list[Any]]] = {
    ">=0.31,<0.33": _configs_utils,
    "==0.33.*": _configs_planning,
}


def kv_cache_configs(config: Any, specs: list[dict[str, Any]], memory: list[int]) -> list[Any]:
    """vLLM's KV cache configs for per-worker layer *specs* and *memory* bytes, as the running vLLM's engine core
    computes them (a ``ValueError`` from vLLM when the budget cannot serve the model length)."""
    adapter = pick(KV_CACHE_CONFIGS, vllm_version() or "0", "the KV cache configs")
    return adapter(config, specs, memory)
