"""``vramgate calibrate``: the gate's own false alarms and detections on this machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``calibrate`` command."""
    cal = sub.add_parser("calibrate", help="measure the gate's own false alarms and detections on this machine")
    campaigns = cal.add_subparsers(dest="campaign", metavar="{paired}")
    from vramgate.tools.calibration.gate_paired.cli import add_arguments

    paired = campaigns.add_parser("paired", help="the paired latency tests per gate run, beside the other worker: "
                                                "run a campaign, or analyze saved ones (docs/calibration.md)")
    add_arguments(paired)
    paired.set_defaults(func=run_paired, parser=paired)
    cal.add_argument("--out", help="folder for calibration.json, calibration.md and the runs' files (required "
                                   "without a campaign)")
    cal.add_argument("--model", default="tiny-llama", help="a model under fixtures/models (default tiny-llama)")
    cal.add_argument("--pairs", type=int, default=3, help="engine pairs per condition (default 3)")
    cal.add_argument("--rounds", type=int, default=90, help="round pairs per engine pair (default 90)")
    cal.add_argument("--trial-rounds", type=int, default=30, help="rounds per trial, as the gate's test (default 30)")
    cal.add_argument("--exact-reruns", type=int, default=1, help="unchanged reruns for the exact metrics (default 1)")
    cal.add_argument("--from", dest="from_json", metavar="JSON", nargs="+",
                     help="recompute the figures from saved calibration.json files (pooled) instead of running")
    add_root(cal)
    cal.set_defaults(func=run)


def run_paired(args: argparse.Namespace) -> int:
    """``vramgate calibrate paired run|analyze`` (Note [per-gate-run campaign] in
    :mod:`vramgate.tools.calibration.gate_paired`)."""
    from vramgate.tools.calibration.gate_paired.cli import dispatch

    return dispatch(args, args.parser, project_root(args.root))


def run(args: argparse.Namespace) -> int:
    """Run a calibration campaign (or pool saved ones); write calibration.json and calibration.md."""
    from vramgate.tools.calibration.engine_latency import Campaign, figures_json, merge_campaigns, render, run_campaign

    if not args.out:
        raise ValueError("vramgate calibrate: --out is required (or name a campaign: vramgate calibrate paired)")
    out = Path(args.out)
    if args.from_json:
        data = merge_campaigns([json.loads(Path(f).read_text(encoding="utf-8")) for f in args.from_json])
        data["campaign"]["trial_rounds"] = args.trial_rounds
        data["figures"] = figures_json(data["raw"], args.trial_rounds, data["campaign"]["stats"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    else:
        for name in ("pairs", "rounds", "trial_rounds"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if args.trial_rounds > args.rounds:
            raise ValueError("--trial-rounds must not exceed --rounds")
        campaign = Campaign(model=args.model, pairs=args.pairs, rounds=args.rounds, trial_rounds=args.trial_rounds,
                            exact_reruns=args.exact_reruns)
        data = run_campaign(project_root(args.root), out, campaign)
    text = render(data)
    (out / "calibration.md").write_text(text, encoding="utf-8")
    print(text)
    return 0
