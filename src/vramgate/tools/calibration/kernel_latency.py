"""The gate's precision on a kernel's latency: false alarms and detections of a planted delay.

``python -m vramgate.tools.calibration.kernel_latency OUT_DIR [--device cuda]`` runs the
kernel-level counterpart of ``vramgate calibrate``: in several fresh processes
(run-to-run variation is what history comparisons fight), it times a reference
kernel and a candidate, call by call in a random order within each pair:
the candidate is the same kernel (``unchanged``) or the kernel followed by a
planted delay of 5% or 10% of the reference's median time (on CUDA a
``torch.cuda._sleep`` spin kernel inside the timed region; on CPU a busy
wait). The calls are cut into trials of the size of one gate test and analysed
with :func:`vramgate.tools.calibration.engine_latency.analyze`: paired ratios against history, A/B
within a trial, and raw samples against another process's (the way the GPU
kernel suites compare with their stored baselines).

The CUDA kernel is the attention suite's flash decode case (batch 32, 32 query
/ 8 KV heads, 8k context, head size 128, bf16), timed with CUDA events and the
L2 flushed before each call; on CPU a 512 x 512 float32 matmul.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vramgate.core.metrics import median
from vramgate.tools.calibration.engine_latency import DELAYS, figures_json, render


def _kernel(device: str) -> Callable[[], object]:
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def rand(heads: int, length: int) -> Any:
            return torch.randn(32, length, heads, 128, device="cuda", dtype=torch.bfloat16,
                               generator=gen).transpose(1, 2)

        q, k, v = rand(32, 1), rand(8, 8192), rand(8, 8192)

        def call() -> object:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return call
    a = torch.randn(512, 512, generator=gen)
    b = torch.randn(512, 512, generator=gen)
    return lambda: a @ b


class Timer:
    """Times one call (CUDA events with the L2 flushed before, or the wall clock on CPU)."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.device = torch, device
        self.flush = None
        if device == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
            self.flush = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
            self.cycles_per_s = self._sleep_rate()

    def _sleep_rate(self) -> float:
        torch = self.torch
        rates = []
        for _ in range(5):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            torch.cuda._sleep(1_000_000)
            end.record()
            end.synchronize()
            rates.append(1_000_000 / (begin.elapsed_time(end) / 1e3))
        return median(rates)

    def delay(self, seconds: float) -> Callable[[], None]:
        """A planted delay of about *seconds* (a spin kernel on CUDA, a busy wait on CPU)."""
        if seconds <= 0:
            return lambda: None
        if self.device == "cuda":
            cycles = max(1, int(seconds * self.cycles_per_s))
            return lambda: self.torch.cuda._sleep(cycles)

        def wait() -> None:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        return wait

    def time(self, fn: Callable[[], object], after: Callable[[], None]) -> float:
        """Seconds *fn* followed by *after* takes: CUDA events after an L2 flush on CUDA, wall time on CPU."""
        torch = self.torch
        if self.device != "cuda":
            t0 = time.perf_counter()
            fn()
            after()
            return time.perf_counter() - t0
        assert self.flush is not None
        self.flush.zero_()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        after()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end)) / 1e3


def child(device: str, calls: int, seed: int) -> dict[str, dict[str, list[float]]]:
    """One process's share: *calls* interleaved call pairs per condition (see the module docs)."""
    fn = _kernel(device)
    timer = Timer(device)
    for _ in range(20):
        timer.time(fn, lambda: None)
    reference = median([timer.time(fn, lambda: None) for _ in range(50)])
    rng = random.Random(seed)
    out: dict[str, dict[str, list[float]]] = {}
    conditions = list(DELAYS)
    for condition in conditions:
        out[condition] = {"a_latency": [], "b_latency": []}
    planted = {c: timer.delay(DELAYS[c] * reference) for c in conditions}
    for _ in range(calls):
        rng.shuffle(conditions)  # conditions interleaved too: slow drift hits them all alike
        for condition in conditions:
            sides = [("a", lambda: None), ("b", planted[condition])]
            rng.shuffle(sides)
            for side, after in sides:
                out[condition][f"{side}_latency"].append(timer.time(fn, after))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run the campaign's processes (or, with ``--child``, one process's share) and write the figures."""
    parser = argparse.ArgumentParser(prog="python -m vramgate.tools.calibration.kernel_latency",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out", help="folder for calibration.json and calibration.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--processes", type=int, default=6, help="fresh processes (default 6)")
    parser.add_argument("--calls", type=int, default=600, help="call pairs per condition and process (default 600)")
    parser.add_argument("--trial-samples", type=int, default=30, help="samples per trial, as the suites (default 30)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.child is not None:
        part = child(args.device, args.calls, args.child)
        (out / f"process-{args.child}.json").write_text(json.dumps(part), encoding="utf-8")
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("kernel_latency: no CUDA device here; use --device cpu", file=sys.stderr)
            return 2
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    raw: dict[str, list[dict[str, list[float]]]] = {c: [] for c in DELAYS}
    for index in range(args.processes):
        cmd = [sys.executable, "-m", "vramgate.tools.calibration.kernel_latency", str(out), "--device", args.device,
               "--calls", str(args.calls), "--child", str(index)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            print(f"kernel_latency: process {index} failed ({done.returncode}):\n{done.stderr[-3000:]}",
                  file=sys.stderr)
            return 1
        got = json.loads((out / f"process-{index}.json").read_text(encoding="utf-8"))
        for condition in DELAYS:
            raw[condition].append(got[condition])
    data: dict[str, Any] = {
        "campaign": {"model": f"kernel ({args.device})", "pairs": args.processes, "rounds": args.calls,
                     "trial_rounds": args.trial_samples, "stats": ["latency"]},
        "raw": raw, "seconds": time.time() - started,
    }
    data["figures"] = figures_json(raw, args.trial_samples, ["latency"])
    (out / "calibration.json").write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    text = render(data)
    (out / "calibration.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
