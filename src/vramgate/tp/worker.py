"""One rank of a tensor-parallel MLP measurement: ``python -m vramgate.tp.worker SPEC.json``.

Started by :mod:`vramgate.tp.launcher` once per rank with ``torch.distributed``'s
``env://`` variables set. Writes ``rank<R>.json`` (a
:class:`~vramgate.tp.launcher.RankResult`) next to the spec.

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

Per variant and round it times one step (after a barrier that lines the ranks
up) and its peak memory: on CPU the process's peak RSS (``VmHWM`` reset per
step, glibc's mmap threshold pinned so large tensors are mapped and unmapped
with their lifetime; that includes gloo's own buffers); on CUDA the caching
allocator's peak plus the device memory the variant added outside the
allocator (NVML: NCCL and symmetric-memory buffers). It also times the
variant's collectives alone and the compute alone, and checks every variant's
output against a single-process reference.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vramgate.machine import isa
from vramgate.tp.launcher import TPSpec

#: Largest accepted output error, relative to the reference's largest absolute value, per dtype.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


def _log(rank: int, message: str) -> None:
    print(f"[rank {rank}] {message}", flush=True)


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
        if self.spec.device == "cuda":
            self.torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.spec.device == "cuda":
            self.dist.barrier(device_ids=[self.rank])
            self.torch.cuda.synchronize(self.device)
        else:
            self.dist.barrier()

    def act(self, gu: Any) -> Any:
        """SiLU(gate) * up into one new tensor (as a fused SiluAndMul kernel allocates)."""
        return self.torch.nn.functional.silu(gu[:, : self.local_inter]).mul_(gu[:, self.local_inter:])

    def rows(self, src: int, chunk: int) -> slice:
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
        """Async collectives, decomposed by source and destination rank (see the module docstring)."""
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
        return float((out.float() - self.reference).abs().max())


class MemoryProbe:
    """Peak memory a step adds: peak RSS on CPU; allocator peak plus memory outside the allocator on CUDA."""

    def __init__(self, device: str, index: int, torch: Any) -> None:
        self.device, self.index, self.torch = device, index, torch
        self.notes: list[str] = []
        self.name = "peak_rss" if device == "cpu" else "cuda_allocator+nvml"
        if device == "cpu":
            from vramgate.machine.probes.cpu import PeakRSS, pin_mmap_threshold, reset_peak_rss

            if not pin_mmap_threshold():
                raise RuntimeError("peak RSS of a step needs glibc's mallopt (mmap threshold); not available here")
            if not reset_peak_rss():
                raise RuntimeError("this kernel refuses to reset the process's peak RSS (/proc/self/clear_refs)")
            self._rss = PeakRSS

    def device_used(self) -> int | None:
        """Device memory in use (NVML, as nvidia-smi shows it); None where NVML cannot be read."""
        try:
            return int(self.torch.cuda.device_memory_used(self.index))
        except Exception as exc:
            note = f"NVML unavailable ({exc}): memory outside the allocator not measured"
            if note not in self.notes:
                self.notes.append(note)
            return None

    def step(self, fn: Callable[[], Any]) -> tuple[Any, int, int]:
        """Run *fn*; (its output, peak bytes added, allocator peak bytes added or 0 on CPU)."""
        if self.device == "cpu":
            with self._rss() as probe:
                out = fn()
            return out, probe.delta_bytes, 0
        from vramgate.machine.probes.cuda import CudaRegion

        with CudaRegion(self.index) as region:
            out = fn()
        return out, region.peak_delta_bytes, region.peak_delta_bytes


def _timed(mlp: ShardedMLP, fn: Callable[[], Any]) -> float:
    """Seconds *fn* took on this rank, after a barrier that lines the ranks up."""
    mlp.barrier()
    start = time.perf_counter()
    out = fn()
    mlp.sync_device()
    elapsed = time.perf_counter() - start
    del out
    return elapsed


def _timed_step(mlp: ShardedMLP, probe: MemoryProbe, fn: Callable[[], Any]) -> tuple[float, int, int]:
    """(seconds, peak bytes added, allocator peak bytes added) of *fn*, after a barrier."""
    mlp.barrier()
    start = time.perf_counter()
    out, peak, alloc = probe.step(fn)
    mlp.sync_device()
    elapsed = time.perf_counter() - start
    del out
    return elapsed, peak, alloc


def run(spec: TPSpec, rank: int, run_dir: Path) -> dict[str, Any]:
    """Measure every variant of *spec* on this rank; the :class:`~vramgate.tp.launcher.RankResult` as JSON."""
    import torch
    import torch.distributed as dist

    if spec.device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
    probe = MemoryProbe(spec.device, rank, torch)
    init: dict[str, Any] = {"backend": spec.backend, "init_method": "env://", "rank": rank,
                            "world_size": spec.world_size,
                            "timeout": datetime.timedelta(seconds=spec.collective_timeout_s)}
    if spec.device == "cuda":
        init["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(**init)
    try:
        return _measure(spec, rank, run_dir, torch, dist, probe)
    finally:
        dist.destroy_process_group()


def _measure(spec: TPSpec, rank: int, run_dir: Path, torch: Any, dist: Any, probe: MemoryProbe) -> dict[str, Any]:
    mlp = ShardedMLP(spec, rank, torch, dist)
    mlp.prepare()
    device_name = torch.cuda.get_device_name(rank) if spec.device == "cuda" else f"cpu ({platform.machine()})"
    _log(rank, f"{spec.world_size} ranks, {spec.backend} on {device_name}; tokens {spec.shape.tokens}, hidden "
               f"{spec.shape.hidden}, intermediate {spec.shape.intermediate} ({mlp.local_inter} per rank), "
               f"{spec.dtype}, variants {', '.join(spec.variants)}")
    steps: dict[str, Callable[[], Any]] = {v: getattr(mlp, v) for v in spec.variants}
    comms: dict[str, Callable[[], Any]] = {"sync": mlp.comm_sync, "overlap": mlp.comm_overlap,
                                           "fused": mlp.comm_sync}
    ref_max = float(mlp.reference.abs().max())
    tolerance = TOLERANCE[spec.dtype]
    errors = {}
    outside: dict[str, int | None] = {}
    for name, fn in [*steps.items(), ("compute", mlp.compute)]:
        before = probe.device_used() if spec.device == "cuda" else None
        reserved = torch.cuda.memory_reserved(mlp.device) if spec.device == "cuda" else 0
        out = fn()
        mlp.sync_device()
        if name in steps:  # compute alone yields partial sums (no reduction): nothing to compare
            errors[name] = mlp.error(out)
        del out
        for _ in range(spec.warmup):
            fn()
        mlp.sync_device()
        if name not in steps:
            continue
        if before is not None:
            after = probe.device_used()
            grown = torch.cuda.memory_reserved(mlp.device) - reserved
            outside[name] = None if after is None else max(0, after - before - grown)
        _log(rank, f"{name}: max |error| {errors[name]:.3g} against the reference (largest value {ref_max:.3g}, "
                   f"accepted {tolerance * ref_max:.3g})")
        if errors[name] > tolerance * ref_max:
            raise AssertionError(f"variant {name} on rank {rank}: output differs from the single-process "
                                 f"reference by {errors[name]:.3g} (> {tolerance:g} x {ref_max:.3g})")
    for fn in dict.fromkeys(comms[v] for v in spec.variants):  # one order on every rank
        for _ in range(spec.warmup):
            fn()
    if spec.hold_rank == rank:
        (run_dir / f"rank{rank}.holding").write_text(str(os.getpid()), encoding="utf-8")
        _log(rank, f"holding for {spec.hold_s:g} s before the measured rounds")
        time.sleep(spec.hold_s)

    _log(rank, f"measuring {spec.samples} rounds")
    results: dict[str, dict[str, Any]] = {v: {"step_s": [], "peak_bytes": [], "allocator_peak_bytes": [],
                                              "comm_s": [], "comm_peak_bytes": []} for v in spec.variants}
    compute_s: list[float] = []
    jobs: list[tuple[str, str]] = [("compute", "")]
    for v in spec.variants:
        jobs += [("step", v), ("comm", v)]
    for round_ in range(spec.samples):
        shift = round_ % len(jobs)  # rotate the order each round: no job always runs first or after another
        for kind, v in jobs[shift:] + jobs[:shift]:
            if kind == "compute":
                compute_s.append(_timed(mlp, mlp.compute))
            elif kind == "comm":
                elapsed, peak, _ = _timed_step(mlp, probe, comms[v])
                results[v]["comm_s"].append(elapsed)
                results[v]["comm_peak_bytes"].append(peak)
            else:
                elapsed, peak, alloc = _timed_step(mlp, probe, steps[v])
                results[v]["step_s"].append(elapsed)
                results[v]["peak_bytes"].append(peak + (outside.get(v) or 0))
                if spec.device == "cuda":
                    results[v]["allocator_peak_bytes"].append(alloc)
    mlp.barrier()
    for v in spec.variants:
        results[v]["max_abs_err"] = errors[v]
        results[v]["outside_allocator_bytes"] = outside.get(v)
        med = sorted(results[v]["step_s"])[len(results[v]["step_s"]) // 2]
        _log(rank, f"{v}: median step {med * 1e3:.2f} ms, peak {max(results[v]['peak_bytes']) / 2**20:.1f} MiB")
    return {
        "rank": rank, "world_size": spec.world_size, "backend": spec.backend, "device": spec.device,
        "device_name": device_name,
        "versions": {"python": platform.python_version(), "torch": str(torch.__version__)},
        "memory_probe": probe.name, "variants": results, "compute_s": compute_s,
        "tolerance": tolerance, "reference_max_abs": ref_max, "notes": probe.notes,
    }


def main(argv: list[str]) -> int:
    """Entry point: ``python -m vramgate.tp.worker SPEC.json`` with ``RANK`` and ``WORLD_SIZE`` set."""
    if len(argv) != 1:
        print("usage: python -m vramgate.tp.worker SPEC.json (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)",
              file=sys.stderr)
        return 2
    isa.apply_cap()  # Note [ISA cap]: torch's and oneDNN's kernels as on the capped class
    spec_path = Path(argv[0])
    spec = TPSpec.from_json(json.loads(spec_path.read_text(encoding="utf-8")), str(spec_path))
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as exc:
        print(f"RANK and WORLD_SIZE must be set to integers: {exc}", file=sys.stderr)
        return 2
    if world != spec.world_size or not 0 <= rank < world:
        print(f"RANK {rank} / WORLD_SIZE {world} do not fit the spec's world_size {spec.world_size}", file=sys.stderr)
        return 2
    try:
        result = run(spec, rank, spec_path.parent)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a failed collective can leave threads that would block a normal exit
    path = spec_path.parent / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
