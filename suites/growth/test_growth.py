"""KV blocks and bytes grow linearly with tokens (CLAIMS.md item 2).

The article models KV memory as ``b*s*h*d*2*dtype*alpha`` with
``alpha = 1 + 0.42*(s/2048) + 0.18``, i.e. growing quadratically. vLLM's KV cache
manager allocates ``ceil(tokens / block_size)`` blocks per request; bytes are
blocks x page x layers. Measured here with vLLM's real scheduler and block pool
on the full-size configs, one request per length up to the model's maximum.
"""

from __future__ import annotations

import math

import pytest

from vramgate import Gate
from vramgate.testing import ModelLoader, Simulator
from vramgate.testing.simulator import RequestSpec, Workload

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("KV growth with context length (CLAIMS.md): no optimization profile changes it")

MODEL = ["deepseek-v2-lite", "llama-3.1-8b"]
BLOCK_SIZE = [16, 128]
LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131071]
MAX_MODEL_LEN = 131072  # both configs allow 128k positions


def one_request(prompt_len: int) -> Workload:
    return Workload(name=f"single-{prompt_len}", seed=0, requests=(RequestSpec(prompt_len, 1),))


def loglog_slope(xs: list[int], ys: list[int]) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


@pytest.mark.parametrize("block_size", BLOCK_SIZE, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("model", MODEL)
def test_blocks_and_bytes_linear_in_tokens(gate: Gate, simulator: Simulator, model_shape: ModelLoader, model: str,
                                           block_size: int) -> None:
    shape = model_shape(model)
    per_block = shape.page_bytes(block_size) * shape.num_layers
    blocks = []
    for length in LENGTHS:
        result = simulator.run(
            model, one_request(length), block_size=block_size, num_gpu_blocks=MAX_MODEL_LEN // block_size + 8,
            max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8192, async_scheduling=False,
        )
        blocks.append(result.peak_blocks_used)
        assert result.peak_blocks_used == math.ceil(length / block_size), (
            f"{length} tokens took {result.peak_blocks_used} blocks of {block_size}, "
            f"expected ceil({length}/{block_size}) = {math.ceil(length / block_size)}"
        )
    kv_bytes = [b * per_block for b in blocks]
    slope = loglog_slope(LENGTHS, kv_bytes)
    gate.record("blocks_at_max_len", blocks[-1], unit="blocks")
    gate.record("kv_bytes_at_max_len", kv_bytes[-1], unit="B")
    gate.record("loglog_slope", round(slope, 6), unit="ratio", tolerance=1e-6)
    alpha_at_max = 1 + 0.42 * (LENGTHS[-1] / 2048) + 0.18
    measured_alpha = kv_bytes[-1] / (LENGTHS[-1] * shape.bytes_per_token())
    gate.claim(
        "KV memory grows as tokens x alpha with alpha = 1 + 0.42 (s/2048) + 0.18 (quadratic in s)",
        held=abs(measured_alpha - alpha_at_max) < 0.5 * alpha_at_max,
        evidence=(
            f"{model}, block {block_size}: log-log slope of KV bytes vs tokens over 1k..128k = {slope:.4f}; "
            f"at {LENGTHS[-1]:,} tokens alpha = {measured_alpha:.4f} measured vs {alpha_at_max:.2f} claimed"
        ),
        source="CLAIMS.md item 2",
    )
    assert abs(slope - 1.0) < 1e-3


SIZES = [(100, 1), (1000, 1), (17, 1), (4096, 1), (1, 1), (2500, 1), (333, 1), (64, 1)]


@pytest.mark.parametrize("block_size", BLOCK_SIZE, ids=lambda b: f"bs{b}")
def test_blocks_are_the_sum_of_per_request_ceilings(gate: Gate, simulator: Simulator, block_size: int) -> None:
    """Eight requests of mixed lengths prefilled in one step hold exactly sum(ceil(len_i / block_size)) blocks."""
    workload = Workload(name="mixed", seed=0, requests=tuple(RequestSpec(p, o) for p, o in SIZES))
    result = simulator.run(
        "llama-3.1-8b", workload, block_size=block_size, num_gpu_blocks=4096, max_model_len=8192,
        max_num_batched_tokens=16384, async_scheduling=False,
    )
    expected = sum(math.ceil(p / block_size) for p, _ in SIZES)
    gate.record("peak_blocks", result.peak_blocks_used, unit="blocks")
    assert result.peak_blocks_used == expected
