"""``vramgate plan``: analytic weight bytes of the model configs per quantization scheme."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``plan`` command."""
    plan = sub.add_parser("plan", help="analytic weight bytes of the model configs per quantization scheme")
    plan.add_argument("model", nargs="*", help="models under fixtures/models or config.json paths (default: all)")
    plan.add_argument("--scheme", action="append", help="bf16, fp16, awq, gptq, w4a16, w8a16 or fp8 (repeatable; "
                      "default: all)")
    plan.add_argument("--group-size", type=int, default=128, help="inputs per scale group of the 4-bit schemes")
    plan.add_argument("--json", action="store_true", help="print the rows as JSON")
    add_root(plan)
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the weight bytes of each model and scheme (a table, or the rows as JSON)."""
    from vramgate.models.config import available_models, read_config
    from vramgate.models.quant import SCHEMES, format_bytes, weight_size

    root = project_root(args.root)
    schemes = args.scheme or list(SCHEMES)
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        raise ValueError(f"unknown scheme(s) {', '.join(unknown)}; accepted: {', '.join(SCHEMES)}")
    if args.group_size < 1:
        raise ValueError(f"--group-size {args.group_size}: need a positive number of inputs per group")
    rows = []
    for model in args.model or available_models(root):
        path = Path(model) if model.endswith(".json") else root / "fixtures" / "models" / model / "config.json"
        if not path.is_file():
            raise ValueError(f"model {model!r}: no {path}; available: {', '.join(available_models(root))}")
        cfg = read_config(path)
        name = path.parent.name
        bf16 = weight_size(cfg, "bf16", model=name, where=str(path)).total_bytes
        for scheme in schemes:
            size = weight_size(cfg, scheme, args.group_size, model=name, where=str(path))
            rows.append({"model": name, "scheme": scheme, "group_size": size.group_size, "params": size.params,
                         "total_bytes": size.total_bytes, "linear_bytes": size.linear_bytes,
                         "dense_bytes": size.dense_bytes, "bits_per_linear_weight": size.bits_per_linear_weight,
                         "vs_bf16": size.total_bytes / bf16})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':<18}{'scheme':<8}{'params':>16}  {'weights':<26}{'linear bits/w':>14}{'vs bf16':>9}")
    for r in rows:
        print(f"{r['model']:<18}{r['scheme']:<8}{r['params']:>16,}  {format_bytes(r['total_bytes']):<26}"
              f"{r['bits_per_linear_weight']:>14.3f}{r['vs_bf16']:>9.3f}")
    print(f"group size {args.group_size} for awq, gptq, w4a16; embeddings, LM head, norms and routers in 16 bits "
          "(see vramgate.models.quant)")
    return 0
