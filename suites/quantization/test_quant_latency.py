"""Latency of 4-bit checkpoints against bf16, measured on the same workload in the same session.

Per-request TTFT and TPOT of each quantized run (vLLM's request stats), and
per request the TPOT ratio to the bf16 run's same request (the workload gives
every request the same lengths, so request i is paired with request i). On
CPU, 4-bit linear layers run vLLM's ``cpu_gemm_wna16`` and bf16 ones oneDNN;
on this tiny model both are a small part of a decode step, so the ratio says
little about a full-size model and gates only gross regressions (tolerance
300% on CPU, as the latency suite).
"""

from __future__ import annotations

import pytest

from vramgate import Gate
from vramgate.testing import QuantRuns
from vramgate.testing.engines import unpaired_latency_tolerance
from vramgate.testing.machine import median
from vramgate.testing.profiles import Profile

#: Unpaired latency against a stored baseline: the tier's calibrated tolerance (vramgate.testing).
TOLERANCE = unpaired_latency_tolerance()
#: TTFT of requests that all arrive at once: one measurement shared by every request (vramgate.testing).
TTFT_TOLERANCE = unpaired_latency_tolerance(first_token=True)


@pytest.mark.gate_judges("latency")
@pytest.mark.gate_profiles("quantization", reference="bf16")
def test_quantized_latency(gate: Gate, quant_runs: QuantRuns, profile: Profile | None) -> None:
    """TTFT and TPOT samples; for a quantized run also the per-request TPOT ratio to bf16."""
    lat = quant_runs.run(profile).latency
    n = quant_runs.reference.requests
    assert len(lat.ttft_s) == n and len(lat.tpot_s) == n, "vLLM returned no per-request stats"
    gate.record_samples("ttft", lat.ttft_s, unit="s", tolerance=TTFT_TOLERANCE)
    gate.record_samples("tpot", lat.tpot_s, unit="s", tolerance=TOLERANCE)
    if profile is None:
        return
    ref = quant_runs.run(None).latency
    ratios = [q / r for q, r in zip(lat.tpot_s, ref.tpot_s, strict=True)]
    gate.record_samples("tpot_vs_bf16", ratios, unit="ratio", tolerance=TOLERANCE)
    print(f"{profile.name}: median TPOT {median(lat.tpot_s) * 1e3:.2f} ms vs bf16 "
          f"{median(ref.tpot_s) * 1e3:.2f} ms (median ratio {median(ratios):.2f})")
