"""How long each test took: a ``{node id: seconds}`` JSON file, and the order it gives pytest-xdist's workers.

Note [longest first]: pytest-xdist hands tests to its workers in collection
order, in chunks, so where the long tests fall decides when the run ends: on
two workers, the suites whose tests take half a minute each can all land on
one worker while the other idles at the end. With ``--gate-durations FILE``
(and ``--dist worksteal``) the workers collect the tests in an order made for
worksteal's first split, which gives each of N workers a contiguous run of
equally many tests: the tests are dealt longest first (by the seconds in FILE;
a test not in it counts as :data:`UNKNOWN_S`) to the run with the fewest seconds
that still has room, and each run is ordered longest first (the
longest-processing-time rule). Worksteal then evens out what the durations
got wrong. A test marked ``gate_reference`` (the unpatched run of a
``gate_profiles`` test, which every profile's test of it compares with) is
dealt first and starts its run: each worker computes one reference while the
other starts on a profile, which then finds the reference finished (Note
[shared results] in :mod:`vramgate.store.shared`) instead of waiting for it or
computing it itself. The order changes no result: each test's figures are its own. ``vramgate report
durations REPORT --out FILE`` writes FILE from a run's ``report.json`` (which
records every test's setup, call and teardown time). The format is
pytest-split's ``.test_durations``, so either tool can use the other's file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from vramgate.core.records import read_json

#: Seconds assumed for a test the durations file does not list: ``vramgate report durations`` leaves out the
#: tests under half a second, and a new test is assumed to be no longer.
UNKNOWN_S = 0.5


class DurationsError(ValueError):
    """A durations file that cannot be used: names the file and the entry."""


def read_durations(path: Path) -> dict[str, float]:
    """The ``{node id: seconds}`` of the file *path*; :class:`DurationsError` naming what is wrong."""
    if not path.is_file():
        raise DurationsError(f"{path}: no such durations file (write one with 'vramgate report durations')")
    data = read_json(path, DurationsError)
    return check_durations(data, str(path))


def check_durations(data: Any, where: str) -> dict[str, float]:
    """*data* as ``{node id: seconds}``; :class:`DurationsError` naming *where* and the entry that is not one."""
    if not isinstance(data, dict):
        raise DurationsError(f"{where}: expected an object of node id -> seconds, got {type(data).__name__}")
    out = {}
    for nodeid, seconds in data.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds < 0:
            raise DurationsError(f"{where}: entry {nodeid!r}: seconds must be a number >= 0, got {seconds!r}")
        out[str(nodeid)] = float(seconds)
    return out


def worker_order(nodeids: Sequence[str], durations: Mapping[str, float], workers: int,
                 first: Collection[int] = (), together: Sequence[Collection[int]] = ()) -> list[int]:
    """The indices of *nodeids* in the order that gives each of *workers* contiguous, equally many tests of
    about equal seconds by *durations*, each run longest first (Note [longest first]); ties keep their order.

    The tests in *first* (indices: reference runs that other tests read) are dealt before the others and start
    their runs, so that each worker computes a reference while the other works on something else. Each group of
    *together* (indices of tests that share what a worker holds for its session, such as a server) is dealt as
    one: its tests follow each other in one run, their seconds summed."""
    seconds = [durations.get(n, UNKNOWN_S) for n in nodeids]
    groups = [sorted(g) for g in together if g]
    grouped = {i for g in groups for i in g}
    units = groups + [[i] for i in range(len(nodeids)) if i not in grouped]
    unit_s = [sum(seconds[i] for i in u) for u in units]
    leading = set(first)
    ranked = sorted(range(len(units)), key=lambda u: (not leading.intersection(units[u]), -unit_s[u], units[u][0]))
    workers = max(1, min(workers, len(nodeids) or 1))
    # pytest-xdist's worksteal gives worker k len(pending) // (workers - k) of the tests still pending.
    room, left = [], len(nodeids)
    for k in range(workers):
        room.append(left // (workers - k))
        left -= room[-1]
    runs: list[list[int]] = [[] for _ in range(workers)]
    totals = [0.0] * workers
    for u in ranked:
        size = len(units[u])
        fits = [k for k in range(workers) if len(runs[k]) + size <= room[k]] or \
            [k for k in range(workers) if len(runs[k]) < room[k]] or list(range(workers))
        k = min(fits, key=lambda k: (totals[k], k))
        runs[k].extend(units[u])
        totals[k] += unit_s[u]
    return [i for run in runs for i in run]


def durations_text(durations: Mapping[str, float], min_s: float = 0.0) -> str:
    """The file's text: the tests of at least *min_s* seconds, by node id, to 0.1 s."""
    kept = {k: round(v, 1) for k, v in sorted(durations.items()) if v >= min_s}
    return json.dumps(kept, indent=1) + "\n"
