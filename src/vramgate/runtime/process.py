"""Child processes of the gate: the PYTHONPATH that finds this package, and (see below) launch, kill, tail."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

#: The folder that holds this ``vramgate`` package (``src/`` in a source tree, ``site-packages`` when installed).
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def pythonpath(env: Mapping[str, str], first: Iterable[Path] = ()) -> str:
    """A PYTHONPATH for a child that imports this same ``vramgate``: *first* (overlays, stand-ins), then
    this package's folder, then whatever *env* already had."""
    paths = [str(p) for p in first]
    paths.append(str(PACKAGE_PARENT))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    return os.pathsep.join(paths)
