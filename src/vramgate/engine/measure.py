"""What the engine worker measures, beside vLLM's own figures: weights and KV tensors and allocator peaks
read inside each model worker, engine step durations, per-request latency from vLLM's request metrics,
the versions that ran, and the planted regressions that calibration uses (Notes [planted delay] and
[planted weight bytes]).

Functions that run inside vLLM's model workers (``collective_rpc``) import torch themselves; nothing here
imports vLLM.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from vramgate.core.answers import Outputs, RequestOutput, prompts_digest
from vramgate.core.metrics import percentiles as percentiles  # re-exported: its former home
from vramgate.engine.spec import EngineSpec
from vramgate.machine.probes import memory_history
from vramgate.machine.software import software_versions
from vramgate.models import recall

#: The versions an engine run records, in the order it records them.
ENGINE_VERSIONS = ("python", "vllm", "vllm_distribution", "torch")


def engine_versions() -> dict[str, str]:
    """The versions an engine run records: python's, vLLM's (and its distribution) and torch's, when installed.

    A subset of :func:`vramgate.machine.software.software_versions`, which a baseline records: without
    vramgate's, flash-attn's and nvidia-ml-py's versions.
    """
    versions = software_versions()
    return {name: versions[name] for name in ENGINE_VERSIONS if name in versions}


def device_total_bytes(torch: Any) -> int | None:
    """CUDA device 0's memory in bytes, None without CUDA."""
    return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def worker_allocator(worker: Any) -> dict[str, int]:
    """This rank's CUDA caching-allocator figures, read inside the model worker (empty without CUDA).

    Note [allocator peak]: the peak includes the resident weights, not the
    load's own transients. vLLM 0.32.0 resets the allocator's peaks (allocated
    and reserved) as the model loads: both model runners' ``load_model`` wrap
    the load in a ``DeviceMemoryProfiler``, which on entering and on leaving
    reads ``current_platform.get_current_memory_usage``, and on CUDA that
    empties the cache and calls ``torch.cuda.reset_peak_memory_stats``. Without
    a KV budget ``memory_profiling`` resets them once more before the profile
    run; with one it is skipped. Nothing resets them later, so either way the
    peak starts at what the rank holds after loading (the resident weights)
    and covers the profile run, the CUDA-graph estimate (without a budget) and
    capture, the KV cache and generation; a load that peaks above its resident weights
    (conversion buffers) is not in it. ``tests/test_vllm_memory_contracts.py``
    pins the resets. It is read in each rank's own process: with tensor
    parallelism the driver process holds no model and its allocator says
    nothing about the ranks'.
    """
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    device = torch.cuda.current_device()
    return {"cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "cuda_allocated_bytes": int(torch.cuda.memory_allocated(device))}


#: vLLM's communication-fusion compile passes whose state an engine run reads (Note [fusion pass state]).
FUSION_PASSES = ("AllReduceFusionPass",)
#: The module that holds vLLM 0.32.0's all-reduce fusion pass and its ``flashinfer_comm`` import.
FUSION_MODULE = "vllm.compilation.passes.fusion.allreduce_rms_fusion"


def worker_fusion_passes(worker: Any) -> dict[str, Any]:
    """This rank's communication-fusion passes, read inside the model worker: per pass class, how many instances
    the compilation made, whether any is enabled, and the patterns it replaced (None where it never ran on a graph:
    a graph from the compile cache); and whether FlashInfer's comm module was found.

    Note [fusion pass state]: vLLM turns ``fuse_allreduce_rms`` into an ``AllReduceFusionPass`` in each rank's
    post-grad pass manager, and where FlashInfer's comm module is missing, the world size is unsupported or its
    workspace fails, it only logs a warning and leaves the pass ``disabled``: a "fusion on" run is then fusion off.
    The pass objects are read (``disabled``, ``matched_count``), not the log; they are found among the objects the
    garbage collector tracks (:func:`tracked_objects`), frozen ones included: vLLM ends the worker's warm-up with
    ``freeze_gc_heap()`` (``gc.freeze()``), and ``gc.get_objects()`` leaves frozen objects out."""
    import sys

    found: dict[str, Any] = {}
    for obj in tracked_objects(FUSION_PASSES):
        entry = found.setdefault(type(obj).__name__, {"instances": 0, "enabled": False, "matched": None})
        entry["instances"] += 1
        entry["enabled"] = entry["enabled"] or getattr(obj, "disabled", True) is False
        matched = getattr(obj, "matched_count", None)
        if isinstance(matched, int):
            entry["matched"] = (entry["matched"] or 0) + matched
    module = sys.modules.get(FUSION_MODULE)
    comm = None if module is None else getattr(module, "flashinfer_comm", None) is not None
    return {"passes": found, "flashinfer_comm": comm}


def tracked_objects(names: tuple[str, ...]) -> list[Any]:
    """The objects the garbage collector tracks whose class is named in *names*, those in a frozen heap included.

    Note [reading a frozen heap]: ``gc.get_objects()`` leaves out the objects ``gc.freeze()`` moved to the
    permanent generation, and vLLM freezes each worker's heap at the end of its warm-up (``freeze_gc_heap``), so a
    frozen heap (``gc.get_freeze_count()`` > 0) is unfrozen, read and frozen again, with the collector disabled
    meanwhile (then enabled again only if it was). No collection runs: nothing is freed or finalized by the reading
    (other threads of the process included). The state it
    leaves: every object vLLM froze is frozen again, and so is every object the process made since vLLM's freeze
    (the run's own), as if vLLM had frozen its heap at the reading without the collection it runs first; cyclic
    garbage among those waits for the next unfreeze instead of the next collection. A heap no one froze is read
    as it is, and left as it was."""
    import gc

    enabled = gc.isenabled()
    frozen = gc.get_freeze_count() > 0
    gc.disable()
    try:
        if frozen:
            gc.unfreeze()
        try:
            return [obj for obj in gc.get_objects() if type(obj).__name__ in names]
        finally:
            if frozen:
                gc.freeze()
    finally:
        if enabled:
            gc.enable()


def fusion_problem(ranks: list[dict[str, Any]], pass_name: str = "AllReduceFusionPass") -> str | None:
    """Why the ranks of a run that asked for *pass_name* did not run it (Note [fusion pass state]), or None."""
    if not ranks:
        return "the run read no rank's compile passes"
    for rank, state in enumerate(ranks):
        entry = state.get("passes", {}).get(pass_name)
        if entry is None:
            return f"rank {rank}: vLLM made no {pass_name} (the compile config did not ask for it, or eager mode)"
        if not entry["enabled"]:
            why = ("FlashInfer's comm module is missing" if state.get("flashinfer_comm") is False else
                   "FlashInfer does not support this world size, or its all-reduce workspace failed")
            return f"rank {rank}: vLLM disabled its {pass_name} ({why}): the run is fusion off"
        if entry["matched"] == 0:
            return f"rank {rank}: vLLM's {pass_name} ran but replaced no pattern: the run is fusion off"
    return None


def worker_memory_history_start(worker: Any, driver_pid: int) -> bool:
    """Start recording this rank's allocator history, inside the model worker (Note [memory history] in
    :mod:`vramgate.machine.probes.memory_history`); a rank in the engine's own process (*driver_pid*) records
    since before the engine started. Whether this rank records (False without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return False
    if os.getpid() != driver_pid:
        memory_history.start(torch)
    return True


def worker_memory_history_dump(worker: Any, folder: str) -> str | None:
    """Dump this rank's allocator history to ``memory-history-rank<N>.pickle`` in *folder* and stop recording,
    inside the model worker; the file's path (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    path = Path(folder) / f"memory-history-rank{int(getattr(worker, 'rank', 0) or 0)}.pickle"
    try:
        return str(memory_history.dump(torch, path))
    finally:
        memory_history.stop(torch)


def worker_figures(worker: Any) -> dict[str, Any]:
    """Weights and KV tensor bytes, read inside the model worker."""
    runner = worker.model_runner
    seen: set[int] = set()
    weights = parameters = 0
    params = list(runner.model.parameters())
    for i, t in enumerate(params + list(runner.model.buffers())):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
            parameters += t.numel() * t.element_size() if i < len(params) else 0
    seen.clear()
    kv = 0
    caches = getattr(runner, "kv_caches", None) or []
    for t in caches:
        if hasattr(t, "untyped_storage") and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            kv += t.untyped_storage().nbytes()
    groups = []
    config = getattr(runner, "kv_cache_config", None)
    for g in getattr(config, "kv_cache_groups", []):
        spec = g.kv_cache_spec
        groups.append({"spec": type(spec).__name__, "layers": len(g.layer_names), "block_size": spec.block_size,
                       "page_bytes": spec.page_size_bytes})
    return {"weights_bytes": weights, "parameter_bytes": parameters, "kv_tensor_bytes": kv, "groups": groups,
            "model_memory_usage": getattr(runner, "model_memory_usage", None)}


class StepTimer:
    """Wraps the in-process engine core's step: step durations, and a planted delay for calibration.

    Note [planted delay]: ``VRAMGATE_PLANT_DELAY=0.1`` makes every engine step
    take 10% longer than it did (a busy wait after the step, proportional to
    the step's own duration). It exists to measure the gate's precision
    (``vramgate calibrate``): a known regression the gate must detect. Nothing
    sets it outside calibration.
    """

    def __init__(self, core: Any, delay: float = 0.0) -> None:
        if delay < 0:
            raise ValueError(f"{PLANT_DELAY_ENV} must be >= 0, got {delay}")
        self.core, self.delay = core, delay
        self.original = core.step_fn
        self.steps: list[float] = []
        core.step_fn = self._step

    def _step(self) -> Any:
        t0 = time.perf_counter()
        out = self.original()
        dt = time.perf_counter() - t0
        if self.delay:
            end = time.perf_counter() + self.delay * dt
            while time.perf_counter() < end:
                pass
        self.steps.append(time.perf_counter() - t0)
        return out

    def restore(self) -> None:
        """Put the engine core's own step back."""
        self.core.step_fn = self.original


#: The planted delay's fraction (Note [planted delay]).
PLANT_DELAY_ENV = "VRAMGATE_PLANT_DELAY"
#: The planted delay of a paired test's candidate alone (Note [planted delay]): the paired tests give it to their
#: candidate's engine as :data:`PLANT_DELAY_ENV`, so that a whole gate run measures its own detection.
PLANT_CANDIDATE_DELAY_ENV = "VRAMGATE_PLANT_CANDIDATE_DELAY"
#: The planted weight bytes' fraction (Note [planted weight bytes]).
PLANT_WEIGHT_BYTES_ENV = "VRAMGATE_PLANT_WEIGHT_BYTES"


def planted_fraction(name: str) -> float:
    """A planted regression's size from the environment variable *name* (a fraction); 0 when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number (a fraction like 0.1), got {raw!r}") from None
    if not 0 <= value <= 10:
        raise ValueError(f"{name} must be between 0 and 10, got {value}")
    return value


def planted_delay() -> float:
    """The planted delay fraction (Note [planted delay]); 0 when unset."""
    return planted_fraction(PLANT_DELAY_ENV)


def plant_weight_bytes(worker: Any, fraction: float) -> int:
    """Add a buffer of *fraction* of the model's weight bytes to it (Note [planted weight bytes]).

    Note [planted weight bytes]: ``VRAMGATE_PLANT_WEIGHT_BYTES=0.01`` makes the
    loaded model 1% heavier, the way an unquantized layer or a duplicated
    parameter would. Like the planted delay it exists to measure the gate's
    precision (``vramgate calibrate``) and nothing else sets it.
    """
    import torch

    model = worker.model_runner.model
    seen: set[int] = set()
    total = 0
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    extra = int(total * fraction)
    device = next(model.parameters()).device
    model.register_buffer("vramgate_planted", torch.zeros(extra, dtype=torch.uint8, device=device), persistent=False)
    return extra


def requests_of(spec: EngineSpec, workload: Any, vocab: int, sampling: Any, *, task: bool = False,
                logprobs: int | None = None) -> tuple[list[Any], list[Any]]:
    """Token-id prompts and greedy sampling parameters that force each request's output length.

    With *task* (a recall model: Note [the same answer] in :mod:`vramgate.core.answers`) the prompts are the
    recall task's of the workload's lengths and shared prefixes (:func:`vramgate.models.recall.prompts`), so the
    scheduler sees the requests it sees on dummy weights; *logprobs*: the top logprobs each generated position
    returns (None: none asked for, as on dummy weights)."""
    if task:
        ids = recall.prompts(spec.seed, [r.prompt_len for r in workload.requests],
                             [r.prefix_len for r in workload.requests])
    else:
        ids = workload.prompt_token_ids(vocab)
    prompts = [{"prompt_token_ids": p} for p in ids]
    extra = {} if logprobs is None else {"logprobs": logprobs}
    params = [sampling(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True, temperature=0.0,
                       seed=spec.seed + i, **extra) for i, r in enumerate(workload.requests)]
    return prompts, params


def outputs_of(prompts: list[Any], outputs: list[Any], top_k: int) -> Outputs:
    """What vLLM generated for token-id *prompts* (``{"prompt_token_ids": ...}``, as :func:`requests_of` makes them;
    *outputs*: ``LLM.generate``'s, in the same order): per request the tokens, each position's logprobs and the recall
    task's expected answer (Note [the same answer] in :mod:`vramgate.core.answers`)."""
    ids = [list(p["prompt_token_ids"]) for p in prompts]
    requests = []
    for prompt, ro in zip(ids, outputs, strict=True):
        out = ro.outputs[0]
        tokens = [int(t) for t in out.token_ids]
        positions = [{int(t): float(lp.logprob) for t, lp in (pos or {}).items()} for pos in (out.logprobs or [])]
        requests.append(RequestOutput(tokens, positions, recall.expected(prompt, len(tokens))))
    return Outputs(requests, top_k=top_k, prompts_sha256=prompts_digest(ids), task="recall")


def request_latency(outputs: list[Any]) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and end-to-end latency from vLLM's request metrics."""
    ttft, tpot, e2e = [], [], []
    for ro in outputs:
        n = len(ro.outputs[0].token_ids)
        m = ro.metrics
        if m is None:
            continue
        decode = m.last_token_ts - m.first_token_ts
        ttft.append(m.first_token_latency)
        e2e.append(m.first_token_latency + decode)
        if n > 1:
            tpot.append(decode / (n - 1))
    return {"ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e}

