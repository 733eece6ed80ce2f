"""The repository's suites that parametrize from the matrix, and what each lets an entry set (Note [matrix
suites] in :mod:`vramgate.matrix.suites`): declared here, in the suites' own layer, registered on import."""

from __future__ import annotations

from vramgate.matrix.suites import SuiteRule, register_suite


def matrix_suite(name: str, *, metrics: tuple[str, ...], kv_only: bool = False, serving: bool = False,
                 load: bool = False, one_block_size: bool = False) -> SuiteRule:
    """Declare suite *name* to the matrix: the metrics it records (which budgets may name) and what it reads of an
    entry (see :class:`~vramgate.matrix.suites.SuiteRule`). A project's own suite calls this from its root
    ``conftest.py``, before the matrix is read."""
    return register_suite(SuiteRule(name, metrics, kv_only, serving, load, one_block_size))


#: The repository's matrix suites, as their code records (tests/test_matrix.py keeps each in step with it).
KV_CACHE = matrix_suite("kv_cache", metrics=("page_bytes", "bytes_per_token", "kv_blocks_per_gib",
                                             "capacity_tokens_per_gib"), kv_only=True)
CAPACITY = matrix_suite("capacity", metrics=("page_bytes", "num_gpu_blocks", "capacity_tokens", "weights_bytes"))
LATENCY = matrix_suite("latency", metrics=("ttft", "tpot", "e2e", "request_throughput"), one_block_size=True)
SERVING_CAPACITY = matrix_suite("serving_capacity", metrics=(
    "kv_cache_bytes", "capacity_tokens", "max_concurrency", "non_kv_bytes", "requested_bytes", "load_peak_fraction",
    "cudagraph_bytes", "cudagraph_estimate_bytes"), serving=True)
SERVING = matrix_suite("serving", metrics=(
    "ttft", "tpot", "e2el", "ttft_p90", "ttft_p99", "tpot_p90", "tpot_p99", "itl_p50", "itl_p90", "itl_p99",
    "e2el_p90", "e2el_p99", "request_throughput", "output_throughput", "goodput", "memory_slope",
    "memory_slope_per_token", "memory_slope_difference", "device_memory_slope", "server_rss_bytes"), serving=True,
    load=True)
