"""vLLM 0.32.0 under tensor parallelism: its communication fusion on and off (GPU tier, CLAIMS.md item 9).

vLLM 0.32.0 has no async-TP switch: its ``PassConfig`` has no
``enable_async_tp``, no ``fuse_gemm_comms`` and no ``enable_sp`` (sequence
parallelism), so the article's "overlap the all-gather under TP=4" cannot be
turned on in this engine. The nearest knob is ``fuse_allreduce_rms``
(``compilation_config={"pass_config": {"fuse_allreduce_rms": True}}``):
FlashInfer's all-reduce fused with the following RMSNorm, a compile pass (it
needs ``enforce_eager=False``) that vLLM enables by default at optimization
level 2 and up on Hopper/Blackwell when FlashInfer is installed.
``VLLM_ENABLE_GEMM_RS`` (a fused GEMM + reduce-scatter) is read only by the
DeepSeek-V4.1 and Kimi-K3 model code, and only on SM100-family GPUs.

Here the real engine runs Llama-3.1-8B (dummy weights) at TP 2 and 4 with
that fusion off and on, everything else equal, and records per configuration:
KV page bytes and capacity (exact: the KV heads split over the ranks), rank
0's weight and KV tensor bytes, and per-request TTFT and TPOT. Each TP size is
one test, so the two runs sit next to each other in the report. Skipped
without the GPUs (``requires_gpus(n)``) or without vLLM.
"""

from __future__ import annotations

from typing import Any

import pytest

from vramgate import Gate
from vramgate.testing import Engine, ModelLoader
from vramgate.testing.engines import EngineResult, EngineSpec, fusion_problem
from vramgate.testing.machine import median

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("tensor-parallel claims: no optimization profile changes them")

MODEL = "llama-3.1-8b"
BLOCK_SIZE = 16
#: KV budget per rank (vLLM's ``kv_cache_memory_bytes`` is per GPU).
KV_BUDGET_GIB = 2.0
TP_SIZE = [pytest.param(n, id=f"tp{n}", marks=pytest.mark.requires_gpus(n)) for n in (2, 4)]
#: GPU latency against a stored baseline: 30% keeps false alarms under 1% (docs/calibration.md).
LATENCY_TOLERANCE = 0.3


def spec(tp: int, fused: bool) -> EngineSpec:
    """The engine run: 16 requests of 128 + 64 tokens, compiled (the fusion is a compile pass)."""
    return EngineSpec(
        model=MODEL, workload="fixed", requests=16, block_size=BLOCK_SIZE, max_model_len=2048,
        kv_budget_gib=KV_BUDGET_GIB, enforce_eager=False, tensor_parallel_size=tp,
        engine_args={"compilation_config": {"pass_config": {"fuse_allreduce_rms": fused}}},
        timeout_s=1800,
    )


def record(gate: Gate, prefix: str, result: EngineResult) -> dict[str, Any]:
    """Record one run's figures under *prefix*; returns the medians used in the comparison."""
    kv, memory, lat = result.kv, result.memory, result.latency
    gate.record(f"{prefix}.page_bytes", kv.page_bytes, unit="B")
    gate.record(f"{prefix}.capacity_tokens", kv.capacity_tokens, unit="tokens", better="higher")
    ranks = memory.ranks or [{"weights_bytes": memory.weights_bytes, "kv_tensor_bytes": memory.kv_tensor_bytes}]
    assert len(ranks) == result.spec["tensor_parallel_size"], f"figures of {len(ranks)} rank(s) came back"
    for rank, figures in enumerate(ranks):
        gate.record(f"{prefix}.rank{rank}_weights_bytes", figures["weights_bytes"], unit="B", scope="machine")
        gate.record(f"{prefix}.rank{rank}_kv_tensor_bytes", figures["kv_tensor_bytes"], unit="B", scope="machine")
    gate.record_samples(f"{prefix}.ttft", lat.ttft_s, unit="s", tolerance=LATENCY_TOLERANCE)
    gate.record_samples(f"{prefix}.tpot", lat.tpot_s, unit="s", tolerance=LATENCY_TOLERANCE)
    return {"ttft": median(lat.ttft_s), "tpot": median(lat.tpot_s), "weights": memory.weights_bytes,
            "kv": memory.kv_tensor_bytes, "capacity": kv.capacity_tokens}


@pytest.mark.parametrize("tp", TP_SIZE)
def test_allreduce_rms_fusion(gate: Gate, engine: Engine, model_shape: ModelLoader, tp: int) -> None:
    """Llama-3.1-8B at TP=*tp*, ``fuse_allreduce_rms`` off and on: KV, per-rank memory, TTFT/TPOT."""
    shape = model_shape(MODEL)
    kv_heads_per_rank = max(1, shape.num_kv_heads // tp)
    page = shape.page_bytes(BLOCK_SIZE) * kv_heads_per_rank // shape.num_kv_heads
    budget = int(KV_BUDGET_GIB * 2**30)
    figures = {}
    for fused in (False, True):
        result = engine.run(spec(tp, fused))
        name = "fusion_on" if fused else "fusion_off"
        assert result.kv.page_bytes == page, (
            f"{name}: page {result.kv.page_bytes:,} B, expected {page:,} B "
            f"({kv_heads_per_rank} KV heads per rank)")
        assert result.kv.num_gpu_blocks == budget // (page * shape.num_layers), result.kv
        assert result.kv.capacity_tokens == result.kv.num_gpu_blocks * BLOCK_SIZE, result.kv
        assert len(result.latency.ttft_s) == 16, "vLLM returned no per-request stats"
        if fused:  # Note [fusion pass state]: vLLM may have left the pass disabled with a warning
            problem = fusion_problem(result.compilation.get("fusion", []))
            if problem:
                pytest.skip(f"not on this machine: fuse_allreduce_rms asked for, but {problem}")
        figures[name] = record(gate, name, result)
    off, on = figures["fusion_off"], figures["fusion_on"]
    print(f"TP={tp}: fuse_allreduce_rms off / on: TTFT {off['ttft'] * 1e3:.1f} / {on['ttft'] * 1e3:.1f} ms, "
          f"TPOT {off['tpot'] * 1e3:.2f} / {on['tpot'] * 1e3:.2f} ms, rank 0 weights {off['weights'] / 2**30:.2f} / "
          f"{on['weights'] / 2**30:.2f} GiB, KV {off['kv'] / 2**30:.2f} / {on['kv'] / 2**30:.2f} GiB, capacity "
          f"{off['capacity']:,} / {on['capacity']:,} tokens")
    assert on["capacity"] == off["capacity"], "a communication fusion must not change the KV capacity"
