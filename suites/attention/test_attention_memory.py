"""Transient memory of one attention call, per backend, against its analytic size (CLAIMS.md items 1 and 4).

On CUDA the caching allocator's peak is exact: one call's peak minus what was
allocated before it is the memory the call itself needed. FlashAttention-2
(torch's ``flash`` SDPA backend) needs the output, the log-sum-exp (fp32, one
per query head) and, on split-KV decode shapes, fp32 accumulators; the math
backend materializes the ``Sq x Sk`` score matrix. On CPU the process's peak
resident memory shows the same difference between the math and flash backends.
"""

from __future__ import annotations

from typing import Any

import pytest

from vramgate import Gate
from vramgate.testing.machine import PeakRSS
from vramgate.testing.models import TORCH_FLASH_EXTRA, AttentionShape, explain_splits, torch_flash_transient_bytes

torch = pytest.importorskip("torch")

BACKENDS = ["math", "flash", "efficient", "cudnn"]
RATIOS = [1, 4, 8, 16]
Q_HEADS = 32
HEAD_SIZE = 128


def shape_for(kind: str, ratio: int) -> AttentionShape:
    kv_heads = Q_HEADS // ratio
    if kind == "prefill":
        return AttentionShape(2, Q_HEADS, kv_heads, 2048, 2048, HEAD_SIZE)
    return AttentionShape(8, Q_HEADS, kv_heads, 1, 8192, HEAD_SIZE)


def make_inputs(shape: AttentionShape, device: str, dtype: Any) -> tuple[Any, Any, Any]:
    """q, k, v as ``{B, H, S, d}`` views of ``{B, S, H, d}`` storage (the layout FlashAttention reads)."""
    gen = torch.Generator(device=device).manual_seed(0)

    def one(heads: int, length: int) -> Any:
        t = torch.randn(shape.batch, length, heads, shape.head_size, device=device, dtype=dtype, generator=gen)
        return t.transpose(1, 2)

    return one(shape.q_heads, shape.q_len), one(shape.kv_heads, shape.k_len), one(shape.kv_heads, shape.k_len)


def sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[name]


def run_sdpa(q: Any, k: Any, v: Any, backend: str, gqa: bool) -> Any:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(sdpa_backend(backend)), torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


@pytest.mark.requires_gpus(1)
@pytest.mark.parametrize("kind", ["prefill", "decode"])
@pytest.mark.parametrize("ratio", RATIOS, ids=lambda r: f"gqa{r}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_attention_transient(gate: Gate, backend: str, ratio: int, kind: str) -> None:
    """Allocator peak of one SDPA call minus its inputs, per backend, GQA ratio and phase."""
    from vramgate.testing.machine import CudaRegion

    shape = shape_for(kind, ratio)
    q, k, v = make_inputs(shape, "cuda", torch.bfloat16)
    try:
        run_sdpa(q, k, v, backend, ratio > 1)  # warm-up: handles, workspaces, plans outside the region
    except RuntimeError as exc:
        reason = str(exc).splitlines()[0]
        del q, k, v  # the skip's traceback must not keep the inputs alive
        pytest.skip(f"torch {torch.__version__} SDPA backend {backend} refuses {shape.label()}: {reason}")
    torch.cuda.synchronize()
    with CudaRegion() as region:
        out = run_sdpa(q, k, v, backend, ratio > 1)
    del out
    measured = region.peak_delta_bytes
    gate.record("peak_delta_bytes", measured, unit="B", scope="machine")
    assert measured >= shape.output_bytes(), f"{backend}: peak {measured:,} B is less than its output"
    if backend == "math":
        # The math backend's score matrix (and softmax of it) is the S x S materialization.
        assert measured >= shape.scores_bytes(), (
            f"math backend peak {measured:,} B is below its {shape.scores_bytes():,} B score matrix")
        gate.record("scores_share", round(shape.scores_bytes() / measured, 4), unit="ratio", scope="machine")
    elif kind == "prefill":
        assert measured < shape.scores_bytes(), (
            f"{backend} peak {measured:,} B reaches the {shape.scores_bytes():,} B an S x S matrix would take")
    if backend == "flash":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        predicted = torch_flash_transient_bytes(shape, sms)
        splits = shape.fa2_splits(2 * sms)
        found = explain_splits(measured, shape)
        gate.record("analytic_bytes", predicted, unit="B", scope="machine")
        gate.record("splits", splits, unit="count", scope="machine")
        accumulators = f" + split-KV accumulators {shape.fa2_accumulator_bytes(splits):,}" if splits > 1 else ""
        gate.claim(
            "A FlashAttention call's transient memory is output + LSE (+ split-KV accumulators), exactly",
            held=measured == predicted,
            evidence=(
                f"{shape.label()} ({kind}), {sms} SMs: measured {measured:,} B; analytic: output "
                f"{shape.output_bytes():,} + LSE {shape.lse_bytes():,}{accumulators} ({splits} split(s) by FA2's "
                f"heuristic) + torch's RNG state {TORCH_FLASH_EXTRA:,} = {predicted:,} B"
                + ("" if found is None or found == splits else f"; the measurement fits {found} splits")
            ),
            source="CLAIMS.md item 4",
        )
        assert measured == predicted, (
            f"flash transient {measured:,} B differs from the analytic {predicted:,} B by {measured - predicted:,} B"
            + (f" (it fits {found} splits, the heuristic says {splits})" if found else ""))


def lse_of(q: Any, k: Any, v: Any) -> Any:
    """The log-sum-exp torch's flash kernel returns, ``{B, Hq, Sq}`` fp32 (k, v expanded to query heads)."""
    if q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[1]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[1]


def test_lse_is_per_query_head(gate: Gate) -> None:
    """The article's "LSE sized by query heads is 4x waste" (CLAIMS.md item 4), measured on this device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shape = AttentionShape(1, 32, 8, 256, 256, HEAD_SIZE, dtype_bytes=2 if device == "cuda" else 4)
    q, k, v = make_inputs(shape, device, dtype)
    k = k.repeat_interleave(shape.group, dim=1)
    v = v.repeat_interleave(shape.group, dim=1)
    with torch.no_grad():
        lse = lse_of(q, k, v).float()
    assert tuple(lse.shape[:2]) == (shape.batch, shape.q_heads), f"LSE shape {tuple(lse.shape)}"
    # Within each GQA group the query heads share K and V; do they share the LSE too?
    grouped = lse[:, : shape.q_heads].reshape(shape.batch, shape.kv_heads, shape.group, -1)
    spread = (grouped - grouped[:, :, :1]).abs().amax().item()
    shared = spread == 0.0
    transient = shape.output_bytes() + shape.lse_bytes()
    saving = shape.lse_bytes() - shape.lse_bytes_if_per_kv_head()
    gate.record("lse_bytes", int(lse.numel() * 4), unit="B", scope="machine")
    gate.record("lse_share_of_transient", round(shape.lse_bytes() / transient, 6), unit="ratio", scope="machine")
    gate.claim(
        "FlashAttention sizes the LSE by query heads instead of KV heads under GQA: 4x waste",
        held=shared,
        evidence=(
            f"{device}, {shape.label()}: LSE is {tuple(lse.shape)} fp32 = {lse.numel() * 4:,} B, one per query "
            f"head; query heads of one KV group differ by up to {spread:.3g} in LSE, so it cannot be shared; "
            f"it is {shape.lse_bytes() / transient:.2%} of output+LSE, and sizing it by KV heads would save "
            f"{saving:,} B ({saving / transient:.2%})"
        ),
        source="CLAIMS.md item 4",
    )


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_cpu_attention_peak(gate: Gate, backend: str) -> None:
    """Peak resident memory of one CPU SDPA prefill: math materializes the score matrix, flash does not."""
    shape = AttentionShape(1, 8, 8, 2048, 2048, 64, dtype_bytes=4)
    q, k, v = make_inputs(shape, "cpu", torch.float32)
    run_sdpa(q[:, :, :64], k[:, :, :64], v[:, :, :64], backend, False)  # warm-up: thread pools, kernels
    with PeakRSS() as probe:
        out = run_sdpa(q, k, v, backend, False)
    del out
    if not probe.reset_ok:
        pytest.skip("this kernel refuses to reset the process's peak RSS (clear_refs): no region peak")
    scores = shape.scores_bytes()
    if backend == "math":
        gate.record("peak_delta_bytes", probe.delta_bytes, unit="B", tolerance=0.25, scope="machine")
        assert probe.delta_bytes >= scores, (
            f"math backend peak {probe.delta_bytes:,} B is below its {scores:,} B score matrix")
    else:
        # A few pages either way are noise here: gate the share of the score matrix it avoided.
        gate.record("scores_avoided", round(1 - probe.delta_bytes / scores, 3), unit="ratio", better="higher",
                    tolerance=0.05, scope="machine")
        assert probe.delta_bytes < scores // 4, (
            f"flash backend peak {probe.delta_bytes:,} B is not well below the {scores:,} B score matrix")
