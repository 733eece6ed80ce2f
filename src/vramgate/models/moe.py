"""Fused-MoE workspace: vLLM 0.32.0's analytic size and a torch reference with the same buffers (CLAIMS.md item 7).

vLLM's ``fused_experts_impl`` (``model_executor/layers/fused_moe/fused_moe.py``)
computes only the routed (token, expert) pairs. With ``M`` tokens, ``topk``
experts per token, ``w1`` of shape ``{E, N, K}`` (``N = 2 x intermediate`` for
a gated activation) and ``w2`` of ``{E, K, N/2}``, it allocates

- ``cache13``: ``M x topk x max(N, K)`` elements, shared by the first GEMM's
  output (``{M, topk, N}``) and the second's (``{M, topk, K}``);
- ``cache2``: ``M x topk x N/2`` (the activation's output);
- the output ``{M, K}``;

all in the activation dtype. 0.32.0 has no chunking of ``M``. The number of
experts does not appear: only routed pairs get memory. :func:`reference_moe`
computes the same thing in torch with the same two buffers, optionally in
chunks of tokens (a knob earlier vLLM versions had), so the workspace can be
measured on any device. torch is imported when a function that needs it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Rows per gathered block in the reference (bounds its one skew-dependent temporary).
GATHER_BLOCK = 256


@dataclass(frozen=True)
class MoEShape:
    """A routed-experts layer: hidden size K, per-expert intermediate size, experts, experts per token."""

    hidden: int
    intermediate: int
    experts: int
    topk: int

    def __post_init__(self) -> None:
        if min(self.hidden, self.intermediate, self.experts, self.topk) < 1 or self.topk > self.experts:
            raise ValueError(f"bad MoE shape {self}")


def workspace_bytes(shape: MoEShape, tokens: int, dtype_bytes: int, chunk: int | None = None) -> int:
    """Bytes of vLLM's fused-MoE intermediate caches (``cache13`` + ``cache2``) for *tokens* tokens.

    With *chunk*, the workspace is sized by ``min(tokens, chunk)`` tokens.
    """
    m = tokens if chunk is None else min(tokens, chunk)
    n = 2 * shape.intermediate
    rows = m * shape.topk
    return rows * max(n, shape.hidden) * dtype_bytes + rows * shape.intermediate * dtype_bytes


def reference_overhead_bound(shape: MoEShape, tokens: int, dtype_bytes: int, chunk: int | None = None) -> int:
    """Most the reference needs beyond :func:`workspace_bytes`: sort indices, a gather block, sort scratch."""
    m = tokens if chunk is None else min(tokens, chunk)
    rows = m * shape.topk
    return 64 * rows + GATHER_BLOCK * shape.hidden * dtype_bytes + 16 * shape.experts + (2 << 20)


def make_weights(shape: MoEShape, device: str, dtype: Any, seed: int = 0) -> tuple[Any, Any]:
    """``w1 {E, 2I, K}`` and ``w2 {E, K, I}``, seeded, scaled to keep activations small."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.randn(shape.experts, 2 * shape.intermediate, shape.hidden, generator=gen, device=device, dtype=dtype)
    w2 = torch.randn(shape.experts, shape.hidden, shape.intermediate, generator=gen, device=device, dtype=dtype)
    return w1.mul_(shape.hidden**-0.5), w2.mul_(shape.intermediate**-0.5)


def route(shape: MoEShape, tokens: int, device: str, skew: float = 0.0, seed: int = 0) -> tuple[Any, Any]:
    """Top-k expert ids ``{tokens, topk}`` (distinct per token) and weights.

    ``skew = 0`` routes uniformly; ``skew > 0`` draws experts with
    probability proportional to ``1 / rank^skew`` (a few hot experts).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    probs = torch.tensor([1.0 / (e + 1) ** skew for e in range(shape.experts)])
    ids = torch.multinomial(probs.expand(tokens, -1), shape.topk, replacement=False, generator=gen)
    weights = torch.rand(tokens, shape.topk, generator=gen).softmax(-1)
    return ids.to(device), weights.to(device)


def expert_load(ids: Any, experts: int) -> list[int]:
    """Routed (token, expert) pairs per expert."""
    import torch

    return [int(c) for c in torch.bincount(ids.flatten().cpu(), minlength=experts)]


def reference_moe(x: Any, w1: Any, w2: Any, ids: Any, weights: Any, out: Any, chunk: int | None = None) -> Any:
    """Routed experts with vLLM's two workspace buffers, into *out* (``{M, K}``); returns *out*.

    Per chunk of tokens: sort the (token, slot) pairs by expert, run each
    expert's up-projection into ``cache1`` (a view of ``cache13``), the gated
    SiLU into ``cache2``, the down-projection into ``cache3`` (the same
    ``cache13`` memory), scale by the routing weights and scatter-add into
    *out*. Rows are gathered :data:`GATHER_BLOCK` at a time.
    """
    import torch

    tokens, hidden = x.shape
    experts, n, _ = w1.shape
    inter = n // 2
    topk = ids.shape[1]
    out.zero_()
    step = tokens if chunk is None else chunk
    for start in range(0, tokens, step):
        stop = min(tokens, start + step)
        rows = (stop - start) * topk
        flat = ids[start:stop].reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // topk + start
        counts = torch.bincount(flat, minlength=experts).tolist()
        cache13 = torch.empty(rows * max(n, hidden), device=x.device, dtype=x.dtype)
        cache2 = torch.empty(rows, inter, device=x.device, dtype=x.dtype)
        cache1 = cache13[: rows * n].view(rows, n)
        cache3 = cache13[: rows * hidden].view(rows, hidden)
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        for e in range(experts):
            for s in range(offsets[e], offsets[e + 1], GATHER_BLOCK):
                t = min(offsets[e + 1], s + GATHER_BLOCK)
                torch.mm(x[token_of[s:t]], w1[e].t(), out=cache1[s:t])
        torch.sigmoid(cache1[:, :inter], out=cache2)
        cache2.mul_(cache1[:, :inter]).mul_(cache1[:, inter:])
        for e in range(experts):
            s, t = offsets[e], offsets[e + 1]
            if t > s:
                torch.mm(cache2[s:t], w2[e].t(), out=cache3[s:t])
        cache3.mul_(weights[start:stop].reshape(-1)[order].unsqueeze(1).to(x.dtype))
        out.index_add_(0, token_of, cache3)
        del cache13, cache2, cache1, cache3
    return out


def naive_moe(x: Any, w1: Any, w2: Any, ids: Any, weights: Any, out: Any) -> Any:
    """The per-expert loop of a plain implementation (gather each expert's tokens, compute, scatter)."""
    import torch

    inter = w1.shape[1] // 2
    out.zero_()
    for e in range(w1.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ w1[e].t()
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, token, (act @ w2[e].t()) * weights[token, slot].unsqueeze(1).to(x.dtype))
    return out
