"""The engine subprocess: ``python -m vramgate.engine.worker SPEC.json RESULT.json``.

Runs vLLM's offline ``LLM`` on one :class:`~vramgate.engine.runner.EngineSpec` and
writes an :class:`~vramgate.engine.runner.EngineResult` as JSON. Started by
:func:`vramgate.engine.runner.run_engine`, which sets the environment.

Note [in-process engine]: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's
engine core (scheduler, KV cache manager and, on CPU and single-GPU, the model
worker) in this process. That makes the process's peak RSS the engine's, and
lets :class:`~vramgate.sim.simulate.SchedulerProbe` watch the real scheduler step by
step (blocks in use, preemptions, recomputed tokens, waste). Latencies come
from vLLM's own per-request stats (``disable_log_stats=False``).

Note [KV budget]: the budget is passed as ``kv_cache_memory_bytes``.
``VLLM_CPU_KVCACHE_SPACE`` is removed from the environment: vLLM parses it as
whole GiB and, when set, it overrides ``kv_cache_memory_bytes``.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

from vramgate.core.metrics import median
from vramgate.engine.runner import EngineSpec
from vramgate.machine import isa
from vramgate.models.config import load_model
from vramgate.workloads import build


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def q(p: float) -> float:
        k = (len(ordered) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": sum(ordered) / len(ordered), "p50": median(ordered), "p90": q(0.9), "p99": q(0.99),
            "max": ordered[-1]}


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("vllm", "vllm-cpu"):
        try:
            out["vllm"] = metadata.version(dist)
            out["vllm_distribution"] = dist
            break
        except metadata.PackageNotFoundError:
            continue
    try:
        out["torch"] = metadata.version("torch")
    except metadata.PackageNotFoundError:
        pass
    return out


def _device_total(torch: Any) -> int | None:
    """CUDA device 0's memory in bytes, None without CUDA."""
    return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def _worker_allocator(worker: Any) -> dict[str, int]:
    """This rank's CUDA caching-allocator figures, read inside the model worker (empty without CUDA).

    Note [allocator peak]: vLLM resets the allocator's peak after loading the
    weights (before its profile run), so the peak covers the profile run, the
    KV cache and generation, not the weights (``weights_bytes``). It is read in
    each rank's own process: with tensor parallelism the driver process holds
    no model and its allocator says nothing about the ranks'.
    """
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    device = torch.cuda.current_device()
    return {"cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "cuda_allocated_bytes": int(torch.cuda.memory_allocated(device))}


def _worker_figures(worker: Any) -> dict[str, Any]:
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


#: What a GPU engine needs next to its weights and KV cache (CUDA context, activations of the profile run,
#: CUDA graphs, NCCL), for the start-up check that ``gpu_memory_utilization`` drives (Note [GPU utilization]).
GPU_HEADROOM_BYTES = 4 << 30
#: vLLM's default fraction; the gate never asks for more.
GPU_UTILIZATION_MAX = 0.92


def gpu_utilization(kv_bytes: int, weights_bytes: int, device_total_bytes: int) -> float:
    """The ``gpu_memory_utilization`` a GPU engine with a fixed KV budget starts with.

    Note [GPU utilization]: with ``kv_cache_memory_bytes`` set, vLLM 0.32.0
    sizes the KV cache from it and uses ``gpu_memory_utilization`` for one
    thing only: at start it refuses to run unless ``total x utilization``
    bytes are free (``v1/worker/utils.request_memory``). Left at 0.92, two
    paired engines, or one engine on a GPU that something else uses, cannot
    start. So the gate asks for what the run needs: the KV budget, the bf16
    weights (an upper bound for a quantized checkpoint) and
    :data:`GPU_HEADROOM_BYTES`, as a fraction of the device, between 1% and
    :data:`GPU_UTILIZATION_MAX`.
    """
    if device_total_bytes <= 0:
        raise ValueError(f"device memory must be positive, got {device_total_bytes}")
    need = kv_bytes + weights_bytes + GPU_HEADROOM_BYTES
    return round(min(GPU_UTILIZATION_MAX, max(0.01, need / device_total_bytes)), 4)


def llm_kwargs(spec: EngineSpec, model_dir: Path, device_total_bytes: int | None = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for *spec* (model config folder *model_dir*, dummy weights): the
    one place that builds vLLM's engine arguments, for both tiers. On a GPU (*device_total_bytes* given) the
    start-up utilization follows Note [GPU utilization] unless the spec's engine arguments set it."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype=spec.dtype,
        block_size=spec.block_size, max_model_len=spec.max_model_len, max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens, kv_cache_dtype=spec.kv_cache_dtype,
        enforce_eager=spec.enforce_eager, enable_prefix_caching=spec.enable_prefix_caching,
        tensor_parallel_size=spec.tensor_parallel_size, kv_cache_memory_bytes=int(spec.kv_budget_gib * 2**30),
        seed=spec.seed, disable_log_stats=False,
    )
    if spec.attention_backend:
        kwargs["attention_backend"] = spec.attention_backend
    if spec.quantization:
        kwargs["quantization"] = spec.quantization
    if device_total_bytes:
        from vramgate.models.config import ModelConfigError
        from vramgate.models.quant import QuantConfigError, load_config, weight_size

        try:
            weights = weight_size(load_config(model_dir / "config.json"), "bf16").total_bytes
        except (ModelConfigError, QuantConfigError):  # no config, or one the weight-size model does not cover:
            # the headroom must do
            weights = 0
        kwargs["gpu_memory_utilization"] = gpu_utilization(kwargs["kv_cache_memory_bytes"], weights,
                                                           device_total_bytes)
    kwargs.update(spec.engine_args)
    return kwargs


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
        self.core.step_fn = self.original


PLANT_DELAY_ENV = "VRAMGATE_PLANT_DELAY"
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


def _plant_weight_bytes(worker: Any, fraction: float) -> int:
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


def run(spec: EngineSpec, root: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch
    from vllm import LLM, SamplingParams

    from vramgate.sim.simulate import SchedulerProbe

    t_import = time.perf_counter() - t0
    shape = load_model(root, spec.model)
    workload = build(spec.workload, requests=spec.requests, seed=spec.seed, max_model_len=spec.max_model_len,
                     arrival_rate=spec.arrival_rate, root=root, **spec.workload_params)
    on_gpu = torch.cuda.is_available()
    kwargs = llm_kwargs(spec, shape.path.parent, _device_total(torch))
    t1 = time.perf_counter()
    llm = LLM(**kwargs)
    t_init = time.perf_counter() - t1
    engine = llm.llm_engine
    cfg = engine.vllm_config
    cache, sched_cfg = cfg.cache_config, cfg.scheduler_config
    notes = []
    if cache.block_size != spec.block_size:
        notes.append(f"vLLM ran with block_size {cache.block_size}, not the {spec.block_size} asked for")
    if not sched_cfg.enable_chunked_prefill:
        notes.append("chunked prefill is off in this engine (vLLM's platform turned it off)")
    if spec.enable_prefix_caching and not cache.enable_prefix_caching:
        notes.append("prefix caching is off in this engine (vLLM's platform turned it off)")
    planted = planted_fraction(PLANT_WEIGHT_BYTES_ENV)
    if planted:
        engine.collective_rpc(_plant_weight_bytes, args=(planted,))
    ranks = engine.collective_rpc(_worker_figures)  # one entry per tensor-parallel rank
    worker = ranks[0]

    core = getattr(engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine core is not in this process; set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    sched = core.scheduler
    probe = SchedulerProbe(sched, cache.block_size)
    original_schedule = sched.schedule

    def schedule(*args: Any, **kw: Any) -> Any:
        out = original_schedule(*args, **kw)
        if out.total_num_scheduled_tokens:
            probe.observe(out, 1.0)
        return out

    sched.schedule = schedule
    timer = StepTimer(core, planted_delay())
    prompts, params = _requests(spec, workload, int(cfg.model_config.get_vocab_size()), SamplingParams)
    t2 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t_generate = time.perf_counter() - t2
    probe.restore()
    timer.restore()
    sched.schedule = original_schedule

    per_request = _request_latency(outputs)
    ttft, tpot, e2e = per_request["ttft_s"], per_request["tpot_s"], per_request["e2e_s"]
    queue, lens = [], []
    out_tokens = preempted = cached = 0
    for ro in outputs:
        n = len(ro.outputs[0].token_ids)
        lens.append(n)
        out_tokens += n
        cached += ro.num_cached_tokens or 0
        m = ro.metrics
        if m is not None:
            queue.append(m.scheduled_ts - m.queued_ts)
            preempted += m.num_preemptions or 0
    allocators = engine.collective_rpc(_worker_allocator)  # after generation: Note [allocator peak]
    stats = sched.kv_cache_manager.prefix_cache_stats
    memory: dict[str, Any] = {
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "weights_bytes": worker["weights_bytes"],
        "parameter_bytes": worker["parameter_bytes"],
        "kv_tensor_bytes": worker["kv_tensor_bytes"],
        "vllm_model_memory_usage": worker["model_memory_usage"],
        "ranks": [{"weights_bytes": r["weights_bytes"], "kv_tensor_bytes": r["kv_tensor_bytes"],
                   "model_memory_usage": r["model_memory_usage"], **a} for r, a in zip(ranks, allocators,
                                                                                        strict=True)],
    }
    # Note [allocator peak]: per rank, in the ranks' own processes; rank 0's is the headline figure.
    memory.update(allocators[0] if allocators else {})
    page = worker["groups"][0]["page_bytes"] if worker["groups"] else None
    layers = sum(g["layers"] for g in worker["groups"])
    return {
        "spec": spec.to_json(),
        "versions": _versions(),
        "device": torch.cuda.get_device_name(0) if on_gpu else f"cpu ({platform.machine()})",
        "kv": {
            "block_size": cache.block_size,
            "num_gpu_blocks": cache.num_gpu_blocks,
            "usable_blocks": cache.num_gpu_blocks - 1,
            "page_bytes": page,
            "num_layers": layers,
            "bytes_per_token": page * layers // cache.block_size if page else None,
            "capacity_tokens": cache.kv_cache_size_tokens,
            "budget_bytes": kwargs["kv_cache_memory_bytes"],
            "groups": worker["groups"],
        },
        "memory": memory,
        "scheduler": {
            "steps": probe.steps,
            "peak_blocks_in_use": probe.peak,
            "preemptions": probe.preemptions,
            "preemptions_by_request": preempted,
            "recomputed_tokens": probe.recomputed,
            "prefix_cache_queries": int(stats.queries) if stats else None,
            "prefix_cache_hits": int(stats.hits) if stats else None,
            "cached_prompt_tokens": cached,
            "internal_waste_mean": probe.waste_mean,
            "internal_waste_max": probe.waste_max,
            "chunked_prefill": sched_cfg.enable_chunked_prefill,
            "prefix_caching": cache.enable_prefix_caching,
            "async_scheduling": sched_cfg.async_scheduling,
        },
        "latency": {
            "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "queue_s": queue, "output_lens": lens,
            "ttft": _percentiles(ttft), "tpot": _percentiles(tpot), "e2e": _percentiles(e2e),
            "output_tokens": out_tokens,
            "prompt_tokens": workload.prompt_tokens,
            "output_throughput_tokens_per_s": out_tokens / t_generate if t_generate else 0.0,
        },
        "timing": {"import_s": t_import, "init_s": t_init, "generate_s": t_generate,
                   "total_s": time.perf_counter() - t0},
        "notes": notes,
        "planted_delay": timer.delay,
    }


def _requests(spec: EngineSpec, workload: Any, vocab: int, sampling: Any) -> tuple[list[Any], list[Any]]:
    """Token-id prompts and greedy sampling parameters that force each request's output length."""
    prompts = [{"prompt_token_ids": ids} for ids in workload.prompt_token_ids(vocab)]
    params = [sampling(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True, temperature=0.0,
                       seed=spec.seed + i) for i, r in enumerate(workload.requests)]
    return prompts, params


def _request_latency(outputs: list[Any]) -> dict[str, list[float]]:
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


def _exit_with_parent() -> None:
    """End this process when the one that started it goes away (a server must not outlive its gate run)."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="vramgate-parent-watch", daemon=True).start()


def serve(spec: EngineSpec, root: Path, control: Path) -> None:
    """Keep one engine up and run the spec's workload once per ``round N`` line on stdin.

    Note [paired rounds]: :mod:`vramgate.engine.paired` runs two of these (a reference
    and a candidate engine) and alternates rounds between them, so both see the
    same machine state; only one works at a time. After start-up the worker
    writes ``ready.json`` into *control*; each round writes ``round-N.json``
    (per-request latencies, engine step durations, wall time); ``quit`` ends it.
    """
    _exit_with_parent()
    delay = planted_delay()  # a bad value fails before the engine starts
    import torch
    from vllm import LLM, SamplingParams

    shape = load_model(root, spec.model)
    workload = build(spec.workload, requests=spec.requests, seed=spec.seed, max_model_len=spec.max_model_len,
                     arrival_rate=spec.arrival_rate, root=root, **spec.workload_params)
    t1 = time.perf_counter()
    llm = LLM(**llm_kwargs(spec, shape.path.parent, _device_total(torch)))
    init_s = time.perf_counter() - t1
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine core is not in this process; set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    prompts, params = _requests(spec, workload, vocab, SamplingParams)
    timer = StepTimer(core, delay)
    _write_json(control / "ready.json", {"init_s": init_s, "versions": _versions(), "planted_delay": timer.delay})
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            break
        if words[0] != "round" or len(words) != 2 or not words[1].isdigit():
            raise ValueError(f"unknown command {line.strip()!r}: expected 'round N' or 'quit'")
        timer.steps.clear()
        t2 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t2
        _write_json(control / f"round-{words[1]}.json",
                    {**_request_latency(outputs), "steps_s": list(timer.steps), "wall_s": wall})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str), encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    serving = argv[:1] == ["--serve"]
    if serving:
        argv = argv[1:]
    if len(argv) != 2:
        print("usage: python -m vramgate.engine.worker SPEC.json RESULT.json\n"
              "       python -m vramgate.engine.worker --serve SPEC.json CONTROL_DIR", file=sys.stderr)
        return 2
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    data = json.loads(spec_path.read_text(encoding="utf-8"))
    spec = EngineSpec.from_json(data["spec"], str(spec_path))
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # Note [KV budget]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # Note [in-process engine]
    isa.apply_cap()  # Note [ISA cap]: before vLLM picks its kernel library
    try:
        if serving:
            serve(spec, Path(data["root"]), out_path)
        else:
            _write_json(out_path, run(spec, Path(data["root"])))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # vLLM may leave threads behind that would block a normal exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
