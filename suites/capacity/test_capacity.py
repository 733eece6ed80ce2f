"""KV capacity of a real engine run at a fixed KV budget equals the analytic figure.

vLLM's CPU (or GPU) engine starts with ``kv_cache_memory_bytes`` = the budget;
the blocks it allocates must be ``budget // (page bytes x layers)`` and its
token capacity ``blocks x block_size``, with ``page bytes`` from the model's
architecture (no padding). The models and block sizes per tier are the matrix's (docs/matrix.md): each
model's shared block size first (the latency and quantization suites run it too, so the session runs that
engine once), then the entries marked ``nightly`` (the full gate only).

While the cuda tier's portable figures are computed on CPU (``--gate-compute-tier cuda``), the same figures come
from vLLM's own KV accounting at the budget, with no engine: a GPU runner then compares its engine's with them.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine, MatrixCase, ModelLoader
from vramgate.testing.engines import small_run_spec
from vramgate.testing.machine import computed_tier


@pytest.mark.gate_matrix("capacity", id="{model}-bs{block_size}")
def test_engine_kv_capacity(gate: Gate, engine: Engine, model_shape: ModelLoader, model: str, block_size: int,
                            matrix_case: MatrixCase) -> None:
    spec = matrix_case.engine_spec(small_run_spec(model, block_size))
    kv_dtype = spec.kv_cache_dtype
    shape = model_shape(model)
    assert spec.kv_budget_gib is not None  # the shared small run has a fixed budget
    budget = int(spec.kv_budget_gib * 2**30)
    if computed_tier():  # Note [a tier's portable figures computed on CPU]: vLLM's own accounting at the budget
        from vramgate.testing.models import vllm_kv_layout

        layout = vllm_kv_layout(model_shape.path(model), block_size=block_size, kv_cache_dtype=kv_dtype,
                                budget_bytes=budget, max_model_len=spec.max_model_len)
        gate.record("page_bytes", layout.page_bytes, unit="B")
        gate.record("num_gpu_blocks", layout.num_blocks, unit="blocks", better="higher")
        gate.record("capacity_tokens", layout.num_blocks * block_size, unit="tokens", better="higher")
        assert layout.page_bytes == shape.page_bytes(block_size, kv_dtype)
        assert layout.num_blocks == shape.capacity_blocks(budget, block_size, kv_dtype)
        return
    result = engine.run(spec)
    kv = result.kv
    gate.record("page_bytes", kv.page_bytes, unit="B")
    gate.record("num_gpu_blocks", kv.num_gpu_blocks, unit="blocks", better="higher")
    gate.record("capacity_tokens", kv.capacity_tokens, unit="tokens", better="higher")
    gate.record("weights_bytes", result.memory.weights_bytes, unit="B", scope="machine")
    assert kv.block_size == block_size, result.notes
    assert kv.page_bytes == shape.page_bytes(block_size, kv_dtype)
    assert kv.num_gpu_blocks == shape.capacity_blocks(budget, block_size, kv_dtype)
    assert kv.capacity_tokens == kv.num_gpu_blocks * block_size
    assert kv.num_layers == shape.num_layers
    assert budget - (page := kv.page_bytes * kv.num_layers) < result.memory.kv_tensor_bytes <= budget, page
