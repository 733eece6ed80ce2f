"""``vramgate engine``: vLLM's offline engine on a spec, in a subprocess."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``engine`` command."""
    en = sub.add_parser("engine", help="run vLLM's offline engine on a spec in a subprocess; print the result as JSON")
    en.add_argument("--spec", required=True, help="JSON file with EngineSpec fields")
    en.add_argument("--run-dir", help="folder for the run's files (default: a new temporary folder)")
    add_root(en)
    en.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the engine on the spec (with its profile applied); print the result as JSON."""
    import tempfile

    from vramgate.engine import EngineSpec, apply_profile, run_engine

    root = project_root(args.root)
    path = Path(args.spec)
    try:
        spec = EngineSpec.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="vramgate-engine-"))
    spec, paths = apply_profile(spec, root, run_dir / "overlays")
    result = run_engine(spec, root, run_dir, extra_pythonpath=paths)
    print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    return 0
