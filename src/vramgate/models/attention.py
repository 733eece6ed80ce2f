"""Analytic memory of one attention call, for the attention suite (CLAIMS.md items 1 and 4).

An attention call's transient memory (what it allocates beyond its inputs) is,
for FlashAttention-2 (also the kernel behind torch's ``flash`` SDPA backend):

- the output ``{B, Sq, Hq, d}`` in the input dtype;
- the softmax log-sum-exp ``{B, Hq, Sq}`` fp32: one per *query* head, since
  every query head has its own softmax;
- when the split-KV path is taken (decode-like shapes that do not fill the
  GPU), accumulators ``{splits, B, Hq, Sq, d_rounded}`` and
  ``{splits, B, Hq, Sq}`` fp32, with ``splits`` from
  :func:`fa2_num_splits`.

The math backend instead materializes the ``{B, Hq, Sq, Sk}`` score matrix
(and its softmax). Each allocation is rounded up by the CUDA caching
allocator to a multiple of 512 bytes (:func:`cuda_alloc_size`). Pure Python:
no torch needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The CUDA caching allocator rounds every block up to a multiple of this.
CUDA_MIN_BLOCK = 512

#: torch's flash SDPA also returns its RNG state (seed and offset): two small device tensors.
TORCH_FLASH_EXTRA = 2 * CUDA_MIN_BLOCK


def cuda_alloc_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts as allocated for a request of *nbytes*."""
    if nbytes <= 0:
        return 0
    return max(CUDA_MIN_BLOCK, CUDA_MIN_BLOCK * math.ceil(nbytes / CUDA_MIN_BLOCK))


def fa2_num_splits(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention-2's split-KV heuristic (``num_splits_heuristic`` in its ``flash_api.cpp``).

    Splits the key sequence across thread blocks only when the
    ``batch x heads x query-blocks`` grid would leave SMs idle; picks the
    smallest split count whose wave efficiency is within 85% of the best.
    """
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def ceildiv(a: int, b: int) -> int:
        return -(-a // b)

    def eligible(n: int) -> bool:
        return n == 1 or ceildiv(num_n_blocks, n) != ceildiv(num_n_blocks, n - 1)

    efficiency: list[float] = []
    for n in range(1, max_splits + 1):
        if not eligible(n):
            efficiency.append(0.0)
            continue
        waves = batch_nheads_mblocks * n / num_sms
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency, default=0.0)
    for n in range(1, max_splits + 1):
        if eligible(n) and efficiency[n - 1] >= 0.85 * best:
            return n
    return 1


@dataclass(frozen=True)
class AttentionShape:
    """One attention call: batch, query/KV heads, query/key lengths, head size, element size."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_size: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("batch", "q_heads", "kv_heads", "q_len", "k_len", "head_size", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def group(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.q_heads // self.kv_heads

    @property
    def kind(self) -> str:
        """``decode`` for a one-token query, else ``prefill``."""
        return "decode" if self.q_len == 1 else "prefill"

    def input_bytes(self) -> int:
        """Bytes of q, k and v."""
        q = self.batch * self.q_heads * self.q_len * self.head_size
        kv = 2 * self.batch * self.kv_heads * self.k_len * self.head_size
        return (q + kv) * self.dtype_bytes

    def output_bytes(self) -> int:
        """Bytes of the attention output: ``{B, Hq, Sq, d}`` in the input dtype."""
        return self.batch * self.q_heads * self.q_len * self.head_size * self.dtype_bytes

    def lse_bytes(self) -> int:
        """The softmax log-sum-exp: fp32, one per query head and query position."""
        return self.batch * self.q_heads * self.q_len * 4

    def lse_bytes_if_per_kv_head(self) -> int:
        """What the log-sum-exp would take if it were sized by KV heads (the article's proposal)."""
        return self.batch * self.kv_heads * self.q_len * 4

    def scores_bytes(self, dtype_bytes: int | None = None) -> int:
        """The ``{B, Hq, Sq, Sk}`` score matrix the math backend materializes."""
        return self.batch * self.q_heads * self.q_len * self.k_len * (dtype_bytes or self.dtype_bytes)

    # -- FlashAttention-2 -------------------------------------------------------

    def fa2_head_size_rounded(self) -> int:
        """The head size FA2 pads to: a multiple of 32 up to 128, of 64 above."""
        step = 32 if self.head_size <= 128 else 64
        return -(-self.head_size // step) * step

    def fa2_grid(self) -> tuple[int, int, int]:
        """(heads, query length, key blocks) as FA2 sees them.

        For single-token GQA decode FA2 swaps the query group into the
        sequence dimension (``seqlenq_ngroups_swapped``): heads become the KV
        heads and the query length the group size.
        """
        heads, q_len = self.q_heads, self.q_len
        if self.q_len == 1 and self.group > 1:
            heads, q_len = self.kv_heads, self.group
        block_n = 256 if self.head_size <= 64 else (128 if self.head_size <= 128 else 64)
        return heads, q_len, -(-self.k_len // block_n)

    def fa2_splits(self, num_sms: int) -> int:
        """The number of KV splits FA2's heuristic picks for this shape on a GPU with *num_sms* SMs."""
        heads, q_len, n_blocks = self.fa2_grid()
        m_blocks = -(-q_len // 64)
        return fa2_num_splits(self.batch * heads * m_blocks, num_sms, n_blocks)

    def fa2_accumulator_bytes(self, splits: int) -> int:
        """The split-KV accumulators (output and LSE, fp32) for *splits* splits (0 when splits is 1)."""
        if splits <= 1:
            return 0
        rows = self.batch * self.q_heads * self.q_len
        return cuda_alloc_size(splits * rows * self.fa2_head_size_rounded() * 4) + cuda_alloc_size(splits * rows * 4)

    def fa2_transient_bytes(self, splits: int = 1) -> int:
        """Allocator bytes of one FA2 forward: output + LSE (+ split-KV accumulators)."""
        return (
            cuda_alloc_size(self.output_bytes())
            + cuda_alloc_size(self.lse_bytes())
            + self.fa2_accumulator_bytes(splits)
        )

    def read_bytes(self) -> int:
        """Bytes an attention call must move at least: read q, k, v and write the output."""
        return self.input_bytes() + self.output_bytes()

    def flops(self) -> int:
        """Multiply-adds x 2 of QK^T and PV (no causal mask)."""
        return 4 * self.batch * self.q_heads * self.q_len * self.k_len * self.head_size

    def label(self) -> str:
        """A short label: batch, query and KV heads, query and key lengths, head size."""
        return (
            f"B{self.batch} Hq{self.q_heads}/Hkv{self.kv_heads} Sq{self.q_len} Sk{self.k_len} "
            f"d{self.head_size}"
        )


def torch_flash_transient_bytes(shape: AttentionShape, num_sms: int) -> int:
    """Allocator bytes of one call of torch's flash SDPA backend on a GPU with *num_sms* SMs.

    FA2's transient with the split count its heuristic picks (torch's vendored
    FA2 passes twice the SM count) plus :data:`TORCH_FLASH_EXTRA`.
    """
    return shape.fa2_transient_bytes(shape.fa2_splits(2 * num_sms)) + TORCH_FLASH_EXTRA


def explain_splits(measured: int, shape: AttentionShape, extra: int = TORCH_FLASH_EXTRA,
                   max_splits: int = 128) -> int | None:
    """The split count whose FA2 transient (+ *extra*) equals *measured* bytes exactly, or None."""
    for splits in range(1, max_splits + 1):
        if shape.fa2_transient_bytes(splits) + extra == measured:
            return splits
    return None
