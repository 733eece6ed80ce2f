"""``vramgate gpu-cleanup``: end this user's stray GPU processes."""

from __future__ import annotations

import argparse
import os
import sys

from vramgate.tools.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    """Add the ``gpu-cleanup`` command."""
    clean = sub.add_parser("gpu-cleanup", help="end this user's stray GPU processes (CI runners, before and after)")
    clean.add_argument("--dry-run", action="store_true", help="only list them")
    clean.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """End (or with ``--dry-run`` list) this user's stray GPU processes; leave other users' alone."""
    from vramgate.machine.gpu_processes import ancestors, end, gpu_processes, stray
    from vramgate.machine.probes.nvml import NVMLUnavailable

    try:
        procs = gpu_processes()
    except NVMLUnavailable as exc:
        print(f"gpu-cleanup: cannot see the GPUs' processes: {exc}", file=sys.stderr)
        return 2
    if not procs:
        print("gpu-cleanup: no GPU compute processes on the visible GPUs: nothing to do")
        return 0
    ours, foreign = stray(procs, os.getuid(), protected=ancestors(os.getpid()))
    for p in foreign:
        print(f"gpu-cleanup: process {p.pid} of user {p.uid} holds {p.used_bytes / 2**20:.0f} MiB on GPU "
              f"{p.device}; not ours, left alone (measured metrics on this box are not trustworthy)")
    if not ours:
        return 0
    print(f"gpu-cleanup: {'would end' if args.dry_run else 'ending'} stray process(es) {ours}")
    if args.dry_run:
        return 0
    survivors = end(ours)
    if survivors:
        print(f"gpu-cleanup: could not end {survivors}", file=sys.stderr)
        return 1
    return 0
