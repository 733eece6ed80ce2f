"""A server's memory during a load, and what the gate reads from it: whether its warm-up has settled, and how fast
its memory grows per request and per output token (Note [memory slope]).

:class:`MemorySample` and :class:`DeviceMemorySample` are what :mod:`vramgate.engine.load` samples during a load;
:class:`WarmUp` is the settled warm-up (Note [settled warm-up]); :func:`memory_slope` and
:func:`device_memory_slope` fit the measured part (Note [leak fit] in :mod:`vramgate.core.leak`), and
:func:`paired_slope` the difference of two servers' slopes under the same load (Note [paired slopes]).

Note [memory slope]: a leak keeps memory per request admitted (a per-request log) or per output token generated (a
per-step cache) alive, so the server's memory grows with the requests (tokens) it has served. The resident memory
of the server's whole process tree is sampled every ``SAMPLE_EVERY_S`` of :mod:`vramgate.engine.load`; each
sample is placed at the number of requests completed by its moment (or at the output tokens of those requests),
and the measured part, the sustained load after a settled warm-up, is fitted by :func:`vramgate.core.leak.fit_leak`:
a slope, its standard error from the levels' scatter, a one-sided lower bound. The slope is reported per 1,000
requests (tokens), so that it reads the same at any request rate; the budget holds the bound, not the slope.

Note [settled warm-up]: a fresh server's memory grows over its first loads whatever it keeps (the allocator's
arenas, the first batches' buffers, caches that fill once), by tens of MiB, and a fit that starts there reads a
leak. So the warm-up runs in chunks (:attr:`WarmUp.chunk` requests each) and the gate reads, after each, the
median resident memory over the chunk's second half (the chunk's *level*: the first half still holds the previous
chunk's batches draining). The warm-up has settled when :attr:`WarmUp.steady` consecutive levels rose by at most
:attr:`WarmUp.growth_per_request` per request each, and after :attr:`WarmUp.least` chunks; the client, told so
(the ``wait`` files of :mod:`vramgate.engine.load_client`), skips the rest and the measured load begins. A server
that never settles (a leak does not) stops warming up after :attr:`WarmUp.most` chunks and is measured as it is:
its fit shows the growth. The threshold and the counts were measured on 2 cores (docs/online-serving.md, "The leak
floor").

A server's kernels keep state per batch shape too: vLLM's CPU linear layers keep a oneDNN primitive per number of
tokens in a step, 32 per layer (Note [oneDNN's shape cache] in :mod:`vramgate.engine.server`), and a sustained load
meets new step sizes for hundreds of requests, each growing the worker's memory, by steps, until every layer
keeps 32 and then only replaces them. The chunks, all of one load's shape, left that growth in the measured part.
So the warm-up begins with a *shape sweep* (:attr:`WarmUp.shapes` requests, one at a time, their prompt lengths
spread from 5% to 195% of the load's): each request's prefill is a step of its own length, so the sweep meets
more step sizes than a layer keeps, in seconds, and the chunks then see the kept set only replaced.

Note [paired slopes]: a profile's server and the unpatched one take the same load, chunk by chunk in turn, and the
gate fits the difference of their memory at matched completed requests: what both servers do alike (the machine's
page cache, the interpreter's own growth under the same traffic) cancels, and what the profile adds remains. The
difference is fitted as one slope (:func:`vramgate.core.leak.fit_leak`), so its bound and floor read like an unpaired
slope's.

Note [device memory slope]: on a GPU the server keeps its tensors in device memory, which its resident memory
does not show: a leak of device memory leaves the resident slope flat. So on the GPU tier the same thread also
reads NVML at each sample (:class:`~vramgate.machine.probes.nvml.TreeDeviceReader`, on the devices the server's
``CUDA_VISIBLE_DEVICES`` shows, as many as its tensor-parallel size): the usage NVML reports for the pids of the
server's process tree, and the devices' whole used memory. The device slope is the same fit, to the tree's usage
where NVML named some of its pids at every sample of the measured part (source :data:`FROM_PROCESSES`), else to
the devices' total (:data:`FROM_DEVICE_TOTAL`): NVML reports host pids, so in a container with its own pid
namespace it names none of the server's, and the devices' total is what is left. That total counts every other
process on the devices too (another server of the session on the same GPU moves it); the slope's ``source`` says
which was fitted, and one slope never mixes the two. On the CPU tier, or where NVML cannot be read, no device
sample is taken and nothing else changes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median

from vramgate.core.leak import SLOPE_SCALE, LeakFit, fit_leak

#: What a :class:`Slope` was fitted to: the server's resident memory (Note [memory slope]), NVML's usage of the
#: server's processes, or the devices' whole used memory (Note [device memory slope]).
FROM_RSS = "rss"
FROM_PROCESSES = "processes"
FROM_DEVICE_TOTAL = "device total"


@dataclass(frozen=True)
class MemorySample:
    """The server's resident memory (its whole process tree) at a moment of the monotonic clock."""

    t: float
    rss_bytes: int


@dataclass(frozen=True)
class DeviceMemorySample:
    """The server's device memory at a moment of the monotonic clock (Note [device memory slope])."""

    t: float
    tree_bytes: int | None
    """NVML's usage of the server's process tree on its devices; None when NVML named none of its pids."""
    device_bytes: int
    """The whole used memory of the server's devices."""


@dataclass(frozen=True)
class WarmUp:
    """A warm-up that runs until the server's memory settles (Note [settled warm-up])."""

    chunk: int = 40
    """Requests per chunk."""
    least: int = 2
    most: int = 8
    steady: int = 1
    """Consecutive chunks whose level rose by at most :attr:`growth_per_request` per request."""
    growth_per_request: float = 16 * 1024
    shapes: int = 96
    """Requests of the shape sweep that runs before the chunks, one at a time, prompt lengths spread; 0: none."""

    def __post_init__(self) -> None:
        if (not 1 <= self.least <= self.most or self.chunk < 8 or self.steady < 1 or self.growth_per_request < 0
                or self.shapes < 0):
            raise ValueError(f"not a warm-up: {self}")

    def settled(self, levels: Sequence[float]) -> bool:
        """Whether a warm-up whose chunks left *levels* (bytes, in order) has settled."""
        if len(levels) < max(self.least, self.steady + 1):
            return False
        rises = [b - a for a, b in itertools.pairwise(levels)][-self.steady:]
        return all(rise <= self.growth_per_request * self.chunk for rise in rises)

    def describe(self, levels: Sequence[float], chunks: int | None = None) -> str:
        """One line: how the warm-up of *levels* (of *chunks* chunks run; default one per level) ended."""
        state = "settled" if self.settled(levels) else "had not settled"
        return (f"warm-up {state} after {len(levels) if chunks is None else chunks} chunks of {self.chunk} requests "
                f"(at most "
                f"{self.growth_per_request / 1024:g} KiB per request from one chunk to the next)")


def chunk_level(samples: Sequence[MemorySample], t_start: float, t_end: float) -> float | None:
    """A warm-up chunk's level (Note [settled warm-up]): the median resident memory over the second half of
    [*t_start*, *t_end*]; None without a sample there."""
    middle = (t_start + t_end) / 2
    inside = [s.rss_bytes for s in samples if middle <= s.t <= t_end]
    return float(median(inside)) if inside else None


@dataclass(frozen=True)
class Slope:
    """A fitted memory slope (Note [memory slope]), per 1,000 requests (tokens)."""

    fit: LeakFit
    samples: int
    start_bytes: int
    end_bytes: int
    source: str = FROM_RSS
    """What was fitted: :data:`FROM_RSS`, :data:`FROM_PROCESSES` or :data:`FROM_DEVICE_TOTAL`."""

    @property
    def per_1k(self) -> float:
        """Bytes per 1,000 requests (tokens)."""
        return self.fit.slope * SLOPE_SCALE

    @property
    def requests(self) -> int:
        """Requests (tokens) completed over the measured part."""
        return int(self.fit.span)


def _counts(completions: Sequence[tuple[float, int]], per: str) -> tuple[list[float], list[float]]:
    """The moments of *completions* (moment, output tokens) in order, and the requests (tokens) completed by each."""
    done = sorted(completions)
    moments = [t for t, _ in done]
    counts, total = [], 0.0
    for _, tokens in done:
        total += 1 if per == "request" else tokens
        counts.append(total)
    return moments, counts


def _points(samples: Sequence[tuple[float, int]], completions: Sequence[tuple[float, int]], start: float,
            per: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """*samples* (moment, bytes) placed at the requests (tokens) of *completions* (moment, output tokens) completed
    by their moment: those of the measured part, from *start* to the last completion, and those before it (the
    warm-up's); ValueError with fewer than 8 completions."""
    moments, counts = _counts(completions, per)
    if len(moments) < 8:
        raise ValueError(f"a memory slope needs at least 8 completed requests, got {len(moments)}")

    def at(t: float) -> float:
        k = bisect.bisect_right(moments, t)
        return counts[k - 1] if k else 0.0

    measured = [(at(t), float(b)) for t, b in samples if start <= t <= moments[-1]]
    before = [(at(t), float(b)) for t, b in samples if t < start]
    return measured, before


def _fit(samples: Sequence[tuple[float, int]], completions: Sequence[tuple[float, int]], start: float, per: str,
         source: str) -> Slope:
    """The fit of *samples* (moment, bytes) against *completions* (moment, output tokens) over the measured part
    (Note [memory slope]); ValueError when that part is too short."""
    measured, before = _points(samples, completions, start, per)
    fit = fit_leak(measured, per=per, warmup=before)
    return Slope(fit, len(measured), int(measured[0][1]), int(measured[-1][1]), source)


def memory_slope(samples: Sequence[MemorySample], completions: Sequence[tuple[float, int]], start: float, *,
                 per: str = "request") -> Slope:
    """The resident memory's slope per 1,000 requests (``per="token"``: output tokens) over the measured part of a
    load, from *start* to its last completion; *completions* are each request's (end, output tokens), the
    warm-up's too where its samples are to be placed in the picture. Samples before *start* (the warm-up) are kept
    for the picture only. ValueError when the part is too short to fit."""
    return _fit([(s.t, s.rss_bytes) for s in samples], completions, start, per, FROM_RSS)


def device_memory_slope(samples: Sequence[DeviceMemorySample], completions: Sequence[tuple[float, int]],
                        start: float) -> Slope:
    """The slope of the server's device memory per 1,000 requests, fitted as :func:`memory_slope`'s: to its
    processes' usage where NVML named them at every sample of the measured part, else to its devices' whole used
    memory; the slope's ``source`` says which (Note [device memory slope]). ValueError as :func:`memory_slope`'s."""
    last = max(t for t, _ in completions) if completions else start
    measured = [s for s in samples if start <= s.t <= last]
    if measured and all(s.tree_bytes is not None for s in measured):
        own = [(s.t, s.tree_bytes) for s in samples if s.tree_bytes is not None]
        return _fit(own, completions, start, "request", FROM_PROCESSES)
    return _fit([(s.t, s.device_bytes) for s in samples], completions, start, "request", FROM_DEVICE_TOTAL)


def paired_slope(reference: Sequence[MemorySample], candidate: Sequence[MemorySample],
                 reference_done: Sequence[tuple[float, int]], candidate_done: Sequence[tuple[float, int]],
                 reference_start: float, candidate_start: float) -> Slope:
    """The slope of the candidate's resident memory minus the reference's, per 1,000 requests, at matched completed
    requests over both measured parts (Note [paired slopes]): each sample of the candidate less the reference's
    sample nearest in requests completed. ValueError as :func:`memory_slope`'s."""
    ref, _ = _points([(s.t, s.rss_bytes) for s in reference], reference_done, reference_start, "request")
    cand, _ = _points([(s.t, s.rss_bytes) for s in candidate], candidate_done, candidate_start, "request")
    ref.sort()
    xs = [x for x, _ in ref]
    diff = []
    for x, y in cand:
        k = bisect.bisect_left(xs, x)
        near = [j for j in (k - 1, k) if 0 <= j < len(xs)]
        if near:
            j = min(near, key=lambda j: abs(xs[j] - x))
            diff.append((x, y - ref[j][1]))
    if not diff:
        raise ValueError("the reference's memory was not sampled over its measured part: no difference to fit")
    return Slope(fit_leak(diff, per="request"), len(diff), int(diff[0][1]), int(diff[-1][1]), "candidate - reference")
