"""What several commands share: the ``--root`` option and the project root it names."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TypeAlias

#: The object ``add_subparsers`` returns, to which a command module adds its subparser.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_root(parser: argparse.ArgumentParser) -> None:
    """Add the ``--root`` option (the project root) to a command's *parser*."""
    parser.add_argument("--root", help="project root (default: the current folder)")


def project_root(arg: str | None) -> Path:
    """The project root ``--root`` names (default: the current folder); it must hold ``fixtures/models``."""
    root = Path(arg) if arg else Path.cwd()
    if not (root / "fixtures" / "models").is_dir():
        raise ValueError(f"{root} has no fixtures/models folder; run from the project root or pass --root")
    return root.resolve()
