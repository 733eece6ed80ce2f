"""Per-request latency and throughput of the real engine, as measured metrics.

TTFT, TPOT and end-to-end latency come from vLLM's own request stats; each
request is one sample. On the CPU tier the engine runs one OpenMP thread on a
shared machine, so these gate only gross regressions (tolerance 100%: a
doubling fails); on a GPU box the default 5% applies.
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.engine import engine_tier
from vramgate.testing import Engine, small_run_spec

MODEL = ["tiny-llama", "tiny-deepseek-v2"]
#: Raw latency against a baseline from another process, on 2 shared cores: 31.5% false alarms at 7.5%, none in
#: 314 comparisons at 50% or 100% (docs/calibration.md). 1.0 gates gross changes only: twice the
#: latency, or half the throughput (tolerances are ratio terms both ways); the paired test sees 10%.
TOLERANCE = 1.0 if engine_tier() == "cpu" else None


@pytest.mark.parametrize("model", MODEL)
def test_engine_latency(gate: Gate, engine: Engine, model: str) -> None:
    """The shared small run (the capacity suite runs it too, so the session runs each engine once)."""
    result = engine.run(small_run_spec(model))
    lat = result.latency
    assert len(lat["ttft_s"]) == 16, "vLLM returned no per-request stats (disable_log_stats must be False)"
    gate.record_samples("ttft", lat["ttft_s"], unit="s", tolerance=TOLERANCE)
    gate.record_samples("tpot", lat["tpot_s"], unit="s", tolerance=TOLERANCE)
    gate.record_samples("e2e", lat["e2e_s"], unit="s", tolerance=TOLERANCE)
    per_request = [n / e for n, e in zip(lat["output_lens"], lat["e2e_s"], strict=True) if e > 0]
    gate.record_samples("request_throughput", per_request, unit="tokens/s", better="higher", tolerance=TOLERANCE)
    assert lat["output_tokens"] == 16 * 64
