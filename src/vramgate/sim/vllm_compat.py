"""The simulator's own vLLM-version difference: how the scheduler's KV cache config learns its block sizes.

The simulator builds vLLM's scheduler as ``EngineCore`` does. After resolving
the scheduler's and the prefix hash's block sizes
(``resolve_kv_cache_block_sizes``, the same in 0.31 and 0.32):

- vLLM 0.32.0's ``EngineCore._initialize_kv_caches`` also stores them on the
  ``KVCacheConfig`` (``hash_block_size``, and ``cache_hit_alignment_tokens``
  from ``resolve_cache_hit_alignment_tokens``, new in 0.32.0), which its KV
  cache coordinator reads;
- vLLM 0.31.0's ``KVCacheConfig`` has neither field (its coordinator takes the
  hash block size from the scheduler's arguments) and
  ``resolve_cache_hit_alignment_tokens`` does not exist.

vLLM 0.33.0 does what 0.32.0 does here. Everything else the simulator calls has the same signature in all
three, except where the KV cache configs come from (:mod:`vramgate.models.vllm_compat`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vramgate.core.versions import pick
from vramgate.machine.software import vllm_version


def _store_block_sizes_032(kv_cfg: Any, cfg: Any, sched_bs: int, hash_bs: int) -> None:
    from vllm.v1.core.kv_cache_utils import resolve_cache_hit_alignment_tokens

    kv_cfg.hash_block_size = hash_bs
    kv_cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kv_cfg, cfg, sched_bs, hash_bs)


def _store_block_sizes_031(kv_cfg: Any, cfg: Any, sched_bs: int, hash_bs: int) -> None:
    """Nothing to store: 0.31.0's scheduler takes the block sizes as arguments only."""


#: vLLM version specifier -> how the scheduler's KV cache config gets its block sizes.
STORE_BLOCK_SIZES: dict[str, Callable[[Any, Any, int, int], None]] = {
    "==0.31.*": _store_block_sizes_031,
    ">=0.32,<0.34": _store_block_sizes_032,  # 0.33.0's EngineCore stores them the same way
}


def store_block_sizes(kv_cfg: Any, cfg: Any, sched_bs: int, hash_bs: int) -> None:
    """Give the scheduler's ``KVCacheConfig`` its block sizes as the running vLLM's ``EngineCore`` does."""
    adapter = pick(STORE_BLOCK_SIZES, vllm_version() or "0", "the simulator's scheduler construction")
    adapter(kv_cfg, cfg, sched_bs, hash_bs)
