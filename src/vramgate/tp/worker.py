"""One rank of a tensor-parallel MLP measurement: ``python -m vramgate.tp.worker SPEC.json``.

Started by :mod:`vramgate.tp.launch` once per rank with ``torch.distributed``'s
``env://`` variables set. Writes ``rank<R>.json`` (a
:class:`~vramgate.tp.spec.RankResult`) next to the spec. The block and its
variants are :class:`~vramgate.tp.mlp.ShardedMLP` (Note [equal tensors] there).

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vramgate.machine import isa
from vramgate.store.files import atomic_write_text
from vramgate.tp.mlp import ShardedMLP
from vramgate.tp.spec import TPSpec

#: Largest accepted output error, relative to the reference's largest absolute value, per dtype.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


def _log(rank: int, message: str) -> None:
    print(f"[rank {rank}] {message}", flush=True)


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
    """Measure every variant of *spec* on this rank; the :class:`~vramgate.tp.spec.RankResult` as JSON."""
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
    atomic_write_text(spec_path.parent / f"rank{rank}.json", json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
