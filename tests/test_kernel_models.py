"""Pure kernel and GPU-state models: attention transients, the MoE workspace, throttle judgement (no torch)."""

from __future__ import annotations

import os
import platform
import sys

import pytest

from vramgate.machine.probes.cpu import pin_mmap_threshold
from vramgate.machine.probes.gpu_state import (
    DISTRUSTED_REASONS,
    REASONS,
    GPUState,
    dram_bandwidth,
    problems,
    reason_names,
)
from vramgate.models.attention import (
    CUDA_MIN_BLOCK,
    TORCH_FLASH_EXTRA,
    AttentionShape,
    cuda_alloc_size,
    explain_splits,
    fa2_num_splits,
    torch_flash_transient_bytes,
)
from vramgate.models.moe import GATHER_BLOCK, MoEShape, reference_overhead_bound, workspace_bytes

H200_SMS = 132
MIB = 2**20

# -- attention: allocator rounding and the split-KV heuristic --------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "allocated"),
    [(0, 0), (-5, 0), (1, 512), (512, 512), (513, 1024), (1024, 1024), (10**9 + 1, 1_000_000_512)],
)
def test_cuda_alloc_size_rounds_up_to_512(nbytes: int, allocated: int) -> None:
    assert cuda_alloc_size(nbytes) == allocated
    assert allocated % CUDA_MIN_BLOCK == 0


def test_fa2_num_splits_is_one_when_the_grid_fills_the_gpu() -> None:
    # 0.8 * 264 = 211.2: at or above it the key sequence is never split
    assert fa2_num_splits(212, 264, 64) == 1
    assert fa2_num_splits(10_000, 264, 1024) == 1
    assert fa2_num_splits(64, 264, 64) > 1


def test_fa2_num_splits_is_bounded_by_key_blocks() -> None:
    assert fa2_num_splits(1, 264, 1) == 1
    for n_blocks in (2, 3, 7, 64):
        assert 1 <= fa2_num_splits(1, 264, n_blocks) <= n_blocks


@pytest.mark.parametrize(("kv_heads", "splits"), [(32, 1), (8, 4), (4, 7), (2, 16)])
def test_fa2_splits_of_gqa_decode_match_h200(kv_heads: int, splits: int) -> None:
    """Split counts torch's FA2 chose on an H200 (132 SMs, torch passes 2 x SMs)."""
    shape = AttentionShape(8, 32, kv_heads, 1, 8192, 128)
    assert shape.fa2_splits(2 * H200_SMS) == splits


# -- attention: the shape ----------------------------------------------------------------------------


def test_attention_shape_rejects_q_heads_not_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match=r"q_heads \(32\) must be a multiple of kv_heads \(5\)"):
        AttentionShape(1, 32, 5, 1, 128, 64)


@pytest.mark.parametrize(
    "field", ["batch", "q_heads", "kv_heads", "q_len", "k_len", "head_size", "dtype_bytes"]
)
def test_attention_shape_rejects_zero_sizes(field: str) -> None:
    sizes = {"batch": 1, "q_heads": 8, "kv_heads": 8, "q_len": 1, "k_len": 16, "head_size": 64, "dtype_bytes": 2}
    sizes[field] = 0
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        AttentionShape(**sizes)


def test_attention_shape_sizes() -> None:
    decode = AttentionShape(8, 32, 8, 1, 8192, 128)
    assert decode.group == 4
    assert decode.kind == "decode"
    assert decode.output_bytes() == 8 * 32 * 1 * 128 * 2
    assert decode.lse_bytes() == 8 * 32 * 1 * 4  # one per query head, fp32
    assert decode.lse_bytes_if_per_kv_head() == 8 * 8 * 4
    assert decode.scores_bytes() == 8 * 32 * 1 * 8192 * 2
    assert decode.scores_bytes(4) == 8 * 32 * 8192 * 4

    prefill = AttentionShape(2, 32, 32, 2048, 2048, 128, dtype_bytes=4)
    assert prefill.group == 1
    assert prefill.kind == "prefill"
    assert prefill.output_bytes() == 2 * 32 * 2048 * 128 * 4
    assert prefill.lse_bytes() == 2 * 32 * 2048 * 4
    assert prefill.scores_bytes() == 2 * 32 * 2048 * 2048 * 4


def test_fa2_grid_swaps_the_query_group_in_gqa_decode() -> None:
    # single-token GQA decode: heads become the KV heads, the query length the group
    assert AttentionShape(8, 32, 8, 1, 8192, 128).fa2_grid() == (8, 4, 64)
    # no swap without grouping, nor for prefill
    assert AttentionShape(8, 32, 32, 1, 8192, 128).fa2_grid() == (32, 1, 64)
    assert AttentionShape(2, 32, 8, 2048, 2048, 128).fa2_grid() == (32, 2048, 16)
    # key block size follows the head size: 256 up to 64, 128 up to 128, else 64
    assert AttentionShape(1, 8, 8, 16, 1000, 64).fa2_grid()[2] == 4
    assert AttentionShape(1, 8, 8, 16, 1000, 256).fa2_grid()[2] == 16


# -- attention: torch's flash transient against H200 measurements ------------------------------------


@pytest.mark.parametrize("kv_heads", [32, 8, 4, 2])
def test_torch_flash_prefill_transient_matches_h200(kv_heads: int) -> None:
    """Prefill fills the GPU: no split, so the transient does not depend on the KV heads."""
    shape = AttentionShape(2, 32, kv_heads, 2048, 2048, 128)
    assert torch_flash_transient_bytes(shape, H200_SMS) == 34_079_744


@pytest.mark.parametrize(
    ("kv_heads", "measured"), [(32, 67_584), (8, 595_968), (4, 992_256), (2, 2_181_120)]
)
def test_torch_flash_decode_transient_matches_h200(kv_heads: int, measured: int) -> None:
    shape = AttentionShape(8, 32, kv_heads, 1, 8192, 128)
    assert torch_flash_transient_bytes(shape, H200_SMS) == measured
    assert shape.fa2_transient_bytes(shape.fa2_splits(2 * H200_SMS)) + TORCH_FLASH_EXTRA == measured


def test_explain_splits() -> None:
    shape = AttentionShape(8, 32, 8, 1, 8192, 128)
    assert explain_splits(595_968, shape) == 4
    assert explain_splits(67_584, AttentionShape(8, 32, 32, 1, 8192, 128)) == 1
    assert explain_splits(595_968 + 512, shape) is None
    assert explain_splits(123, shape) is None


def test_accumulators_only_with_splits() -> None:
    shape = AttentionShape(8, 32, 8, 1, 8192, 128)
    assert shape.fa2_accumulator_bytes(1) == 0
    assert shape.fa2_accumulator_bytes(4) == 4 * 256 * 128 * 4 + 4 * 256 * 4


def test_dram_bandwidth() -> None:
    # H200: 3201 MHz HBM3e on a 6144-bit bus
    assert dram_bandwidth(3201, 6144) == pytest.approx(4.92e12, rel=1e-3)
    assert dram_bandwidth(3201, 6144, transfers_per_clock=1) == pytest.approx(4.92e12 / 2, rel=1e-3)


@pytest.mark.parametrize(("clock", "width"), [(0, 6144), (-1, 6144), (3201, 0), (3201, -64)])
def test_dram_bandwidth_rejects_non_positive_input(clock: float, width: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        dram_bandwidth(clock, width)


# -- MoE workspace --------------------------------------------------------------------------------------

LITE = MoEShape(hidden=2048, intermediate=1408, experts=64, topk=6)  # DeepSeek-V2-Lite's routed experts


@pytest.mark.parametrize(
    ("hidden", "intermediate", "experts", "topk"),
    [(2048, 1408, 4, 6), (0, 1408, 64, 6), (2048, 0, 64, 6), (2048, 1408, 0, 1), (2048, 1408, 64, 0)],
    ids=["topk-over-experts", "hidden", "intermediate", "experts", "topk"],
)
def test_moe_shape_validation(hidden: int, intermediate: int, experts: int, topk: int) -> None:
    with pytest.raises(ValueError, match="bad MoE shape"):
        MoEShape(hidden, intermediate, experts, topk)


def test_moe_shape_topk_equal_to_experts_is_fine() -> None:
    assert MoEShape(16, 8, 4, 4).topk == 4


def test_workspace_bytes_of_deepseek_v2_lite() -> None:
    assert workspace_bytes(LITE, 16384, 2) == 830_472_192


def test_workspace_bytes_formula() -> None:
    # cache13 holds max(2I, K) per routed row: here K wins
    wide = MoEShape(hidden=4096, intermediate=1024, experts=8, topk=2)
    assert workspace_bytes(wide, 10, 2) == 10 * 2 * 4096 * 2 + 10 * 2 * 1024 * 2
    assert workspace_bytes(LITE, 10, 4) == 10 * 6 * 2816 * 4 + 10 * 6 * 1408 * 4
    assert workspace_bytes(LITE, 0, 2) == 0


def test_workspace_bytes_with_chunk_uses_the_smaller_count() -> None:
    assert workspace_bytes(LITE, 16384, 2, chunk=4096) == workspace_bytes(LITE, 4096, 2)
    assert workspace_bytes(LITE, 1000, 2, chunk=4096) == workspace_bytes(LITE, 1000, 2)


def test_workspace_bytes_does_not_depend_on_expert_count() -> None:
    sizes = {workspace_bytes(MoEShape(2048, 1408, experts, 6), 16384, 2) for experts in (6, 64, 160, 256)}
    assert sizes == {830_472_192}


def test_reference_overhead_bound_grows_with_rows() -> None:
    small = reference_overhead_bound(LITE, 1024, 2)
    large = reference_overhead_bound(LITE, 16384, 2)
    assert large - small == 64 * (16384 - 1024) * 6
    assert small >= GATHER_BLOCK * LITE.hidden * 2 + (2 << 20)
    assert reference_overhead_bound(LITE, 16384, 2, chunk=1024) == small


# -- GPU state: throttle reasons and foreign processes ------------------------------------------------


def test_reason_names() -> None:
    assert reason_names(0) == []
    assert reason_names(0x1) == ["gpu idle"]
    assert reason_names(0x4 | 0x8) == ["SW power cap", "HW slowdown"]
    assert reason_names(0x1000 | 0x40) == ["HW thermal slowdown", "unknown 0x1000"]
    assert reason_names(sum(REASONS)) == list(REASONS.values())


def state(reasons: tuple[str, ...] = (), processes: dict[int, int] | None = None, index: int = 0) -> GPUState:
    return GPUState(index, 1200, 1980, 3201, 65, reasons, processes or {})


ME = os.getpid()
OWN = {ME, ME + 1}
FOREIGN = 4_000_000_001  # beyond any pid_max


@pytest.mark.parametrize(
    "reasons", [(), ("gpu idle",), ("SW power cap",), ("applications clocks setting", "sync boost")]
)
def test_no_problems_when_idle_or_power_capped(reasons: tuple[str, ...]) -> None:
    assert problems([state(reasons, {ME: MIB}), state(reasons, {ME: MIB})], OWN) == []


def test_distrusted_reasons_flag_once_each() -> None:
    states = [state(("HW slowdown", "SW power cap")), state(("HW slowdown", "HW thermal slowdown"))]
    out = problems(states, OWN)
    assert out == [
        "GPU 0 throttled (HW slowdown) at 1200 MHz of 1980 MHz",
        "GPU 0 throttled (HW thermal slowdown) at 1200 MHz of 1980 MHz",
    ]


@pytest.mark.parametrize("reason", sorted(DISTRUSTED_REASONS))
def test_every_distrusted_reason_flags(reason: str) -> None:
    assert problems([state((reason,), index=3)], OWN) == [f"GPU 3 throttled ({reason}) at 1200 MHz of 1980 MHz"]


def test_foreign_pid_flagged_own_pids_not() -> None:
    processes = {ME: 2 * MIB, ME + 1: MIB, FOREIGN: 300 * MIB}
    out = problems([state(processes=processes), state(processes=processes)], OWN)
    assert out == [f"another process (pid {FOREIGN}, 300 MiB) is using GPU 0"]


def test_container_one_listed_process_is_taken_as_ours() -> None:
    assert problems([state(processes={FOREIGN: MIB})], OWN) == []


def test_container_more_listed_processes_are_others() -> None:
    listed = {FOREIGN: MIB, FOREIGN + 1: MIB, FOREIGN + 2: MIB}
    out = problems([state(processes=listed), state(processes=listed)], OWN)
    assert len(out) == 1
    assert out[0].startswith("2 other process(es) are using GPU 0 (NVML pids ")
    assert str(sorted(listed)) in out[0]


def test_gpu_state_to_json_makes_process_keys_strings() -> None:
    data = state(("gpu idle", "SW power cap"), {ME: 5}).to_json()
    assert data["processes"] == {str(ME): 5}
    assert data["reasons"] == ["gpu idle", "SW power cap"]
    assert data["index"] == 0 and data["sm_clock_mhz"] == 1200 and data["temperature_c"] == 65


# -- CPU probe --------------------------------------------------------------------------------------------


def test_pin_mmap_threshold_returns_bool() -> None:
    pinned = pin_mmap_threshold()
    assert isinstance(pinned, bool)
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        assert pinned
