"""The KV cache a serving team gets: vLLM sizes it itself at the team's memory, and the gate holds what it gave.

Each case is a matrix entry's serving configuration (``[entries.serving]``: ``gpu_memory_utilization`` on a
GPU, ``cpu_memory`` on CPU, CUDA graphs as vLLM defaults them, the team's ``max_model_len``, ``max_num_seqs``
and ``max_num_batched_tokens``), started with no ``kv_cache_memory_bytes`` (Note [automatic KV] in
:mod:`vramgate.engine.memory_decision`), then driven with a short load. The figures come from vLLM's own objects:
the engine core's available KV memory, the cache config's blocks, token capacity and maximum concurrency at
``max_model_len``, the worker's requested memory and, on a GPU, its memory profiling (weights, torch peak,
non-torch memory), the CUDA-graph estimate and the pool it really captured. All are machine-bound (per GPU class,
per CPU key), judged with the tolerances measured in docs/serving.md; the matrix's budgets
(``capacity_tokens >= N``, ``max_concurrency >= X``, ``cudagraph_bytes <= Y``) hold on every machine. On CPU the
KV cache vLLM gives moves with the page cache's state (Note [file-backed RSS] in
:mod:`vramgate.engine.memory_decision`): there the worker's own non-KV memory (``non_kv_own_bytes``) is held to
the baseline, and the KV figures to the budgets.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine, MatrixCase, ModelLoader
from vramgate.testing.engines import EngineSpec, engine_tier

#: The CPU tier's tolerances, about twice the run-to-run range of unchanged engines: "non_kv" holds the worker's own
#: non-KV memory (``non_kv_own_bytes``, Note [file-backed RSS] in vramgate.engine.memory_decision), "peak" the load's
#: peak; "kv" is the KV figures', now held to the budgets only on CPU. The runs that set them: docs/serving.md,
#: "The page cache moves vLLM's CPU KV cache" and "Tolerances (measured)".
CPU_TOLERANCE = {"kv": 0.03, "non_kv": 0.05, "peak": 0.02}
#: The GPU tier's: not measured (no GPU run of this suite yet); the first runs on a GPU class measure them
#: (docs/serving.md, "The first run on a GPU class").
GPU_TOLERANCE = {"kv": 0.02, "non_kv": 0.05, "peak": 0.05}
#: The short load after start-up: 32 requests of 128 + 64 tokens, all at once (the peak it reaches is the figure).
LOAD = EngineSpec(model="tiny-llama", workload="fixed", requests=32)


@pytest.mark.gate_matrix("serving_capacity", id="{model}-bs{block_size}")
def test_serving_kv_capacity(gate: Gate, engine: Engine, model_shape: ModelLoader, model: str, block_size: int,
                             kv_cache_dtype: str, matrix_case: MatrixCase) -> None:
    spec = matrix_case.engine_spec(LOAD.replace(model=model))
    assert spec.kv_budget_gib is None, "a serving case must leave the KV cache to vLLM"
    result = engine.run(spec)
    d = result.decision
    assert d is not None, "the engine ran with a KV budget: no memory decision of vLLM's to read"
    tier = engine_tier()
    tol = CPU_TOLERANCE if tier == "cpu" else GPU_TOLERANCE
    if tier == "cpu" and spec.cpu_memory_bytes and abs(d.requested_bytes - spec.cpu_memory_bytes) > \
            0.005 * spec.cpu_memory_bytes:
        pytest.skip(f"this machine's NUMA node changed its memory while vLLM started: it requested "
                    f"{d.requested_bytes} B, not the {spec.cpu_memory_bytes} B of the serving configuration")
    # Note [file-backed RSS] in vramgate.engine.memory_decision: on CPU the KV cache vLLM gives moves with the page
    # cache's state (how many of the libraries' pages its RSS counts), so the figures it derives are held to the
    # matrix's budgets only, and the worker's own non-KV memory (without those pages) to the baseline
    own = d.non_kv_own_bytes
    history = own is None
    gate.record("kv_cache_bytes", d.available_kv_bytes, unit="B", better="higher", tolerance=tol["kv"],
                scope="machine", history=history)
    gate.record("capacity_tokens", d.capacity_tokens, unit="tokens", better="higher", tolerance=tol["kv"],
                scope="machine", history=history)
    gate.record("max_concurrency", round(d.max_concurrency, 4), unit="requests", better="higher",
                tolerance=tol["kv"], scope="machine", history=history)
    gate.record("non_kv_bytes", d.non_kv_bytes, unit="B", tolerance=tol["non_kv"], scope="machine", history=history)
    if own is not None:
        assert d.rss_file_bytes is not None and 0 < own < d.non_kv_bytes, d
        gate.record("non_kv_own_bytes", own, unit="B", tolerance=tol["non_kv"], scope="machine")
        gate.record("non_kv_file_bytes", d.rss_file_bytes, unit="B", scope="machine", history=False)
    # What the team's utilization asks for (utilization x the device's or node's memory): the upgrade report's
    # advice divides by it; on a GPU it moves only when the driver's view of the device does.
    gate.record("requested_bytes", d.requested_bytes, unit="B", better="higher", tolerance=0.005, scope="machine")
    if d.load_peak_fraction is not None:
        gate.record("load_peak_fraction", round(d.load_peak_fraction, 6), unit="ratio", tolerance=tol["peak"],
                    scope="machine")
    if d.cudagraph_bytes is not None:
        gate.record("cudagraph_bytes", d.cudagraph_bytes, unit="B", tolerance=tol["non_kv"], scope="machine")
    if d.cudagraph_estimate_bytes is not None:
        gate.record("cudagraph_estimate_bytes", d.cudagraph_estimate_bytes, unit="B", tolerance=tol["non_kv"],
                    scope="machine")
    # vLLM's own accounting holds together: the blocks fit the memory it gave, the tokens are the blocks'.
    shape = model_shape(model)
    assert d.num_blocks == shape.capacity_blocks(d.available_kv_bytes, block_size, kv_cache_dtype), d
    assert d.capacity_tokens == d.num_blocks * block_size, d
    assert d.max_concurrency == pytest.approx(d.capacity_tokens / spec.max_model_len, rel=0.02), d
    assert d.non_kv_bytes > 0 and d.available_kv_bytes > 0, d
