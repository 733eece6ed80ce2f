"""``vramgate simulate``: a workload through vLLM's real scheduler with a synthetic model runner."""

from __future__ import annotations

import argparse
import json
import os
import sys
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


def reexec_with_overlay(profile_name: str, root: Path) -> int | None:
    """Run this same command again with the profile's overlay first on PYTHONPATH (Note [overlay]); None when
    this process already runs on it (or the profile has no diffs)."""
    import subprocess
    import tempfile

    from vramgate.profiles import build_overlay, find_profile
    from vramgate.runtime.process import pythonpath

    profile = find_profile(root, profile_name)
    if not profile.series or Path(os.environ.get("VRAMGATE_OVERLAY", "/")).name.endswith(profile.digest):
        return None
    overlays = Path(os.environ.get("VRAMGATE_OVERLAY_DIR") or tempfile.mkdtemp(prefix="vramgate-overlay-"))
    overlay = build_overlay(profile, overlays)
    env = dict(os.environ, VRAMGATE_OVERLAY=str(overlay))
    env["PYTHONPATH"] = pythonpath(env, first=[overlay])
    return subprocess.call([sys.executable, "-m", "vramgate", *sys.argv[1:]], env=env)


def run(args: argparse.Namespace) -> int:
    """Simulate the workload; print the result's main figures (or all of it as JSON)."""
    import tempfile

    from vramgate.models.config import load_model
    from vramgate.profiles import find_profile
    from vramgate.runtime.vllm_env import IN_PROCESS_LOG_LEVEL, setdefault, vllm_environment
    from vramgate.sim import simulate
    from vramgate.workloads import build

    root = project_root(args.root)
    engine_args: dict[str, object] = {}
    if args.profile:
        rc = reexec_with_overlay(args.profile, root)
        if rc is not None:
            return rc
        engine_args = dict(find_profile(root, args.profile).engine_args)
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
        result = simulate(
            shape.path.parent, workload, block_size=args.block_size, num_gpu_blocks=args.kv_blocks,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
            async_scheduling=not args.sync, engine_args=engine_args,
        )
    data = result.to_json()
    data["profile"] = args.profile
    overlay = os.environ.get("VRAMGATE_OVERLAY")
    if args.profile and overlay:
        module = Path(str(data["settings"]["scheduler_module"]))
        if not module.is_relative_to(overlay):
            raise RuntimeError(f"profile {args.profile}: vLLM's scheduler was imported from {module}, "
                               f"not from the overlay {overlay}")
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        for key in ("model", "workload", "requests", "block_size", "num_gpu_blocks", "steps", "peak_blocks_used",
                    "preemptions", "recomputed_tokens", "prefix_cache_hit_rate", "internal_waste_mean",
                    "internal_waste_max", "throughput_tokens_per_s"):
            print(f"{key:<24}{data[key]}")
        print(f"{'wall time':<24}{data['timing']['total_s']:.1f} s")
    return 0
