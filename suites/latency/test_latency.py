"""Per-request latency and throughput of the real engine, as measured metrics.

TTFT, TPOT and end-to-end latency come from vLLM's own request stats; each
request is one sample. On the CPU tier the engine runs one OpenMP thread on a
shared machine beside the other xdist worker, so these gate only gross
regressions (tolerance 300%: a fourfold latency fails; docs/calibration.md); on a GPU box 30% (calibrated on
an H200 for kernels). The models (and each one's block size) are the
matrix's (docs/matrix.md).
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import Engine, MatrixCase
from vramgate.testing.engines import small_run_spec, unpaired_latency_tolerance

#: Unpaired latency against a stored baseline: the tier's calibrated tolerance (vramgate.testing).
TOLERANCE = unpaired_latency_tolerance()
#: TTFT of requests that all arrive at once: one measurement shared by every request (vramgate.testing).
TTFT_TOLERANCE = unpaired_latency_tolerance(first_token=True)


@pytest.mark.gate_matrix("latency", id="{model}")
def test_engine_latency(gate: Gate, engine: Engine, model: str, block_size: int, matrix_case: MatrixCase) -> None:
    """The shared small run (the capacity suite runs it too, so the session runs each engine once)."""
    spec = matrix_case.engine_spec(small_run_spec(model, block_size))
    result = engine.run(spec)
    lat = result.latency
    assert len(lat.ttft_s) == spec.requests, "vLLM returned no per-request stats (disable_log_stats must be False)"
    gate.record_samples("ttft", lat.ttft_s, unit="s", tolerance=TTFT_TOLERANCE)
    gate.record_samples("tpot", lat.tpot_s, unit="s", tolerance=TOLERANCE)
    gate.record_samples("e2e", lat.e2e_s, unit="s", tolerance=TOLERANCE)
    per_request = [n / e for n, e in zip(lat.output_lens, lat.e2e_s, strict=True) if e > 0]
    gate.record_samples("request_throughput", per_request, unit="tokens/s", better="higher", tolerance=TOLERANCE)
    if spec.workload == "fixed":
        assert lat.output_tokens == spec.requests * 64
