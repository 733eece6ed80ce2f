"""The ``vramgate`` command line: the parser, built from the command modules
(:mod:`vramgate.tools.commands`), and the dispatch to the command a user names."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vramgate.tools.commands import (
    baselines,
    calibrate,
    changes,
    doctor,
    engine,
    gpu_cleanup,
    hardware,
    history,
    install_engine,
    matrix,
    patches,
    plan,
    report,
    simulate,
    trace,
    upgrade,
)

#: The command modules, in the order ``vramgate --help`` lists their commands.
COMMANDS = (hardware, doctor, simulate, engine, patches, report, history, baselines, gpu_cleanup, calibrate, plan,
            install_engine, upgrade, trace, matrix, changes)


def build_parser() -> argparse.ArgumentParser:
    """The ``vramgate`` parser with every command's subparser."""
    parser = argparse.ArgumentParser(prog="vramgate", description="GPU memory and latency gate for vLLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command *argv* names; its exit status (2 with the message on stderr for an error a user can fix)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # pragma: no cover
        return 0
    except (ValueError, OSError, RuntimeError) as exc:  # incl. ProfileError, PatchError, SpecError
        print(f"vramgate: error: {exc}", file=sys.stderr)
        return 2
