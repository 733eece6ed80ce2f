"""Memory of CUDA graphs captured for a decode step, and of replaying them at dynamic batch sizes (CLAIMS.md item 5).

vLLM captures one graph per batch size, largest first, all in one shared
memory pool, and at run time pads each batch to the next captured size and
replays. A replay allocates nothing: the graph's memory is fixed at capture.
The article's "peak at runtime 29% above what was captured" is measured here
directly: the allocator's (and the driver's) peak while replaying a seeded
stream of dynamic batch sizes, against the memory the captures took.
"""

from __future__ import annotations

import bisect
import random
from typing import Any

import pytest

from vramgate import Gate

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.requires_gpus(1)

HIDDEN = 4096
INTERMEDIATE = 14336
SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
STEPS = 200


class DecodeStep:
    """An MLP block as one decode step: ``x + down(gelu(up(x)))``, bf16, fixed weights."""

    def __init__(self) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.up = torch.randn(INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.01
        self.down = torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.01

    def __call__(self, x: Any) -> Any:
        h = torch.nn.functional.gelu(x @ self.up.t())
        return x + h @ self.down.t()


class Captured:
    """One graph per batch size, with its static input and output."""

    def __init__(self, step: DecodeStep, sizes: list[int], shared: bool) -> None:
        self.sizes = sorted(sizes)
        self.graphs: dict[int, Any] = {}
        self.inputs: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.capture_bytes: dict[int, int] = {}
        pool = torch.cuda.graph_pool_handle() if shared else None
        stream = torch.cuda.Stream()
        for size in sorted(sizes, reverse=True):  # vLLM's order: largest first, so smaller ones reuse its blocks
            x = torch.zeros(size, HIDDEN, device="cuda", dtype=torch.bfloat16)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                step(x)  # warm-up on the capture stream (cuBLAS handle and workspace for that stream)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # torch.cuda.graph empties the cache on entry: do it before measuring
            before = torch.cuda.memory_reserved()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = step(x)
            torch.cuda.synchronize()
            self.capture_bytes[size] = torch.cuda.memory_reserved() - before
            self.graphs[size], self.inputs[size], self.outputs[size] = graph, x, out

    def run(self, x: Any) -> Any:
        """Pad *x* to the next captured size, replay that graph, return the rows of *x*."""
        size = self.sizes[bisect.bisect_left(self.sizes, x.shape[0])]
        self.inputs[size][: x.shape[0]].copy_(x)
        self.graphs[size].replay()
        return self.outputs[size][: x.shape[0]]

    def release(self) -> None:
        self.graphs.clear()
        self.inputs.clear()
        self.outputs.clear()


#: Relative tolerance of NVML's device-used figure (see test_capture_memory).
DRIVER_USED_TOLERANCE = 1.0


@pytest.fixture
def step() -> DecodeStep:
    """The decode step's weights (per test, so each test leaves the device as it found it)."""
    return DecodeStep()


def _device_used() -> int | None:
    from vramgate.testing.machine import NVMLUnavailable, read_device

    try:
        return read_device(0).used_bytes
    except NVMLUnavailable:
        return None


@pytest.mark.parametrize("pool", ["private", "shared"])
def test_capture_memory(gate: Gate, step: DecodeStep, pool: str) -> None:
    """Reserved memory of capturing every batch size: one private pool per graph vs vLLM's shared pool."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved0, used0 = torch.cuda.memory_reserved(), _device_used()
    graphs = Captured(step, SIZES, shared=pool == "shared")
    reserved = torch.cuda.memory_reserved() - reserved0
    used = _device_used()
    largest = max(SIZES)
    activations = largest * (2 * INTERMEDIATE + 2 * HIDDEN) * 2
    gate.record("graph_reserved_bytes", reserved, unit="B", scope="machine")
    gate.record("largest_capture_bytes", graphs.capture_bytes[largest], unit="B", scope="machine")
    if used is not None and used0 is not None:
        # NVML's device-wide figure also holds what the CUDA context loads lazily: two runs on one H200 read
        # 162 MiB and 298 MiB for the same captures. It gates gross changes only; the allocator's figures are exact.
        gate.record("driver_used_bytes", used - used0, unit="B", tolerance=DRIVER_USED_TOLERANCE, scope="machine")
    print({s: graphs.capture_bytes[s] for s in SIZES})
    assert graphs.capture_bytes[largest] >= largest * INTERMEDIATE * 2, "the largest capture holds its activations"
    if pool == "shared":
        # Smaller graphs reuse the largest one's blocks: all sizes together cost about one largest capture.
        smaller = sum(b for s, b in graphs.capture_bytes.items() if s != largest)
        gate.record("smaller_captures_bytes", smaller, unit="B", scope="machine")
        assert reserved < 2 * activations + (64 << 20), (
            f"shared pool reserved {reserved:,} B for {len(SIZES)} graphs; the largest needs ~{activations:,} B")
    graphs.release()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_replay_dynamic_batch_peak(gate: Gate, step: DecodeStep) -> None:
    """Memory while replaying a seeded stream of batch sizes 1..512, against the memory the captures took."""
    from vramgate.testing.machine import CudaRegion

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved0 = torch.cuda.memory_reserved()
    graphs = Captured(step, SIZES, shared=True)
    torch.cuda.synchronize()
    captured = torch.cuda.memory_reserved() - reserved0
    rng = random.Random(0)
    batches = [rng.randint(1, max(SIZES)) for _ in range(STEPS)]
    inputs = {b: torch.randn(b, HIDDEN, device="cuda", dtype=torch.bfloat16) for b in set(batches)}
    torch.cuda.synchronize()
    reserved_before, used_before = torch.cuda.memory_reserved(), _device_used()
    with CudaRegion() as replay:
        for b in batches:
            out = graphs.run(inputs[b])
    growth = max(replay.peak_delta_bytes, torch.cuda.memory_reserved() - reserved_before)
    used_after = _device_used()
    check = step(inputs[batches[-1]])
    assert torch.allclose(out.float(), check.float(), atol=2e-2, rtol=2e-2), "replayed graph output differs"
    del out, check
    with CudaRegion() as eager:
        for b in batches:
            step(inputs[b])
    gate.record("captured_reserved_bytes", captured, unit="B", scope="machine")
    gate.record("replay_growth_bytes", growth, unit="B", scope="machine")
    gate.record("eager_peak_delta_bytes", eager.peak_delta_bytes, unit="B", scope="machine")
    driver = "" if used_before is None or used_after is None else (
        f"; driver-level use changed by {(used_after - used_before) / 2**20:+.0f} MiB")
    gate.claim(
        "With dynamic batch sizes, CUDA graphs' runtime peak is 29% above what was captured",
        held=growth >= 0.29 * captured,
        evidence=f"{len(SIZES)} graphs (batch 1..{max(SIZES)}, shared pool) reserved {captured / 2**20:.1f} MiB; "
                 f"{STEPS} replays at seeded sizes 1..{max(SIZES)} (padded to the next captured size) grew the "
                 f"allocator's peak or reservation by {growth:,} B ({growth / captured:.2%}){driver}; the same "
                 f"stream run eagerly peaks {eager.peak_delta_bytes / 2**20:.1f} MiB above its start",
        source="CLAIMS.md item 5",
    )
    graphs.release()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
