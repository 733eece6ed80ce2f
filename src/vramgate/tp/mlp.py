"""One rank's shard of a tensor-parallel MLP block and the variants that run it (torch, handed in).

The block is Megatron's sequence-parallel MLP: each rank holds a sequence
shard of the input ``x`` (``tokens / w`` rows); the shards are all-gathered,
multiplied by the rank's column-parallel gate/up weights (``hidden x 2I/w``),
put through SiLU-and-multiply, multiplied by the row-parallel down weights
(``I/w x hidden``), and the partial outputs reduce-scattered back to sequence
shards. Variants:

``sync``
    all-gather, then the matmuls, then the reduce-scatter, each collective
    blocking (what a plain layer does).
``overlap``
    the same tensors, with the collectives issued asynchronously and
    decomposed as torch's fused all-gather-matmul decomposes them: the rank's
    own rows are multiplied while the other ranks' rows arrive (one async
    broadcast per source rank and chunk, in one global order), and each block
    of the down projection is reduced to its owner asynchronously while the
    next block is computed.
``fused`` (CUDA)
    ``torch.ops.symm_mem.fused_all_gather_matmul`` and
    ``fused_matmul_reduce_scatter`` (torch's symmetric-memory async TP).

Note [equal tensors]: every variant allocates the gathered input, the
gate/up output, the activation and the down projection's output at full
sequence length, as the plain layer does, so a difference in peak memory is
what the variant's collectives cost or save (the transport's own buffers,
tensors held by in-flight collectives), not a smaller activation.
"""

from __future__ import annotations

import warnings
from typing import Any

from vramgate.tp.spec import TPSpec


def _wait_all(works: list[Any]) -> None:
    """Wait for every work handle (no handle outlives this call here: each keeps its tensor alive)."""
    for work in works:
        work.wait()


class ShardedMLP:
    """One rank's shard of the MLP block, its input shard, and the variants' step functions."""

    def __init__(self, spec: TPSpec, rank: int, torch: Any, dist: Any) -> None:
        self.spec, self.rank, self.torch, self.dist = spec, rank, torch, dist
        self.w = spec.world_size
        shape = spec.shape
        self.tokens, self.hidden = shape.tokens, shape.hidden
        self.local_inter = shape.intermediate // self.w
        self.local_tokens = shape.tokens // self.w
        self.chunk_rows = self.local_tokens // spec.chunks
        self.dtype = getattr(torch, spec.dtype)
        self.device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")
        self.own = slice(rank * self.local_tokens, (rank + 1) * self.local_tokens)
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.reference = self._build()
        self.group_name = ""

    def _build(self) -> Any:
        """Draw the full weights and input (equal on every rank), keep this rank's shards, return its reference rows."""
        torch, spec = self.torch, self.spec
        gen = torch.Generator(device=self.device).manual_seed(spec.seed)
        h, inter, i_loc = self.hidden, spec.shape.intermediate, self.local_inter

        def draw(*size: int, scale: float) -> Any:
            return (torch.randn(*size, generator=gen, device=self.device, dtype=torch.float32) * scale).to(self.dtype)

        x = draw(self.tokens, h, scale=1.0)
        gate_up = draw(h, 2 * inter, scale=h ** -0.5)
        down = draw(inter, h, scale=inter ** -0.5)
        cols = slice(self.rank * i_loc, (self.rank + 1) * i_loc)
        self.x = x[self.own].clone()
        self.w1 = torch.cat([gate_up[:, :inter][:, cols], gate_up[:, inter:][:, cols]], dim=1).contiguous()
        self.w2 = down[cols].contiguous()
        xf = x[self.own].float()
        gu = xf @ gate_up.float()
        reference = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ down.float()
        del x, gate_up, down, xf, gu
        return reference

    # -- pieces -----------------------------------------------------------------------

    def sync_device(self) -> None:
        """Wait for this rank's CUDA work to finish (nothing to wait for on CPU)."""
        if self.spec.device == "cuda":
            self.torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Wait for every rank (and, on CUDA, for this rank's device work)."""
        if self.spec.device == "cuda":
            self.dist.barrier(device_ids=[self.rank])
            self.torch.cuda.synchronize(self.device)
        else:
            self.dist.barrier()

    def act(self, gu: Any) -> Any:
        """SiLU(gate) * up into one new tensor (as a fused SiluAndMul kernel allocates)."""
        return self.torch.nn.functional.silu(gu[:, : self.local_inter]).mul_(gu[:, self.local_inter:])

    def rows(self, src: int, chunk: int) -> slice:
        """The rows of the gathered input that chunk *chunk* of rank *src*'s shard occupies."""
        start = src * self.local_tokens + chunk * self.chunk_rows
        return slice(start, start + self.chunk_rows)

    # -- variants ---------------------------------------------------------------------

    def sync(self) -> Any:
        """Blocking all-gather, matmuls, blocking reduce-scatter."""
        xf = self.x.new_empty(self.tokens, self.hidden)
        self.all_gather(xf, self.x)
        gu = xf @ self.w1
        del xf
        a = self.act(gu)
        del gu
        y = a @ self.w2
        del a
        out = self.x.new_empty(self.local_tokens, self.hidden)
        self.reduce_scatter(out, y)
        return out

    def overlap(self) -> Any:
        """Async collectives, decomposed by source and destination rank (see this module's docstring)."""
        torch, dist, c = self.torch, self.dist, self.spec.chunks
        xf = self.x.new_empty(self.tokens, self.hidden)
        gu = self.x.new_empty(self.tokens, 2 * self.local_inter)
        xf[self.own].copy_(self.x)  # the gathered input holds every rank's rows, as in the sync variant
        works = {(src, chunk): dist.broadcast(xf[self.rows(src, chunk)], src=src, async_op=True)
                 for chunk in range(c) for src in range(self.w)}
        torch.matmul(self.x, self.w1, out=gu[self.own])  # own rows while the others arrive
        for chunk in range(c):
            for src in range(self.w):
                works[src, chunk].wait()
                if src != self.rank:
                    rows = self.rows(src, chunk)
                    torch.matmul(xf[rows], self.w1, out=gu[rows])
        del xf, works
        a = self.act(gu)
        del gu
        y = self.x.new_empty(self.tokens, self.hidden)
        pending = []
        for dst in range(self.w):
            for chunk in range(c):
                rows = self.rows(dst, chunk)
                torch.matmul(a[rows], self.w2, out=y[rows])
                pending.append(dist.reduce(y[rows], dst=dst, op=dist.ReduceOp.SUM, async_op=True))
        del a
        _wait_all(pending)
        return y[self.own].clone()

    def fused(self) -> Any:
        """torch's symmetric-memory fused all-gather-matmul and matmul-reduce-scatter."""
        ops = self.torch.ops.symm_mem
        _, outputs = ops.fused_all_gather_matmul(self.x, [self.w1], 0, self.group_name, return_A=False)
        gu = outputs[0]
        del outputs
        a = self.act(gu)
        del gu
        return ops.fused_matmul_reduce_scatter(a, self.w2, "sum", 0, self.group_name)

    def comm_sync(self) -> None:
        """The sync variant's collectives alone, on tensors of the same sizes."""
        xf = self.x.new_empty(self.tokens, self.hidden)
        self.all_gather(xf, self.x)
        del xf
        y = self.x.new_zeros(self.tokens, self.hidden)
        out = self.x.new_empty(self.local_tokens, self.hidden)
        self.reduce_scatter(out, y)

    def comm_overlap(self) -> None:
        """The overlap variant's collectives alone, issued the same way, without the compute."""
        dist, c = self.dist, self.spec.chunks
        xf = self.x.new_empty(self.tokens, self.hidden)
        xf[self.own].copy_(self.x)
        works = [dist.broadcast(xf[self.rows(src, chunk)], src=src, async_op=True)
                 for chunk in range(c) for src in range(self.w)]
        _wait_all(works)
        del xf, works  # a work handle keeps its tensor alive
        y = self.x.new_zeros(self.tokens, self.hidden)
        pending = [dist.reduce(y[self.rows(dst, chunk)], dst=dst, op=dist.ReduceOp.SUM, async_op=True)
                   for dst in range(self.w) for chunk in range(c)]
        _wait_all(pending)

    def compute(self) -> Any:
        """The matmuls alone, on an input gathered beforehand."""
        gu = self.gathered @ self.w1
        a = self.act(gu)
        del gu
        y = a @ self.w2
        del a
        return y[self.own].clone()

    def prepare(self) -> None:
        """Gather the input once for :meth:`compute`, and set up symmetric memory for ``fused``."""
        self.gathered = self.x.new_empty(self.tokens, self.hidden)
        self.all_gather(self.gathered, self.x)
        if "fused" in self.spec.variants:
            import torch.distributed._symmetric_memory as symm_mem

            self.group_name = self.dist.group.WORLD.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group") and not symm_mem.is_symm_mem_enabled_for_group(
                    self.group_name):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # torch 2.13: "no need to call it anymore"
                    symm_mem.enable_symm_mem_for_group(self.group_name)

    def error(self, out: Any) -> float:
        """The largest absolute difference between *out* and this rank's fp32 reference rows."""
        return float((out.float() - self.reference).abs().max())

