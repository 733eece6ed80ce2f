"""``vramgate hardware``: this machine's fingerprint and hardware key."""

from __future__ import annotations

import argparse
import json
import sys

from vramgate.machine import hardware
from vramgate.machine.software import software_versions
from vramgate.tools.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    """Add the ``hardware`` command."""
    hw = sub.add_parser("hardware", help="print this machine's fingerprint and hardware key")
    hw.add_argument("--json", action="store_true", help="print JSON")
    hw.add_argument("--expect", metavar="CLASS", help="exit 1 unless the hardware key contains CLASS (e.g. h100)")
    hw.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the fingerprint (or check it against ``--expect``)."""
    fp = hardware.detect()
    if args.expect:
        if not hardware.matches_gpu_class(fp.key, args.expect):
            print(f"vramgate: this machine's hardware key is {fp.key!r}, which does not match the expected "
                  f"{args.expect!r} (a runner label that names the wrong GPU?)", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"fingerprint": fp.to_json(), "software": software_versions()}, indent=2, sort_keys=True))
        return 0
    print(f"key:      {fp.key}   (machine-bound metrics)")
    print(f"tier:     {fp.tier}   (portable metrics under {fp.portable_key})")
    print(f"device:   {fp.device}")
    print(f"cpu:      {fp.cpu_model} ({fp.arch}, {fp.cpu_count} logical cores)")
    if fp.isa:
        extra = fp.extra
        cap = f", capped by VRAMGATE_CPU_ISA={extra['isa_cap']}" if "isa_cap" in extra else ""
        print(f"isa:      {fp.isa} (detected {extra.get('isa_detected', '?')}{cap}; vLLM CPU kernels "
              f"{extra.get('vllm_kernel_library', '?')}); flags: {' '.join(fp.flags) or 'none'}")
    print(f"memory:   {fp.memory_bytes / 2**30:.1f} GiB")
    for i, gpu in enumerate(fp.gpus):
        cap = f", capability {gpu.capability[0]}.{gpu.capability[1]}" if gpu.capability else ""
        print(f"gpu {i}:    {gpu.name}, {gpu.memory_bytes / 2**30:.1f} GiB{cap}")
    if fp.driver or fp.cuda:
        print(f"driver:   {fp.driver or '?'}; CUDA {fp.cuda or '?'}")
    for name, version in sorted(software_versions().items()):
        print(f"{name + ':':<10}{version}")
    return 0
