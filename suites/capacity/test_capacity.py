"""KV capacity of a real engine run at a fixed KV budget equals the analytic figure.

vLLM's CPU (or GPU) engine starts with ``kv_cache_memory_bytes`` = the budget;
the blocks it allocates must be ``budget // (page bytes x layers)`` and its
token capacity ``blocks x block_size``, with ``page bytes`` from the model's
architecture (no padding).
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.engine import engine_tier
from vramgate.testing import SMALL_RUN_BLOCK_SIZE, Engine, ModelLoader, small_run_spec

#: Block sizes each backend runs besides the shared small run's (vLLM's CPU attention needs multiples of 32 and
#: its CPU MLA runs 16 only): each model's shared block size first (the latency and quantization suites run it
#: too, so the session runs that engine once), then these.
MORE_BLOCK_SIZES = {
    "cpu": {"tiny-llama": (64, 128)},
    "gpu": {"tiny-llama": (32, 128), "tiny-deepseek-v2": (64,)},
}
#: The shared block size is in the pre-merge set; the others only in the full gate (tox -e cpu-full).
MORE_IN_FULL_GATE = pytest.mark.gate_nightly("more block sizes of the same accounting: no profile changes them")
MODEL_BLOCK_SIZE = [
    pytest.param(m, b, id=f"{m}-bs{b}", marks=() if b == shared else MORE_IN_FULL_GATE)
    for m, shared in SMALL_RUN_BLOCK_SIZE[engine_tier()].items()
    for b in (shared, *MORE_BLOCK_SIZES[engine_tier()].get(m, ()))
]


@pytest.mark.parametrize(("model", "block_size"), MODEL_BLOCK_SIZE)
def test_engine_kv_capacity(gate: Gate, engine: Engine, model_shape: ModelLoader, model: str, block_size: int) -> None:
    spec = small_run_spec(model, block_size)
    result = engine.run(spec)
    shape = model_shape(model)
    budget = int(spec.kv_budget_gib * 2**30)
    kv = result.kv
    gate.record("page_bytes", kv["page_bytes"], unit="B")
    gate.record("num_gpu_blocks", kv["num_gpu_blocks"], unit="blocks", better="higher")
    gate.record("capacity_tokens", kv["capacity_tokens"], unit="tokens", better="higher")
    gate.record("weights_bytes", result.memory["weights_bytes"], unit="B", scope="machine")
    assert kv["block_size"] == block_size, result.notes
    assert kv["page_bytes"] == shape.page_bytes(block_size)
    assert kv["num_gpu_blocks"] == shape.capacity_blocks(budget, block_size)
    assert kv["capacity_tokens"] == kv["num_gpu_blocks"] * block_size
    assert kv["num_layers"] == shape.num_layers
    assert budget - (page := kv["page_bytes"] * kv["num_layers"]) < result.memory["kv_tensor_bytes"] <= budget, page
