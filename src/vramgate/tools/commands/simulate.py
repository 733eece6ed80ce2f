"""``vramgate simulate``: a workload through vLLM's real scheduler with a synthetic model runner."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``simulate`` command."""
    sim = sub.add_parser("simulate", help="run a workload through vLLM's real scheduler with a synthetic model runner")
    sim.add_argument("--model", required=True, help="a model under fixtures/models")
    sim.add_argument("--workload", required=True,
                     help="fixed, uniform, sharegpt, shared-prefix, long-context or a saved trace")
    sim.add_argument("--requests", type=int, required=True)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--kv-blocks", type=int, default=8192, help="KV cache blocks in the pool")
    sim.add_argument("--max-model-len", type=int, default=4096)
    sim.add_argument("--max-num-seqs", type=int, default=256)
    sim.add_argument("--max-num-batched-tokens", type=int, default=8192)
    sim.add_argument("--arrival-rate", type=float, default=None,
                     help="Poisson arrivals per second (default: all at once)")
    sim.add_argument("--no-prefix-caching", action="store_true")
    sim.add_argument("--sync", action="store_true", help="synchronous scheduling (as vLLM's CPU engine runs)")
    sim.add_argument("--profile", help="an optimization profile under patches/ to apply")
    add_root(sim)
    sim.add_argument("--json", action="store_true", help="print the whole result as JSON")
    sim.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Simulate the workload; print the result's main figures (or all of it as JSON)."""
    import tempfile

    from vramgate.models.config import load_model
    from vramgate.profiles import find_profile
    from vramgate.runtime.vllm_env import IN_PROCESS_LOG_LEVEL, setdefault, vllm_environment
    from vramgate.sim.isolated import simulate_profile
    from vramgate.workloads import build

    root = project_root(args.root)
    profile = find_profile(root, args.profile) if args.profile else None
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the result
    shape = load_model(root, args.model)
    workload = build(args.workload, requests=args.requests, seed=args.seed, max_model_len=args.max_model_len,
                     arrival_rate=args.arrival_rate, root=root)
    # vLLM's caches go to the project's run folder (.gate-run/, ignored by git): kept between runs,
    # they spare vLLM's model inspection subprocess (about 8 s) on the next run.
    with tempfile.TemporaryDirectory(prefix="vramgate-sim-") as tmp:
        env = vllm_environment(Path(tmp), cache_root=root / ".gate-run" / "vllm-cache",
                               log_level=IN_PROCESS_LOG_LEVEL)
        env["VLLM_CONFIG_ROOT"] = str(root / ".gate-run" / "vllm-config")
        setdefault(env)
        # A profile with diffs runs in a child that imports the patched vLLM (Note [overlay]).
        result = simulate_profile(
            shape.path.parent, workload, profile, work_dir=Path(tmp), block_size=args.block_size,
            num_gpu_blocks=args.kv_blocks, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
            async_scheduling=not args.sync, timeout_s=None,  # a long trace runs as long as it takes
        )
    data = result.to_json()
    data["profile"] = args.profile
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        for key in ("model", "workload", "requests", "block_size", "num_gpu_blocks", "steps", "peak_blocks_used",
                    "preemptions", "recomputed_tokens", "prefix_cache_hit_rate", "internal_waste_mean",
                    "internal_waste_max", "throughput_tokens_per_s"):
            print(f"{key:<24}{data[key]}")
        print(f"{'wall time':<24}{data['timing']['total_s']:.1f} s")
    return 0
