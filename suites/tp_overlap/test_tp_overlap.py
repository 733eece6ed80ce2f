"""Overlapping tensor-parallel communication with compute: per-rank memory and time (CLAIMS.md item 9).

The article claims that overlapping the all-gather with compute under TP=4
cuts peak memory 19% (4.7 -> 3.8 GB). Overlap targets latency; it tends to add
memory, since a tensor handed to an in-flight collective stays alive until the
collective completes, and the transport may keep buffers of its own.

Measured on a Megatron-style sequence-parallel MLP block (all-gather of the
sequence shards, column-parallel gate/up, SiLU-and-multiply, row-parallel
down, reduce-scatter) run as real process groups (:mod:`vramgate.tp.launch`): gloo
with 2 ranks on CPU, NCCL with 2/4/8 ranks on GPUs. Variants: blocking
collectives (``sync``); the same collectives issued asynchronously and
overlapped with the matmuls (``overlap``); on CUDA, torch's symmetric-memory
``fused_all_gather_matmul`` + ``fused_matmul_reduce_scatter`` (``fused``).
Every variant holds the same full-length tensors (Note [equal tensors] in
:mod:`vramgate.tp.worker`), so a memory difference comes from the collectives
each variant issues and what they hold, not from smaller activations.

Per rank: peak memory a step adds (CPU: peak RSS, gloo's buffers included;
CUDA: allocator peak plus what NVML sees outside the allocator), step time,
the collectives alone and the compute alone, and the overlap achieved:
``(t_comm + t_compute - t_step) / min(t_comm, t_compute)`` from the medians,
clipped to [0, 1]. On CPU gloo's transport needs CPU time of its own (its
worker threads, the kernel's loopback copies) and the decomposed matmuls run on
smaller blocks: it measured 0% on this 2-core machine and on a 16-core host, so
the figure is reported there (next to sync's own, the formula's noise floor)
but gated only on CUDA, where collectives run beside the matmuls. Every
variant's output matches a single-process reference (fp32 on CPU: 1e-4 of the
largest output value; bf16 on CUDA: 3e-2).

A rank that dies fails the run: the test below kills one mid-run and checks
that the error names it, carries its output, and leaves no rank running.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from vramgate import Gate
from vramgate.testing import TPRunner
from vramgate.testing.machine import alive, median
from vramgate.testing.tp import (
    DTYPE_BYTES,
    Launcher,
    MLPShape,
    RankResult,
    TPError,
    TPSpec,
    launcher,
    overlap_fraction,
    peak_change,
)

#: Not in the pre-merge set (tox -e cpu); the full gate (tox -e cpu-full, nightly) runs it.
pytestmark = pytest.mark.gate_nightly("tensor-parallel overlap claims: no optimization profile changes them")

#: (device, tensor-parallel size): 2 gloo ranks fit a 2-core machine; NCCL where the GPUs are.
DEVICE_WORLD = [
    pytest.param("cpu", 2, id="cpu-tp2"),
    pytest.param("cuda", 2, id="cuda-tp2", marks=pytest.mark.requires_gpus(2)),
    pytest.param("cuda", 4, id="cuda-tp4", marks=pytest.mark.requires_gpus(4)),
    pytest.param("cuda", 8, id="cuda-tp8", marks=pytest.mark.requires_gpus(8)),
]
#: The MLP per device: on CPU DeepSeek-V2-Lite's shared experts (hidden 2048, 2 x 1408 intermediate) over
#: 512 tokens in fp32; on CUDA DeepSeek-V3's dense MLP (hidden 7168, intermediate 18432) over 8192 tokens in bf16.
MODEL = {"cpu": "deepseek-v2-lite", "cuda": "deepseek-v3"}
TOKENS = {"cpu": 512, "cuda": 8192}
DTYPE = {"cpu": "float32", "cuda": "bfloat16"}
VARIANTS = {"cpu": ("sync", "overlap"), "cuda": ("sync", "overlap", "fused")}
#: Pieces of each rank's shard in the overlapped pipeline. CPU: one block per source and destination rank (as
#: torch's fused all-gather-matmul decomposes): a single-threaded matmul loses ~12% on 64-row blocks.
CHUNKS = {"cpu": 1, "cuda": 4}
#: Measured rounds (each times every variant, the collectives alone and the compute alone): 20 take about
#: 10 s with two ranks on two idle cores.
SAMPLES = {"cpu": 20, "cuda": 20}
#: Peak RSS of a step moves by a few hundred KiB (glibc's heap, gloo's scratch) around ~10 MiB; the CUDA
#: allocator's peak is exact.
PEAK_TOLERANCE = {"cpu": 0.15, "cuda": 0.02}
#: Times on two shared CPU cores gate only gross regressions (a doubling), as the latency suite does; GPU drift
#: run to run is 10-14%. The paired ratio of two steps of one round moves less with the machine's load.
TIME_TOLERANCE = {"cpu": 1.0, "cuda": 0.2}
#: CPU: gloo's transport shares the two cores with the compute, so per-round ratios swing with any other load
#: (medians 0.95-1.01 on an idle machine); 0.5 fails a step that grows by half relative to sync, not the swing.
PAIRED_TOLERANCE = {"cpu": 0.5, "cuda": 0.2}
#: The article's figure: 4.7 -> 3.8 GB.
CLAIMED_CUT = 0.19


def mlp_shape(root: Path, device: str) -> MLPShape:
    """The MLP of :data:`MODEL` [device] from its config in ``fixtures/models``."""
    config = json.loads((root / "fixtures" / "models" / MODEL[device] / "config.json").read_text(encoding="utf-8"))
    if device == "cpu":
        intermediate = config["n_shared_experts"] * config["moe_intermediate_size"]
    else:
        intermediate = config["intermediate_size"]
    return MLPShape(tokens=TOKENS[device], hidden=config["hidden_size"], intermediate=intermediate)


def summarize(results: list[RankResult], variant: str) -> dict[str, list[float]]:
    """Per rank: median step, comm and compute time, median peak, the collectives' largest peak, overlap achieved.

    The collectives alone are not gated on their peak: when gloo releases a finished collective's tensors
    varies from round to round (4.9 to 7.9 MiB for the same calls); the largest shows what they can hold.
    """
    out: dict[str, list[float]] = {"step": [], "comm": [], "compute": [], "peak": [], "comm_peak": [], "overlap": []}
    for r in results:
        v = r.variants[variant]
        step, comm, compute = median(v.step_s), median(v.comm_s), median(r.compute_s)
        out["step"].append(step)
        out["comm"].append(comm)
        out["compute"].append(compute)
        out["peak"].append(median(v.peak_bytes))
        out["comm_peak"].append(max(v.comm_peak_bytes))
        out["overlap"].append(overlap_fraction(comm, compute, step))
    return out


def _mib(values: list[float]) -> str:
    return " / ".join(f"{v / 2**20:.1f}" for v in values) + " MiB"


def _ms(values: list[float]) -> str:
    return " / ".join(f"{v * 1e3:.0f}" for v in values) + " ms"


def _pct(values: list[float]) -> str:
    return " / ".join(f"{v:+.1%}" for v in values)


@pytest.mark.parametrize(("device", "world_size"), DEVICE_WORLD)
def test_overlap_memory_and_time(gate: Gate, tp_runner: TPRunner, project_root: Path, device: str,
                                 world_size: int) -> None:
    """Per-rank peak memory and step time of each variant; the overlap achieved; the claim's verdict."""
    shape = mlp_shape(project_root, device)
    spec = TPSpec(world_size=world_size, device=device, shape=shape, variants=VARIANTS[device],
                  dtype=DTYPE[device], chunks=CHUNKS[device], samples=SAMPLES[device], warmup=1, timeout_s=300)
    results = tp_runner.run(spec)
    assert [r.rank for r in results] == list(range(world_size))
    tensors = shape.tensor_bytes(world_size, DTYPE_BYTES[spec.dtype])
    for r in results:
        for name, v in r.variants.items():
            assert v.max_abs_err <= r.tolerance * r.reference_max_abs, (
                f"rank {r.rank} {name}: output off the reference by {v.max_abs_err:.3g}")
            # The probe must see the step's own tensors (CPU: RSS counters lag by a few pages per thread).
            assert median(v.peak_bytes) >= 0.9 * tensors["step_peak"], (
                f"rank {r.rank} {name}: measured peak {median(v.peak_bytes):,.0f} B is below the "
                f"{tensors['step_peak']:,} B of tensors the step holds at once")
            gate.record_samples(f"rank{r.rank}.{name}.peak_bytes", v.peak_bytes, unit="B",
                                tolerance=PEAK_TOLERANCE[device])
            gate.record_samples(f"rank{r.rank}.{name}.step_s", v.step_s, unit="s", tolerance=TIME_TOLERANCE[device])
            gate.record_samples(f"rank{r.rank}.{name}.comm_s", v.comm_s, unit="s", tolerance=TIME_TOLERANCE[device])
        gate.record_samples(f"rank{r.rank}.compute_s", r.compute_s, unit="s", tolerance=TIME_TOLERANCE[device])

    sync = summarize(results, "sync")
    lines = [f"{device}, TP={world_size} ({spec.backend}), {MODEL[device]} MLP (hidden {shape.hidden}, "
             f"intermediate {shape.intermediate}, {shape.intermediate // world_size} per rank), {shape.tokens} "
             f"tokens, {spec.dtype}; per rank (rank 0 / 1 / ...); the step's tensors peak at "
             f"{tensors['step_peak'] / 2**20:.1f} MiB in every variant",
             f"sync: peak {_mib(sync['peak'])}, step {_ms(sync['step'])}; collectives alone {_ms(sync['comm'])}, "
             f"peak up to {_mib(sync['comm_peak'])}; compute alone {_ms(sync['compute'])}"]
    cuts = {}
    for name in VARIANTS[device][1:]:
        s = summarize(results, name)
        changes = [peak_change(a, b) for a, b in zip(sync["peak"], s["peak"], strict=True)]
        cuts[name] = changes
        for r in results:
            # Paired A/B: per round, this variant's step against the sync step of the same round.
            mine, base = r.variants[name], r.variants["sync"]
            gate.record_samples(f"rank{r.rank}.{name}.peak_vs_sync",
                                [c / d for c, d in zip(mine.peak_bytes, base.peak_bytes, strict=True)],
                                unit="ratio", tolerance=PEAK_TOLERANCE[device])
            gate.record_samples(f"rank{r.rank}.{name}.step_vs_sync",
                                [c / d for c, d in zip(mine.step_s, base.step_s, strict=True)],
                                unit="ratio", tolerance=PAIRED_TOLERANCE[device])
            if device == "cuda":
                # Overlap achieved is a ratio of three timings, each drifting 10-14% on a GPU: 0.5 fails when it
                # falls below 1/1.5 of the baseline's (overlap lost), not on the drift.
                gate.record_samples(f"rank{r.rank}.{name}.overlap", r.overlap(name), unit="ratio", better="higher",
                                    tolerance=0.5)
        lines.append(f"{name}: peak {_mib(s['peak'])} ({_pct(changes)} vs sync), step {_ms(s['step'])}; "
                     f"collectives alone {_ms(s['comm'])}, peak up to {_mib(s['comm_peak'])}; overlap achieved "
                     + " / ".join(f"{o:.0%}" for o in s["overlap"]))
    lines.append("sync by the same formula (nothing to overlap: the noise floor) "
                 + " / ".join(f"{o:.0%}" for o in sync["overlap"]))
    best = min(cuts, key=lambda n: max(cuts[n]))
    lines.append(f"held only if every rank's peak is at least {CLAIMED_CUT:.0%} lower; best variant {best}: "
                 f"{_pct(cuts[best])}" + ("" if world_size == 4 else f" (at TP={world_size}; the claim names TP=4)"))
    print("\n".join(lines))
    gate.claim(
        "Async all-gather overlap under TP=4 cuts peak memory 19% (4.7 -> 3.8 GB)",
        held=max(cuts[best]) <= -CLAIMED_CUT,
        evidence="; ".join(lines),
        source="CLAIMS.md item 9",
    )


def test_killed_rank_fails_the_run_with_its_output(tmp_path: Path) -> None:
    """Kill rank 1 mid-run (process group up, collectives done, rank 0 waiting in a barrier): the run fails
    naming rank 1 with its output, and no rank is left running."""
    pytest.importorskip("torch")
    spec = TPSpec(world_size=2, device="cpu", shape=MLPShape(tokens=64, hidden=64, intermediate=128),
                  samples=2, warmup=1, chunks=2, timeout_s=120, collective_timeout_s=60, hold_rank=1, hold_s=120)
    ranks: Launcher = launcher(spec, tmp_path)
    with ranks:
        marker = tmp_path / "rank1.holding"
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert time.monotonic() < deadline, "rank 1 never reached its hold point:\n" + (
                tmp_path / "rank1.log").read_text(errors="replace")
            assert all(p.poll() is None for p in ranks.procs), "a rank exited before the kill"
            time.sleep(0.05)
        victim = ranks.procs[1].pid
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(TPError) as info:
            ranks.wait()
    error = info.value
    text = str(error)
    assert error.rank == 1, text
    assert "rank 1 of 2 was killed by SIGKILL" in text
    assert "[rank 1] holding for 120 s before the measured rounds" in error.log_tail
    assert "[rank 1] holding for 120 s" in text and "rank 0 " in text
    assert not any(alive(pid) for pid in ranks.pids), [(pid, alive(pid)) for pid in ranks.pids]
