"""``vramgate calibrate paired`` (or ``python -m vramgate.tools.calibration.gate_paired``): ``run`` a campaign or
``analyze`` saved ones (Note [per-gate-run campaign] in :mod:`vramgate.tools.calibration.gate_paired`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vramgate.tools.calibration.gate_paired.analyze import analyze, ratios_in, stored_ratios
from vramgate.tools.calibration.gate_paired.campaign import run
from vramgate.tools.calibration.gate_paired.render import render
from vramgate.tools.calibration.gate_paired.rules import BASELINE_PAIRS, Rules
from vramgate.tools.calibration.gate_paired.trials import load_trials


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``run`` and ``analyze`` subcommands and their options, on *parser*."""
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--minutes", type=float, required=True)
    r.add_argument("--profiles", default="kv-fp8,block-manager-min-recompute,block-manager-watermark")
    r.add_argument("--idle", action="store_true", help="no other worker")
    r.add_argument("--rounds", type=int)
    r.add_argument("--quiet", action="store_true", help="every trial in a quiet section")
    r.add_argument("--conditions", default="unchanged,delay-10%", help="the conditions to take trials of")
    r.add_argument("--stat", help="the statistic to record (default: the tier's; step_floor: Note [step floor])")
    r.add_argument("--together", action=argparse.BooleanOptionalAction, default=None,
                   help="both engines run each pair's rounds at once (default: the tier's setting)")
    r.add_argument("--both-ways", action="store_true",
                   help="each trial taken twice, back to back: rounds together and one after the other (an A/B)")
    z = sub.add_parser("analyze")
    z.add_argument("folders", type=Path, nargs="+")
    z.add_argument("--key", default="", help="the baseline key whose stored ratios the history check uses")
    z.add_argument("--baselines", type=Path,
                   help="the baseline file (latency.json) whose ratios the history check uses: the copy a campaign "
                        "keeps of those it was judged against (instead of --key's, which move on)")
    z.add_argument("--tolerance", type=float)
    z.add_argument("--alpha", type=float)
    z.add_argument("--history-tolerance", type=float)
    z.add_argument("--looks", type=int, choices=(2, 3),
                   help="the most looks a test takes (default: the CPU tier's; Note [three looks])")
    z.add_argument("--screen", type=float,
                   help="the first look's in-run tolerance (default: the CPU tier's; 0: none, the tolerance)")
    z.add_argument("--json", type=Path, help="also write the analysis here")
    z.add_argument("--stat", help="the trials of this statistic (default: the CPU tier's)")
    z.add_argument("--together", choices=("yes", "no"),
                   help="only the trials whose rounds ran together (yes) or one after the other (no); a campaign "
                        "of run --both-ways holds both")
    z.add_argument("--indices", type=index_ranges,
                   help="only the trials of these indices, as ranges (0-43,60-77): a page's own trials, when its "
                        "campaign's file has grown since")
    z.add_argument("--rounds", type=int,
                   help="each trial's first N round pairs only: what a test of N rounds would have seen")
    z.add_argument("--model-runs", type=int, default=0, help="simulated tests per profile for the noise model")
    z.add_argument("--bootstrap", type=int, default=0,
                   help="refits of the noise model to resampled trials, for its rates' 95%% bounds (with --model-runs)")
    z.add_argument("--own-history", action="store_true",
                   help="a profile without stored baselines takes its unchanged trials, pooled by --baseline-pairs, "
                        "in turn as one")
    z.add_argument("--baseline-pairs", type=int, default=BASELINE_PAIRS,
                   help="engine pairs (unchanged trials) per baseline of --own-history (the gate records 2)")


def index_ranges(text: str) -> frozenset[int]:
    """The trial indices *text* names: comma-separated indices and inclusive ranges (``0-43,60-77``)."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError(part)
            out.update(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: indices and ranges such as 0-43,60-77") from None
    return frozenset(out)


def dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser, root: Path) -> int:
    """Run what *args* (parsed by a parser :func:`add_arguments` made) ask for, in the project *root*; option
    errors through *parser*."""
    if args.command == "analyze" and args.bootstrap and not args.model_runs:
        parser.error("--bootstrap refits the noise model: give --model-runs too")
    if args.command == "run":
        run(root, args.out, args.minutes, [p for p in args.profiles.split(",") if p], not args.idle, args.rounds,
            args.quiet, args.together, args.conditions.split(","), args.stat, args.both_ways)
        return 0
    from vramgate.engine.paired import PAIRED_DEFAULTS

    d = PAIRED_DEFAULTS["cpu"]
    changes: dict[str, Any] = {k: v for k, v in (("tolerance", args.tolerance), ("alpha", args.alpha),
                                                 ("history_tolerance", args.history_tolerance), ("looks", args.looks))
                               if v is not None}
    if args.screen is not None:
        changes["screen"] = args.screen or None  # 0: no screen
    try:
        rules = Rules.of(dataclasses.replace(d, **changes))  # the tier's settings check what is given
    except ValueError as exc:
        parser.error(str(exc))
    stat = args.stat or d.stat
    way = None if args.together is None else args.together == "yes"
    trials = [t for t in load_trials(args.folders) if t.stat == stat and (way is None or t.together is way)
              and (args.indices is None or t.index in args.indices)]
    if not trials:
        which = "" if way is None else (" with rounds together" if way else " with rounds one after the other")
        raise SystemExit(f"no trials of the statistic {stat!r}{which} in {', '.join(map(str, args.folders))}")
    if args.rounds is not None:
        short = [t.index for t in trials if len(t.ref) < args.rounds]
        if args.rounds < 1 or short:
            parser.error(f"--rounds {args.rounds}: " + ("must be at least 1" if args.rounds < 1 else
                         f"trials {', '.join(map(str, short[:5]))} have fewer round pairs"))
        trials = [dataclasses.replace(t, ref=t.ref[:args.rounds], cand=t.cand[:args.rounds]) for t in trials]
    if args.key and args.baselines:
        parser.error("--key and --baselines: give one")
    stored = (ratios_in(args.baselines, f"{stat}_ratio") if args.baselines else
              stored_ratios(root, args.key, f"{stat}_ratio") if args.key else None)
    result = analyze(trials, stored, rules,
                     args.model_runs, own_history=args.own_history, baseline_pairs=args.baseline_pairs,
                     bootstrap=args.bootstrap)
    result["stat"] = stat
    result["together"] = way
    result["rounds"] = args.rounds
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, sort_keys=True))
    print(render(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``run`` a campaign or ``analyze`` saved ones, in the current folder (see the package's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m vramgate.tools.calibration.gate_paired")
    add_arguments(parser)
    return dispatch(parser.parse_args(argv), parser, Path.cwd())
