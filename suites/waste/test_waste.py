"""Internal waste of paged KV on a ShareGPT-like trace, per block size (CLAIMS.md item 3).

The article: PagedAttention cuts fragmentation "to <5% from 28-42%". The vLLM
paper (SOSP'23) reports 96.3% of KV memory holding tokens (3.7% waste) against
20.4-38.2% in earlier systems. In vLLM the only internal waste is the unfilled
tail of each request's last block, bounded by (block_size - 1) / length. Measured
with vLLM's real scheduler over 2,000 requests, the same token capacity
(131,072 tokens) at every block size.
"""

from __future__ import annotations

import statistics

import pytest

from vramgate import Gate
from vramgate.testing import Simulator
from vramgate.testing.simulator import build

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("internal waste per block size (CLAIMS.md): no optimization profile changes it")

BLOCK_SIZE = [16, 32, 64, 128]
CAPACITY_TOKENS = 131072
REQUESTS = 2000


@pytest.mark.parametrize("block_size", BLOCK_SIZE, ids=lambda b: f"bs{b}")
def test_internal_waste_on_sharegpt(gate: Gate, simulator: Simulator, block_size: int) -> None:
    workload = build("sharegpt", requests=REQUESTS, seed=0, max_model_len=4096)
    mean_len = statistics.mean(r.total_len for r in workload.requests)
    result = simulator.run("tiny-llama", workload, block_size=block_size,
                           num_gpu_blocks=CAPACITY_TOKENS // block_size + 1, max_model_len=4096)
    ceiling = (block_size - 1) / mean_len
    gate.record("internal_waste_mean", round(result.internal_waste_mean, 6), unit="ratio", ceiling=ceiling,
                tolerance=1e-6)
    gate.record("internal_waste_max", round(result.internal_waste_max, 6), unit="ratio", tolerance=1e-6)
    gate.record("peak_blocks", result.peak_blocks_used, unit="blocks")
    gate.record("preemptions", result.preemptions, unit="count")
    assert result.waste_bound_violations == 0, "a step wasted more than (block_size - 1) slots per request"
    if block_size == 16:
        gate.claim(
            "PagedAttention cuts KV fragmentation to under 5% (from 28-42% with contiguous allocation)",
            held=result.internal_waste_mean < 0.05,
            evidence=(
                f"vLLM 0.32.0 scheduler, ShareGPT-like trace ({REQUESTS} requests, mean {mean_len:.0f} tokens), "
                f"block 16: time-weighted internal waste {result.internal_waste_mean:.2%} (max "
                f"{result.internal_waste_max:.2%}), bound 15/{mean_len:.0f} = {ceiling:.2%}; vLLM paper: 3.7%. "
                "The <5% holds; the 28-42% baseline is not vLLM's to measure"
            ),
            source="CLAIMS.md item 3",
        )
