"""Attention latency on CUDA (events, warm-up, L2 flushed) and decode's achieved memory bandwidth.

Decode attention reads the whole KV of every sequence once per step, so its
speed is a memory-bandwidth figure: bytes moved / time, as a fraction of the
device's theoretical peak (NVML: memory clock x bus width). Each measurement is
guarded: taken under throttling or another process's load it is flagged.
"""

from __future__ import annotations

import statistics

import pytest

from vramgate import Gate
from vramgate.testing.models import AttentionShape

torch = pytest.importorskip("torch")

SAMPLES = 30
#: Latency against a baseline from another process: ``scripts/gpu-calibrate.sh`` on an H200 (8 processes,
#: 22,400 cross-process comparisons of 30-sample flash-decode sets) gave false alarms of 12.7% at a 10%
#: tolerance, 2.0% at 20% and none at 30%. Finer changes need a paired comparison (gate.record_paired).
GPU_LATENCY_TOLERANCE = 0.3
CASES = {
    "decode-gqa4-8k": AttentionShape(32, 32, 8, 1, 8192, 128),
    "decode-mha-4k": AttentionShape(16, 32, 32, 1, 4096, 128),
    "prefill-gqa4-4k": AttentionShape(1, 32, 8, 4096, 4096, 128),
}


def quantiles(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return f"p50 {q[49] * 1e6:.1f} us, p90 {q[89] * 1e6:.1f} us, p99 {q[98] * 1e6:.1f} us"


@pytest.mark.requires_gpus(1)
@pytest.mark.parametrize("case", list(CASES))
def test_flash_attention_latency(gate: Gate, case: str) -> None:
    """Latency of torch's flash SDPA backend; decode cases also record bandwidth as a fraction of peak."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vramgate.testing.machine import NVMLUnavailable, device_peak_bandwidth, time_cuda

    shape = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(heads: int, length: int) -> object:
        return torch.randn(shape.batch, length, heads, shape.head_size, device="cuda", dtype=torch.bfloat16,
                           generator=gen).transpose(1, 2)

    q, k, v = rand(shape.q_heads, shape.q_len), rand(shape.kv_heads, shape.k_len), rand(shape.kv_heads, shape.k_len)

    def call() -> object:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=shape.group > 1)

    with gate.gpu_guard():
        samples = time_cuda(call, samples=SAMPLES, warmup=5, flush_l2=True)
    print(f"{case}: {shape.label()}: {quantiles(samples)}")
    gate.record_samples("latency_s", samples, unit="s", tolerance=GPU_LATENCY_TOLERANCE)
    if shape.kind == "decode":
        try:
            peak = device_peak_bandwidth(0)
        except NVMLUnavailable as exc:
            print(f"bandwidth fraction left out: it needs the device's peak from NVML: {exc}")
            return
        fractions = [shape.read_bytes() / t / peak for t in samples]
        gate.record_samples("bandwidth_fraction", fractions, unit="ratio", better="higher", floor=0.05,
                            tolerance=GPU_LATENCY_TOLERANCE)
        print(f"{case}: {shape.read_bytes() / statistics.median(samples) / 1e12:.2f} TB/s of {peak / 1e12:.2f} TB/s")
    else:
        tflops = [shape.flops() / t / 1e12 for t in samples]
        print(f"{case}: {statistics.median(tflops):.1f} TFLOP/s")
