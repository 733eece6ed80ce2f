"""KV capacity of a real engine run at a fixed KV budget equals the analytic figure.

vLLM's CPU (or GPU) engine starts with ``kv_cache_memory_bytes`` = the budget;
the blocks it allocates must be ``budget // (page bytes x layers)`` and its
token capacity ``blocks x block_size``, with ``page bytes`` from the model's
architecture (no padding).
"""

from __future__ import annotations

import pytest

from vramgate.engine import EngineSpec, engine_tier
from vramgate.gate import Gate

BUDGET_GIB = 0.25
#: Block sizes each backend runs: vLLM's CPU attention needs multiples of 32 and its CPU MLA runs 16 only.
CASES = {
    "cpu": [("tiny-llama", 32), ("tiny-llama", 64), ("tiny-llama", 128), ("tiny-deepseek-v2", 16)],
    "gpu": [("tiny-llama", 16), ("tiny-llama", 32), ("tiny-llama", 128), ("tiny-deepseek-v2", 16),
            ("tiny-deepseek-v2", 64)],
}
MODEL_BLOCK_SIZE = [pytest.param(m, b, id=f"{m}-bs{b}") for m, b in CASES[engine_tier()]]


def capacity_spec(model: str, block_size: int) -> EngineSpec:
    return EngineSpec(model=model, workload="fixed", requests=16, block_size=block_size, max_model_len=1024,
                      kv_budget_gib=BUDGET_GIB)


@pytest.mark.parametrize(("model", "block_size"), MODEL_BLOCK_SIZE)
def test_engine_kv_capacity(gate: Gate, engine, model_shape, model: str, block_size: int) -> None:
    result = engine.run(capacity_spec(model, block_size))
    shape = model_shape(model)
    budget = int(BUDGET_GIB * 2**30)
    kv = result.kv
    gate.record("page_bytes", kv["page_bytes"], unit="B")
    gate.record("num_gpu_blocks", kv["num_gpu_blocks"], unit="blocks", better="higher")
    gate.record("capacity_tokens", kv["capacity_tokens"], unit="tokens", better="higher")
    gate.record("weights_bytes", result.memory["weights_bytes"], unit="B")
    assert kv["block_size"] == block_size, result.notes
    assert kv["page_bytes"] == shape.page_bytes(block_size)
    assert kv["num_gpu_blocks"] == shape.capacity_blocks(budget, block_size)
    assert kv["capacity_tokens"] == kv["num_gpu_blocks"] * block_size
    assert kv["num_layers"] == shape.num_layers
    assert budget - (page := kv["page_bytes"] * kv["num_layers"]) < result.memory["kv_tensor_bytes"] <= budget, page
