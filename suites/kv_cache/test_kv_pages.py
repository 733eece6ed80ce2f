"""KV page bytes and KV capacity, by vLLM 0.32.0's own accounting, against the analytic formula.

Settles CLAIMS.md item 1 in its alignment part: the article says FlashAttention
pads a 64 x 128 = 8192-element KV row to 8448 ("256-byte alignment through
cuBLASLt"). vLLM sizes a page as ``2 x block_size x num_kv_heads x head_size x
dtype`` (full attention) or ``block_size x 576 x dtype`` (MLA), with no padding,
and per-token bytes do not depend on the block size.

The models, block sizes and KV dtypes are the matrix's (docs/matrix.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.testing import ModelLoader
from vramgate.testing.models import ModelShape

GIB = 1 << 30


@pytest.mark.gate_matrix("kv_cache", id="{model}-bs{block_size}-{kv_cache_dtype}")
def test_kv_page_and_capacity(
    gate: Gate, vllm_in_process: Path, model_shape: ModelLoader, model: str, block_size: int, kv_cache_dtype: str
) -> None:
    from vramgate.testing.models import vllm_kv_layout

    shape: ModelShape = model_shape(model)
    layout = vllm_kv_layout(
        model_shape.path(model), block_size=block_size, kv_cache_dtype=kv_cache_dtype, budget_bytes=GIB
    )
    gate.record("page_bytes", layout.page_bytes, unit="B")
    gate.record("bytes_per_token", layout.page_bytes * layout.num_layers // block_size, unit="B/token")
    gate.record("kv_blocks_per_gib", layout.num_blocks, unit="blocks", better="higher")
    gate.record("capacity_tokens_per_gib", layout.capacity_tokens, unit="tokens/GiB", better="higher")

    expected_page = shape.page_bytes(block_size, kv_cache_dtype)
    assert layout.page_bytes == expected_page, (
        f"vLLM's page for {model} (block {block_size}, KV {kv_cache_dtype}) is {layout.page_bytes} B; "
        f"the analytic size is {expected_page} B: vLLM pads or packs differently ({layout.spec}, "
        f"{layout.num_kv_heads} KV heads x head size {layout.head_size}, {layout.dtype})"
    )
    assert layout.num_layers == shape.num_layers
    assert layout.num_blocks == shape.capacity_blocks(GIB, block_size, kv_cache_dtype)
    assert layout.capacity_tokens == shape.capacity_tokens(GIB, block_size, kv_cache_dtype)
    # the whole budget is used but for less than one block (all layers)
    assert 0 <= GIB - layout.kv_bytes < layout.page_bytes * layout.num_layers


@pytest.mark.gate_matrix("kv_cache", id="{model}")
def test_bytes_per_token_do_not_depend_on_block_size(
    vllm_in_process: Path, model_shape: ModelLoader, model: str, block_sizes: tuple[int, ...]
) -> None:
    """The article's table has block size 16 vs 32 change peak memory; per-token KV bytes cannot."""
    from vramgate.testing.models import vllm_kv_layout

    per_token = {
        bs: vllm_kv_layout(model_shape.path(model), block_size=bs).page_bytes // bs for bs in block_sizes
    }
    assert len(set(per_token.values())) == 1, f"per-token bytes by block size: {per_token}"


ARTICLE_HEADS, ARTICLE_HEAD_DIM, ARTICLE_PADDED = 64, 128, 8448


def test_article_alignment_claim(gate: Gate, vllm_in_process: Path) -> None:
    """The article's shape (64 KV heads x 128, bf16, block 16) through vLLM's FullAttentionSpec."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vramgate.testing.machine import software_versions

    block = 16
    spec = FullAttentionSpec(block_size=block, num_kv_heads=ARTICLE_HEADS, head_size=ARTICLE_HEAD_DIM,
                             dtype=torch.bfloat16)
    unpadded = 2 * block * ARTICLE_HEADS * ARTICLE_HEAD_DIM * 2
    padded = 2 * block * ARTICLE_PADDED * 2
    row_bytes = ARTICLE_HEADS * ARTICLE_HEAD_DIM * 2
    gate.record("page_bytes", spec.page_size_bytes, unit="B", ceiling=unpadded)
    gate.claim(
        "FlashAttention-2 pads a 64x128 = 8192-element KV row to 8448 (256-byte alignment), inflating each page",
        held=spec.page_size_bytes == padded,
        evidence=(
            f"vLLM {software_versions().get('vllm', '?')} page (block 16, bf16) = {spec.page_size_bytes:,} B "
            "= 2x16x8192x2, "
            f"claimed {padded:,} B; an 8192-element bf16 row is {row_bytes:,} B = {row_bytes // 256} x 256 B, "
            "already aligned"
        ),
        source="CLAIMS.md item 1",
    )
    assert spec.page_size_bytes == unpadded
