"""The engine subprocess: ``python -m vramgate.engine.worker SPEC.json RESULT.json``.

Runs vLLM's offline ``LLM`` on one :class:`~vramgate.engine.spec.EngineSpec` and
writes an :class:`~vramgate.engine.runner.EngineResult` as JSON (on a recall model with what it generated: Note
[the same answer] in :mod:`vramgate.core.answers`). Started by
:func:`vramgate.engine.runner.run_engine`, which sets the environment. Or, with ``--serve``, keeps one
engine up for paired rounds (Note [paired rounds]). Its engine arguments come from
:mod:`vramgate.engine.arguments`, its figures beside vLLM's from :mod:`vramgate.engine.measure`.

Note [in-process engine]: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's
engine core (scheduler, KV cache manager and, on CPU and single-GPU, the model
worker) in this process. That makes the process's peak RSS the engine's, and
lets :class:`~vramgate.sim.probe.SchedulerProbe` watch the real scheduler step by
step (blocks in use, preemptions, recomputed tokens, waste). Latencies come
from vLLM's own per-request stats (``disable_log_stats=False``).

Note [no CUDA before the ranks]: with tensor parallelism vLLM starts its ranks from this process, by fork unless
CUDA is initialized here (``utils/system_utils._maybe_force_spawn``); then it spawns them, fresh interpreters that
keep nothing this process installed, and the context here takes memory on rank 0's device besides. So nothing here
initializes CUDA before the engine has started its ranks: the device's size comes through vLLM's platform (NVML:
``engine_kwargs(..., cuda_context=False)``), torch answers ``is_available`` through NVML
(``PYTORCH_NVML_BASED_CUDA_CHECK``, in the engine's environment from
:func:`vramgate.engine.runner.engine_process_env`, and set by vLLM on import), and the allocator history starts here
only for a rank in this process (TP 1).

Note [eager sampler helpers]: with ``enforce_eager`` vLLM compiles nothing of the model, but two helpers of its
sampler stay decorated with ``torch.compile``: ``v1/sample/ops/logprobs.py`` ``batched_count_greater_than`` (each
sampled token's rank, when a request asks for logprobs) and ``v1/sample/ops/topk_topp_sampler.py``
``compiled_random_sample`` (random sampling, which the gate never asks for). On CPU the first call compiles C++
through Inductor (a compiler and a linker, in the middle of the measured generation): a recall model's run, which
asks for logprobs to judge its answers (Note [the same answer] in :mod:`vramgate.core.answers`), paid most of its
generation for it with an empty cache and seconds with a warm one (docs/running.md, "Where the time goes"); the
dummy-weight runs ask for no logprobs and never call it. So on CPU, where the spec is eager, Dynamo is off for the
run: the helper runs as plain torch, the same counts (``(x >= values).sum(-1)``), and the run costs what its
workload costs. A GPU run keeps vLLM's compilation as it is (the GPU tier measures it).

Note [KV budget]: the budget is passed as ``kv_cache_memory_bytes``.
``VLLM_CPU_KVCACHE_SPACE`` is removed from the environment: vLLM parses it as
whole GiB and, when set, it overrides ``kv_cache_memory_bytes``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from vramgate.core.answers import TOP_K
from vramgate.engine import cpu_rope, diff_lines
from vramgate.engine.arguments import engine_kwargs
from vramgate.engine.figures import KVFigures, LatencyFigures, MemoryFigures, SchedulerFigures
from vramgate.engine.measure import (
    PLANT_WEIGHT_BYTES_ENV,
    StepTimer,
    engine_versions,
    outputs_of,
    percentiles,
    plant_weight_bytes,
    planted_delay,
    planted_fraction,
    request_latency,
    requests_of,
    worker_allocator,
    worker_figures,
    worker_fusion_passes,
    worker_memory_history_dump,
    worker_memory_history_start,
)
from vramgate.engine.memory_decision import (
    decide,
    install_hooks,
    worker_load_peak,
    worker_memory_decision,
    worker_reset_peak,
)
from vramgate.engine.spec import ENGINE_RESULT_FORMAT, EngineSpec, kv_budget_bytes
from vramgate.engine.vllm_plugin import MEMORY_HOOKS_ENV
from vramgate.machine import isa
from vramgate.machine.probes import memory_history
from vramgate.models.config import load_model
from vramgate.models.recall import RecallModel
from vramgate.models.vllm_kv import inspection_in_process
from vramgate.runtime import process
from vramgate.store.files import atomic_write_text
from vramgate.workloads import build


def run(spec: EngineSpec, root: Path, history_dir: Path | None = None) -> dict[str, Any]:
    """Run *spec*'s workload once on a fresh engine; the :class:`~vramgate.engine.runner.EngineResult` as JSON.

    With *history_dir* (and CUDA), every rank records its allocator history from the engine's start and dumps
    it there after generation; ``memory.memory_history`` lists the files (Note [memory history] in
    :mod:`vramgate.machine.probes.memory_history`)."""
    t0 = time.perf_counter()
    import torch
    from vllm import LLM, SamplingParams

    from vramgate.sim.probe import SchedulerProbe

    t_import = time.perf_counter() - t0
    shape = load_model(root, spec.model)
    workload = build(spec.workload, requests=spec.requests, seed=spec.seed, max_model_len=spec.max_model_len,
                     arrival_rate=spec.arrival_rate, root=root, **spec.workload_params)
    on_gpu = torch.cuda.is_available()  # through NVML: Note [no CUDA before the ranks]
    automatic = kv_budget_bytes(spec) is None  # Note [automatic KV] in vramgate.engine.memory_decision
    kwargs = engine_kwargs(spec, shape.path.parent, cuda_context=False)  # Note [no CUDA before the ranks]
    if automatic:
        # Note [hooks in every rank] in vramgate.engine.vllm_plugin: the plugin installs them in the ranks vLLM
        # spawns; installed here too, they reach the rank in this process and those vLLM forks, plugin or not.
        os.environ[MEMORY_HOOKS_ENV] = "1"
        install_hooks()
    history = history_dir is not None and on_gpu
    if history and spec.tensor_parallel_size == 1:
        memory_history.start(torch)  # the rank in this process: weights, profile run and KV cache included
    if not on_gpu and spec.enforce_eager:
        torch._dynamo.config.disable = True  # Note [eager sampler helpers]
    t1 = time.perf_counter()
    with inspection_in_process():  # Note [model inspection] in vramgate.models.vllm_kv
        llm = LLM(**kwargs)
    t_init = time.perf_counter() - t1
    engine = llm.llm_engine
    if history:
        engine.collective_rpc(worker_memory_history_start, args=(os.getpid(),))
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
        engine.collective_rpc(plant_weight_bytes, args=(planted,))
    ranks = engine.collective_rpc(worker_figures)  # one entry per tensor-parallel rank
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
    answering = answers_wanted(kwargs)  # Note [the same answer] in vramgate.core.answers
    prompts, params = requests_of(spec, workload, int(cfg.model_config.get_vocab_size()), SamplingParams,
                                  task=answering, logprobs=TOP_K if answering else None)
    if automatic and not on_gpu:  # every rank's peak from here: the load's, not the warm-up's (Note [full KV cache])
        engine.collective_rpc(worker_reset_peak)
    t2 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t_generate = time.perf_counter() - t2
    probe.restore()
    timer.restore()
    sched.schedule = original_schedule

    per_request = request_latency(outputs)
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
    allocators = engine.collective_rpc(worker_allocator)  # after generation: Note [allocator peak]
    # Note [fusion pass state]: only a tensor-parallel run has communication to fuse (the pass is off at TP 1)
    fusion = engine.collective_rpc(worker_fusion_passes) if spec.tensor_parallel_size > 1 else []
    decision = None
    if automatic:
        peaks = engine.collective_rpc(worker_load_peak)
        # every rank's side: the smallest rank's KV memory is every rank's (Note [the smallest rank decides])
        decision = decide(core, cache, cfg.model_config, engine.collective_rpc(worker_memory_decision),
                          max(peaks) if peaks else None).to_json()
    stats = sched.kv_cache_manager.prefix_cache_stats
    dumped = engine.collective_rpc(worker_memory_history_dump, args=(str(history_dir),)) if history else None
    # The figures are built as their records (vramgate.engine.figures), so a field this worker misses or misspells
    # fails here and under the type checker, not where the runner reads the result back.
    memory = MemoryFigures(
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        weights_bytes=worker["weights_bytes"],
        parameter_bytes=worker["parameter_bytes"],
        kv_tensor_bytes=worker["kv_tensor_bytes"],
        vllm_model_memory_usage=worker["model_memory_usage"],
        ranks=[{"weights_bytes": r["weights_bytes"], "kv_tensor_bytes": r["kv_tensor_bytes"],
                "model_memory_usage": r["model_memory_usage"], **a} for r, a in zip(ranks, allocators, strict=True)],
        # Note [allocator peak]: per rank, in the ranks' own processes; rank 0's is the headline figure.
        **(allocators[0] if allocators else {}),
        memory_history=[p for p in dumped if p] if dumped is not None else None,
    )
    page = worker["groups"][0]["page_bytes"] if worker["groups"] else 0  # no KV cache: no page
    layers = sum(g["layers"] for g in worker["groups"])
    kv = KVFigures(
        block_size=cache.block_size,
        num_gpu_blocks=cache.num_gpu_blocks,
        usable_blocks=cache.num_gpu_blocks - 1,
        page_bytes=page,
        num_layers=layers,
        bytes_per_token=page * layers // cache.block_size if page else 0,
        capacity_tokens=cache.kv_cache_size_tokens,
        budget_bytes=kwargs.get("kv_cache_memory_bytes"),
        groups=worker["groups"],
    )
    scheduler = SchedulerFigures(
        steps=probe.steps,
        peak_blocks_in_use=probe.peak,
        preemptions=probe.preemptions,
        preemptions_by_request=preempted,
        recomputed_tokens=probe.recomputed,
        prefix_cache_queries=int(stats.queries) if stats else None,
        prefix_cache_hits=int(stats.hits) if stats else None,
        cached_prompt_tokens=cached,
        internal_waste_mean=probe.waste_mean,
        internal_waste_max=probe.waste_max,
        chunked_prefill=sched_cfg.enable_chunked_prefill,
        prefix_caching=cache.enable_prefix_caching,
        async_scheduling=sched_cfg.async_scheduling,
    )
    latency = LatencyFigures(
        ttft_s=ttft, tpot_s=tpot, e2e_s=e2e, queue_s=queue, output_lens=lens,
        ttft=percentiles(ttft), tpot=percentiles(tpot), e2e=percentiles(e2e),
        output_tokens=out_tokens,
        prompt_tokens=workload.prompt_tokens,
        output_throughput_tokens_per_s=out_tokens / t_generate if t_generate else 0.0,
    )
    result: dict[str, Any] = {
        "schema": ENGINE_RESULT_FORMAT.current,
        "spec": spec.to_json(),
        "versions": engine_versions(),
        "device": torch.cuda.get_device_name(0) if on_gpu else f"cpu ({platform.machine()})",
        "kv": dataclasses.asdict(kv),
        "memory": dataclasses.asdict(memory),
        "scheduler": dataclasses.asdict(scheduler),
        "latency": dataclasses.asdict(latency),
        "compilation": {"fusion": fusion},
        "timing": {"import_s": t_import, "init_s": t_init, "generate_s": t_generate,
                   "total_s": time.perf_counter() - t0},
        "notes": notes,
        "planted_delay": timer.delay,
        "decision": decision,
    }
    if answering:  # on dummy weights the result has no outputs at all
        result["outputs"] = outputs_of(prompts, outputs, TOP_K).to_json()
    return result


def answers_wanted(kwargs: dict[str, Any]) -> bool:
    """Whether an engine of vLLM arguments *kwargs* generates answers worth keeping (Note [the same answer] in
    :mod:`vramgate.core.answers`): the folder it loads (``model``: the fixture's, or a checkpoint written for it) has
    weights of their own (:class:`vramgate.models.recall.RecallModel`), and it loads them (not
    ``load_format="dummy"``)."""
    model_dir = Path(str(kwargs["model"]))
    return kwargs.get("load_format") != "dummy" and RecallModel.read(model_dir) is not None


def serve(spec: EngineSpec, root: Path, control: Path) -> None:
    """Keep one engine up and run the spec's workload once per ``round N`` line on stdin.

    Note [paired rounds]: :mod:`vramgate.engine.paired` runs two of these (a reference
    and a candidate engine) and alternates rounds between them, so both see the
    same machine state; only one works at a time. After start-up the worker
    writes ``ready.json`` into *control*; each round writes ``round-N.json``
    (per-request latencies, engine step durations, wall time); ``quit`` ends it.
    """
    process.end_with_parent()  # Note [no child outlives its gate] in vramgate.runtime.process
    delay = planted_delay()  # a bad value fails before the engine starts
    from vllm import LLM, SamplingParams

    shape = load_model(root, spec.model)
    workload = build(spec.workload, requests=spec.requests, seed=spec.seed, max_model_len=spec.max_model_len,
                     arrival_rate=spec.arrival_rate, root=root, **spec.workload_params)
    t1 = time.perf_counter()
    kwargs = engine_kwargs(spec, shape.path.parent, cuda_context=False)  # Note [no CUDA before the ranks]
    with inspection_in_process():  # Note [model inspection] in vramgate.models.vllm_kv
        llm = LLM(**kwargs)
    init_s = time.perf_counter() - t1
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine core is not in this process; set VLLM_ENABLE_V1_MULTIPROCESSING=0")
    vocab = int(llm.llm_engine.vllm_config.model_config.get_vocab_size())
    answering = answers_wanted(kwargs)  # the same prompts as run(); no logprobs: rounds are timed
    prompts, params = requests_of(spec, workload, vocab, SamplingParams, task=answering)
    timer = StepTimer(core, delay)
    _write_json(control / "ready.json",
                {"init_s": init_s, "versions": engine_versions(), "planted_delay": timer.delay})
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
        tokens = {"token_ids": [[int(t) for t in ro.outputs[0].token_ids] for ro in outputs]} if answering else {}
        _write_json(control / f"round-{words[1]}.json",
                    {**request_latency(outputs), "steps_s": list(timer.steps), "wall_s": wall, **tokens})


def preload() -> None:
    """What every engine run imports, for a preloaded interpreter to do once (Note [preloaded engines] in
    :mod:`vramgate.runtime.preload`): the ISA cap first, then torch and vLLM's offline engine."""
    isa.apply_cap()  # Note [ISA cap]
    import torch  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    from vramgate.sim.probe import SchedulerProbe  # noqa: F401


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True, default=str))


def main(argv: list[str]) -> int:
    """Entry point: ``python -m vramgate.engine.worker [--serve] SPEC.json RESULT.json|CONTROL_DIR``."""
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
    diff_lines.install()  # Note [diff ran]: before vLLM's modules run (nothing unless the run watches a diff)
    try:
        cpu_rope.install()  # Note [CPU rotary layout]: before the model runs (the ranks vLLM forks inherit it)
        if serving:
            serve(spec, Path(data["root"]), out_path)
        else:
            history_dir = out_path.parent if memory_history.requested() else None
            _write_json(out_path, run(spec, Path(data["root"]), history_dir))
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
