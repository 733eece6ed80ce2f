"""Fixtures of the quantization suite: checkpoints generated into the run folder, and the engine runs on them.

Every run uses the ``small_run_spec`` workload of the capacity and latency
suites (tiny-llama, 16 requests of 128 + 64 tokens). The bf16 reference is
that very spec (dummy weights, 0.25 GiB of KV), so a full gate session runs it
once. Each quantized run loads its generated checkpoint (engine argument
``model`` = the folder, ``load_format = "safetensors"``) under the same total
memory budget: the reference's checkpoint bytes plus its KV budget. Its KV
budget is that total minus its own checkpoint bytes, i.e. the reference's KV
budget plus the bytes quantization freed (Note [fixed total budget]).

Note [fixed total budget]: on a GPU vLLM gives the KV cache what
``gpu_memory_utilization`` leaves after weights and activations; on CPU the
KV budget is set directly. To measure what a fixed total does with the freed
bytes on both tiers alike, the suite sets the KV budget of each quantized run
to ``reference KV budget + (bf16 checkpoint bytes - its checkpoint bytes)``
and reads the capacity vLLM allocates.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vramgate.engine.runner import EngineResult, EngineSpec, engine_tier
from vramgate.models.quant import load_config
from vramgate.profiles.manifest import Profile, find_profile
from vramgate.pytest_plugin.fixture import Gate

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
SEED = 0
#: tiny-llama's block size on each tier (vLLM's CPU attention needs a multiple of 32), as the capacity suite runs it.
BLOCK_SIZE = 32 if engine_tier() == "cpu" else 16
_KERNEL_LINE = re.compile(r"Using (\w+) for (\w+)")


class Checkpoints:
    """Checkpoints of :data:`MODEL` written once per session into the run folder (never fetched)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.config = load_config(ROOT / "fixtures" / "models" / MODEL / "config.json")
        self._made: dict[tuple[str, int], Any] = {}

    def get(self, scheme: str, group_size: int = 128) -> Any:
        """The :class:`~vramgate.models.checkpoints.Checkpoint` of *scheme* (``bf16``, ``awq``, ``gptq``, ``w4a16``)."""
        from vramgate.models.checkpoints import write_checkpoint

        key = (scheme, group_size)
        if scheme == "w4a16":
            pytest.importorskip("compressed_tensors", reason="W4A16 checkpoints are written by compressed-tensors")
        if key not in self._made:
            self._made[key] = write_checkpoint(self.config, scheme, self.folder / f"{MODEL}-{scheme}-g{group_size}",
                                               seed=SEED, group_size=group_size,
                                               where=f"fixtures/models/{MODEL}/config.json")
        return self._made[key]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Tiny checkpoints in the real on-disk formats, generated from seeded weights: ``checkpoints.get("awq")``."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


def quant_profile(name: str) -> Profile:
    """The profile *name*, which must declare the checkpoint it serves."""
    profile = find_profile(ROOT, name)
    if profile.checkpoint is None:
        pytest.fail(f"profile {name} is in suite 'quantization' but has no [checkpoint] table", pytrace=False)
    return profile


class QuantRuns:
    """The bf16 reference run and each quantization profile's run under the same total memory budget."""

    def __init__(self, engine: Any, small_run_spec: Callable[[str, int], EngineSpec],
                 checkpoints: Checkpoints) -> None:
        self.engine, self.checkpoints = engine, checkpoints
        self.reference = small_run_spec(MODEL, BLOCK_SIZE)

    @property
    def kv_budget(self) -> int:
        """The reference's KV budget in bytes."""
        return int(self.reference.kv_budget_gib * 2**30)

    def freed_bytes(self, name: str) -> int:
        """bf16 checkpoint bytes minus the profile's checkpoint bytes (both read from the written files)."""
        ck = quant_profile(name).checkpoint
        assert ck is not None
        return int(self.checkpoints.get("bf16").total_bytes - self.checkpoints.get(ck.format, ck.group_size)
                   .total_bytes)

    def spec(self, name: str) -> EngineSpec:
        """The engine spec of ``bf16`` (the reference) or of a quantization profile."""
        if name == "bf16":
            return self.reference
        ck = quant_profile(name).checkpoint
        assert ck is not None
        folder = self.checkpoints.get(ck.format, ck.group_size).path
        # Note [fixed total budget]: bytes / 2**30 and back is exact in binary floating point.
        budget_gib = (self.kv_budget + self.freed_bytes(name)) / 2**30
        return self.reference.replace(profile=name, kv_budget_gib=budget_gib,
                                      engine_args={"model": str(folder), "load_format": "safetensors"})

    def run(self, name: str) -> EngineResult:
        """The engine run of ``bf16`` or of a quantization profile (once per session)."""
        result: EngineResult = self.engine.run(self.spec(name))
        return result

    @staticmethod
    def kernels(result: EngineResult) -> dict[str, str]:
        """``{vLLM method: kernel}`` as the engine's log names them (``Using CPUWNA16LinearKernel for ...``)."""
        log = Path(result.run_dir) / "engine.log"
        text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
        return {m.group(2): m.group(1) for m in _KERNEL_LINE.finditer(text) if m.group(1).endswith("Kernel")}


@pytest.fixture(scope="session")
def quant_runs(engine: Any, small_run_spec: Callable[[str, int], EngineSpec], checkpoints: Checkpoints) -> QuantRuns:
    """Engine runs of the bf16 reference and of each quantization profile: ``quant_runs.run("quant-awq")``."""
    return QuantRuns(engine, small_run_spec, checkpoints)


def check_claims(gate: Gate, name: str, workload: str, patched: dict[str, float],
                 reference: dict[str, float]) -> None:
    """The verdict of each claim of profile *name* on *workload*: its run's figures against the bf16 reference's."""
    try:
        gate.profile_claims(quant_profile(name), workload, patched, reference, labels=("quantized", "bf16"),
                            context=MODEL)
    except ValueError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def profile_claims() -> Callable[[Gate, str, str, dict[str, float], dict[str, float]], None]:
    """``profile_claims(gate, profile, workload, quantized figures, bf16 figures)``: report the profile's claims."""
    return check_claims
