"""The spread of unchanged runs' logprobs, which the ``identical`` expectation's bound is set from
(docs/campaigns/identical-logprobs.md; Note [identical logprobs] in vramgate.core.answers).

    python scripts/calibrate_logprobs.py OUT_DIR            # run the engines, then analyze
    python scripts/calibrate_logprobs.py OUT_DIR --analyze  # analyze the runs already in OUT_DIR

On this machine's CPU engine (``VRAMGATE_CPU_ISA=avx2`` for the AVX2 path), each recall model answers its judging
prompts as the pre-merge test does (``recall_judging_spec``), and the pressure run of the block_manager suite
(``PRESSURE_SPEC``) runs unpatched and with the two profiles that expect identical outputs. Pairs of runs that
compute the same thing are compared (``vramgate.core.answers.compare``):

- ``repeat``: the same spec twice, one after the other;
- ``batch``: the same prompts at ``max_num_seqs`` 4 instead of vLLM's default (other batches, other orders);
- ``two engines``: the same spec in two engines at once (two pytest-xdist workers);
- ``profile``: the pressure run against a profile that must not change its outputs (other preemptions, other
  recomputation, other batches).

Each pair's largest logprob difference (one token, one position, where both sides' tokens agree so far) and whether
the tokens agree are printed and written to ``OUT_DIR/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from vramgate.core.answers import Outputs, compare
    from vramgate.engine.runner import run_engine
    from vramgate.machine import isa
    from vramgate.testing.engines import PRESSURE_SPEC, RECALL_MODELS, recall_judging_spec

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--analyze", action="store_true", help="only compare the runs already in OUT")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    specs = {}
    for arch in sorted(RECALL_MODELS):
        base = recall_judging_spec(arch)
        specs[f"{arch}/a"] = base
        specs[f"{arch}/b"] = base
        specs[f"{arch}/batch4"] = base.replace(max_num_seqs=4)
        specs[f"{arch}/twin1"] = base
        specs[f"{arch}/twin2"] = base
    specs["pressure/a"] = PRESSURE_SPEC
    specs["pressure/b"] = PRESSURE_SPEC
    for profile in ("block-manager-watermark", "block-manager-min-recompute"):
        specs[f"pressure/{profile}"] = PRESSURE_SPEC.replace(profile=profile)

    def run(name: str) -> None:
        folder = out / name.replace("/", "--")
        if (folder / "outputs.json").is_file():
            return
        result = run_engine(specs[name], ROOT, folder)
        assert result.outputs is not None, name
        (folder / "outputs.json").write_text(json.dumps(result.outputs.to_json()), encoding="utf-8")
        print(f"ran {name}", flush=True)

    if not args.analyze:
        for name in specs:
            if name.endswith("twin2"):
                continue
            if name.endswith("twin1"):
                twin = name[:-1] + "2"
                other = threading.Thread(target=run, args=(twin,))
                other.start()
                run(name)
                other.join()
            else:
                run(name)

    def outputs(name: str) -> Outputs:
        path = out / name.replace("/", "--") / "outputs.json"
        return Outputs.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))

    pairs = []
    for arch in sorted(RECALL_MODELS):
        pairs += [(f"{arch}: repeat", f"{arch}/a", f"{arch}/b"), (f"{arch}: batch", f"{arch}/a", f"{arch}/batch4"),
                  (f"{arch}: two engines", f"{arch}/twin1", f"{arch}/twin2"),
                  (f"{arch}: two engines vs alone", f"{arch}/a", f"{arch}/twin1")]
    pairs += [("pressure: repeat", "pressure/a", "pressure/b")]
    pairs += [(f"pressure: {p}", "pressure/a", f"pressure/{p}")
              for p in ("block-manager-watermark", "block-manager-min-recompute")]
    rows = []
    for label, ref, cand in pairs:
        c = compare(outputs(ref), outputs(cand))
        d = c.largest_logprob_delta
        rows.append({"pair": label, "identical_tokens": c.identical, "tokens_equal": c.tokens_equal,
                     "tokens_compared": c.tokens_compared, "max_logprob_delta": c.max_logprob_delta,
                     "where": d.to_json() if d else None})
        print(f"{label:40s} tokens {'identical' if c.identical else 'DIFFER'} "
              f"({c.tokens_equal}/{c.tokens_compared}), largest logprob difference {c.max_logprob_delta:.4g}"
              + (f" ({d.describe()})" if d else ""))
    summary = {"isa": isa.effective_isa(), "cpu_isa_cap": os.environ.get("VRAMGATE_CPU_ISA"), "pairs": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
