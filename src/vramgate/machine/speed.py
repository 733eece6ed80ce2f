"""The machine's measured speed: one fixed single-threaded workload, timed, so that a timing is compared only
with one taken on a machine that runs at the same speed.

Note [machine speed]: a CPU hardware key says what a machine is (ISA, vendor, family), not how fast it runs.
Virtual machines of one key differ: two 2-core "AMD EPYC" guests with the same CPU flags ran the benchmarks'
pure-Python reference loop in 1.6-1.7 s (the figure earlier runs recorded) and 2.4-2.9 s, and the gate's engine
timings (TPOT, throughput) 2.1-2.6x apart. A measured timing judged against a baseline from the faster one fails
by more than any tolerance the gate could set without blinding it, and that red says nothing about the change
under review. So a machine-bound baseline under a CPU key records the probe's time (``machine_speed_s`` in its
provenance), and a measured metric there is compared only when the probe now and then agree within
:data:`SPEED_BAND`; otherwise it is "not compared", with both speeds named, and ``--gate-update-scope machine``
on this machine records baselines it can be judged against. Paired metrics (a candidate against its reference
in the same run) need no such check, and neither do a GPU key's timings: the GPU class is their speed (and the
GPU-state guard checks its clocks), which a probe of the host does not time.

The probe is the least of :data:`REPEATS` timings of a pure-Python JSON loop (about 0.2 s each on the slower
machine above): the least, because other work on the machine only ever adds time. Two probes of one machine
agreed within 2% alone and within 22% with the other core busy (212-257 ms on the slower machine). The benchmarks
time the same loop (``benchmarks/test_bench.py``'s reference loop).
"""

from __future__ import annotations

import functools
import json
import time

#: How far apart (as a ratio, either way) the probe of a baseline's machine and this one's may be.
SPEED_BAND = 1.35
#: The probe's repeats and iterations per repeat.
REPEATS = 7
ITERATIONS = 30_000


def measure(repeats: int = REPEATS, iterations: int = ITERATIONS) -> float:
    """The probe's time in seconds: the least of *repeats* timings of *iterations* ``json.dumps`` calls."""
    data = {"a": list(range(100))}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iterations):
            json.dumps(data)
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def machine_speed_s() -> float:
    """This machine's probe time in seconds, measured once per process (Note [machine speed])."""
    return round(measure(), 5)


def mismatch_here(baseline_s: float | None) -> str | None:
    """:func:`speed_mismatch` of this machine's probe (:func:`machine_speed_s`) and a baseline's."""
    return speed_mismatch(machine_speed_s(), baseline_s)


def speed_mismatch(now_s: float, baseline_s: float | None, band: float = SPEED_BAND) -> str | None:
    """Why a timing measured on a machine whose probe took *now_s* is not compared with a baseline whose machine's
    took *baseline_s* (None: it recorded none), or None when the two agree within *band*."""
    if baseline_s is None:
        return ("the baseline records no machine speed (Note [machine speed]): its timings may come from a machine "
                "of another speed; re-record it here to compare timings")
    if not (baseline_s > 0 and now_s > 0):
        return f"machine speed unknown (probe {now_s!r} s now, {baseline_s!r} s then)"
    ratio = now_s / baseline_s
    if 1 / band <= ratio <= band:
        return None
    return (f"this machine runs the speed probe in {now_s * 1e3:.0f} ms, the baseline's ran it in "
            f"{baseline_s * 1e3:.0f} ms ({ratio:.2f}x; timings are compared within {band:g}x): a timing of another "
            "machine is not compared (Note [machine speed])")
