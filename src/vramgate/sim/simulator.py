"""vLLM 0.32.0's real scheduler and KV cache manager, driven by a synthetic model runner.

No weights, no workers: the real ``Scheduler`` (or ``AsyncScheduler``) and its
``KVCacheManager``/``BlockPool`` decide admission, chunked prefill, prefix-cache
hits and preemption exactly as in the engine; a fake model runner returns one
deterministic token per request whose prefill is complete, and a virtual clock
advances by a deterministic step cost. Everything is a function of the inputs:
two runs give identical figures.

Note [GPU-like settings]: vLLM's CPU platform rewrites the scheduler config
(for MLA without AMX it forces block size 16 and turns chunked prefill and
prefix caching off; it always turns async scheduling off). The simulator builds
the config through vLLM, then restores what was asked, GPU defaults included
(chunked prefill on, prefix caching on, async scheduling on), and lists every
setting it restored in ``SimResult.config_overrides``.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.core.records import record_fields
from vramgate.runtime.vllm_env import in_process_defaults, setdefault
from vramgate.sim.probe import SchedulerProbe
from vramgate.workloads import Workload

#: Virtual step time: a + b x scheduled tokens + c x scheduled requests (seconds).
DEFAULT_STEP_COST = (5e-3, 5e-5, 0.0)


class SimulationError(RuntimeError):
    """A simulation that cannot run (bad sizes) or did not make progress."""


@dataclass
class SimResult:
    """Scheduler figures of one simulated run (see the module Notes, and Note [waste] in :mod:`vramgate.sim.probe`)."""

    model: str
    workload: str
    requests: int
    seed: int
    block_size: int
    num_gpu_blocks: int
    usable_blocks: int
    settings: dict[str, Any]
    config_overrides: dict[str, list[Any]]
    steps: int
    peak_blocks_used: int
    preemptions: int
    preempted_requests: int
    recomputed_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    internal_waste_mean: float
    """Time-weighted mean of the per-step internal waste."""
    internal_waste_max: float
    waste_bound_violations: int
    """Steps whose waste exceeded ``(block_size - 1) x running / tokens held`` (must be 0)."""
    output_tokens: int
    scheduled_tokens: int
    virtual_makespan_s: float
    throughput_tokens_per_s: float
    mean_latency_s: float
    peak_blocks_by_step: list[int] = field(default_factory=list, repr=False)
    timing: dict[str, float] = field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prefix-cache hits as a fraction of queries (0 without queries)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def figures(self) -> dict[str, Any]:
        """Every deterministic figure (timings and the per-step trace left out)."""
        data = dataclasses.asdict(self)
        data.pop("timing")
        data.pop("peak_blocks_by_step")
        data["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        return data

    def to_json(self) -> dict[str, Any]:
        """The figures and the timing, as JSON (the per-step trace is not in it)."""
        data = self.figures()
        data["timing"] = dict(self.timing)
        return data

    @classmethod
    def from_json(cls, data: object, where: str) -> SimResult:
        """The result whose JSON form (:meth:`to_json`) is *data*; :class:`SimulationError` naming *where* and
        the field when it is not one."""
        return cls(**record_fields(cls, data, where, SimulationError, ignore_unknown=True))


def settings_of_engine(spec: dict[str, Any], *, block_size: int, num_gpu_blocks: int, prefix_caching: bool,
                       async_scheduling: bool) -> dict[str, Any]:
    """The :func:`simulate` settings that reproduce an engine run: its spec, and the KV pool and scheduler
    settings the engine reported (``EngineResult.simulator_settings`` gives them from a result).

    Async scheduling is the engine's own: vLLM turns it on by default on CUDA and off on CPU, and it changes
    the steps and the block counts, so a simulator left at one setting disagrees with the other tier's engine.
    """
    return dict(block_size=int(block_size), num_gpu_blocks=int(num_gpu_blocks),
                max_model_len=int(spec["max_model_len"]), max_num_seqs=int(spec["max_num_seqs"]),
                max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
                enable_prefix_caching=bool(prefix_caching), async_scheduling=bool(async_scheduling))


def _build_config(model_dir: Path, *, block_size: int, max_model_len: int, max_num_seqs: int,
                  max_num_batched_tokens: int, enable_prefix_caching: bool, async_scheduling: bool,
                  kv_cache_dtype: str, engine_args: dict[str, Any]) -> tuple[Any, dict[str, list[Any]]]:
    from vllm.engine.arg_utils import EngineArgs

    from vramgate.models.vllm_kv import engine_config

    kwargs: dict[str, Any] = dict(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, block_size=block_size,
        enable_chunked_prefill=True, enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, seed=0,
        kv_cache_dtype=kv_cache_dtype,
    )
    kwargs.update(engine_args)
    try:
        args = EngineArgs(**kwargs)
    except TypeError as exc:
        raise SimulationError(f"engine arguments {sorted(engine_args)}: {exc}") from None
    cfg = engine_config(args)  # Note [vLLM's environment changes] in vramgate.models.vllm_kv
    overrides: dict[str, list[Any]] = {}

    def restore(obj: Any, name: str, want: Any) -> None:  # Note [GPU-like settings]
        got = getattr(obj, name)
        if got != want:
            overrides[f"{type(obj).__name__}.{name}"] = [got, want]
            setattr(obj, name, want)

    sc, cc = cfg.scheduler_config, cfg.cache_config
    restore(cc, "block_size", block_size)
    restore(sc, "enable_chunked_prefill", True)
    restore(cc, "enable_prefix_caching", enable_prefix_caching)
    restore(sc, "max_num_batched_tokens", max_num_batched_tokens)
    restore(sc, "max_num_seqs", max_num_seqs)
    restore(sc, "async_scheduling", async_scheduling)
    return cfg, overrides


def _build_scheduler(cfg: Any, num_gpu_blocks: int) -> tuple[Any, Any, int]:
    """Mirror ``EngineCore._initialize_kv_caches`` and the scheduler's construction."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.structured_output import StructuredOutputManager

    from vramgate.models.vllm_compat import kv_cache_configs
    from vramgate.models.vllm_kv import layer_specs
    from vramgate.sim.vllm_compat import store_block_sizes

    register_all_kvcache_specs(cfg)
    specs = layer_specs(cfg)
    cfg.cache_config.num_gpu_blocks_override = num_gpu_blocks
    page_bytes = sum(s.page_size_bytes for s in specs.values())
    try:
        kv_cfgs = kv_cache_configs(cfg, [specs], [num_gpu_blocks * page_bytes])
    except ValueError as exc:
        raise SimulationError(f"KV cache of {num_gpu_blocks} blocks cannot serve this model length: {exc}") from None
    for k in kv_cfgs:
        k.kv_cache_layout = cfg.cache_config.kv_cache_layout
    kv_cfg = generate_scheduler_kv_cache_config(kv_cfgs)
    cfg.cache_config.num_gpu_blocks = kv_cfg.num_blocks
    cfg.cache_config.block_size = min(g.kv_cache_spec.block_size for g in kv_cfg.kv_cache_groups)
    cfg.validate_block_size()
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cfg, cfg)
    store_block_sizes(kv_cfg, cfg, sched_bs, hash_bs)  # the one difference between vLLM 0.31 and 0.32 here
    cls = AsyncScheduler if cfg.scheduler_config.async_scheduling else Scheduler
    sched = cls(
        vllm_config=cfg, kv_cache_config=kv_cfg, structured_output_manager=StructuredOutputManager(cfg),
        block_size=sched_bs, hash_block_size=hash_bs, include_finished_set=False, log_stats=False,
    )
    # Prefix-cache counts accumulate in the KV cache manager; with the scheduler's
    # log_stats off, nothing drains them between steps.
    sched.kv_cache_manager.log_stats = True
    sched.kv_cache_manager.prefix_cache_stats = PrefixCacheStats()
    hasher = None
    if cfg.cache_config.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(hash_bs, hash_fn)
    return sched, hasher, sched_bs


def simulate(
    model_dir: Path,
    workload: Workload,
    *,
    block_size: int = 16,
    num_gpu_blocks: int = 8192,
    max_model_len: int = 4096,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = True,
    kv_cache_dtype: str = "auto",
    step_cost: Sequence[float] = DEFAULT_STEP_COST,
    keep_trace: bool = False,
    engine_args: dict[str, Any] | None = None,
) -> SimResult:
    """Run *workload* through vLLM's scheduler with a pool of *num_gpu_blocks* blocks."""
    setdefault(in_process_defaults())
    t0 = time.perf_counter()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    t_import = time.perf_counter() - t0
    if num_gpu_blocks < 2:
        raise SimulationError(f"num_gpu_blocks must be >= 2 (one is vLLM's null block), got {num_gpu_blocks}")
    if workload.max_len > max_model_len:
        raise SimulationError(f"workload {workload.name!r} has a request of {workload.max_len} tokens "
                              f"> max_model_len {max_model_len}")
    cfg, overrides = _build_config(
        model_dir, block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
        async_scheduling=async_scheduling, kv_cache_dtype=kv_cache_dtype, engine_args=dict(engine_args or {}),
    )
    sched, hasher, sched_bs = _build_scheduler(cfg, num_gpu_blocks)
    vocab = int(cfg.model_config.get_vocab_size())
    prompts = workload.prompt_token_ids(vocab)
    specs = workload.requests
    n = len(specs)
    reqs = [
        Request(
            request_id=str(i), prompt_token_ids=prompts[i],
            sampling_params=SamplingParams(max_tokens=r.output_len, min_tokens=r.output_len, ignore_eos=True,
                                           temperature=0.0),
            pooling_params=None, arrival_time=float(r.arrival_s), block_hasher=hasher,
        )
        for i, r in enumerate(specs)
    ]
    order = sorted(range(n), key=lambda i: (specs[i].arrival_s, i))
    t_setup = time.perf_counter() - t0

    probe = SchedulerProbe(sched, sched_bs, keep_trace=keep_trace)
    # The per-step payload for model workers changes no scheduler state; there are no workers.
    sched._make_cached_request_data = lambda *a, **k: CachedRequestData.make_empty()

    a, b, c = step_cost
    clock = busy = in_vllm = 0.0
    perf_counter = time.perf_counter
    steps = idle = out_tokens = scheduled = finished = 0
    finish_time = [0.0] * n
    nxt = 0
    inflight: deque[tuple[Any, Any, float, int]] = deque()
    depth = 2 if cfg.scheduler_config.async_scheduling else 1
    gc_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    t_loop = time.perf_counter()
    try:
        while finished < n:
            while nxt < n and specs[order[nxt]].arrival_s <= clock:
                sched.add_request(reqs[order[nxt]])
                nxt += 1
            if not sched.has_requests() and not inflight:
                clock = float(specs[order[nxt]].arrival_s)
                continue
            if sched.has_requests():
                t_call = perf_counter()
                out = sched.schedule()
                in_vllm += perf_counter() - t_call
                ntok = out.total_num_scheduled_tokens
                if ntok:
                    ids = list(out.num_scheduled_tokens)
                    dt = a + b * ntok + c * len(ids)
                    probe.observe(out, dt)
                    sampled = [
                        [] if r.is_prefill_chunk else [100 + r.num_computed_tokens % 31000]
                        for r in (sched.requests[rid] for rid in ids)
                    ]
                    runner_out = ModelRunnerOutput(
                        req_ids=ids, req_id_to_index={rid: j for j, rid in enumerate(ids)}, sampled_token_ids=sampled,
                    )
                    inflight.appendleft((out, runner_out, dt, ntok))
                    if len(inflight) < depth:
                        continue
                else:
                    idle += 1
                    if not inflight:
                        if nxt < n:
                            clock = max(clock, float(specs[order[nxt]].arrival_s))
                            continue
                        if idle > 1000:
                            raise SimulationError("vLLM's scheduler made no progress (a request cannot be admitted?)")
                        continue
            if not inflight:
                continue
            out_d, runner_d, dt, ntok = inflight.pop()
            clock += dt
            busy += dt
            steps += 1
            scheduled += ntok
            t_call = perf_counter()
            sched.update_from_output(out_d, runner_d)
            in_vllm += perf_counter() - t_call
            for rid in sched.finished_req_ids:
                i = int(rid)
                finish_time[i] = clock
                out_tokens += reqs[i].num_output_tokens
                finished += 1
    finally:
        t_loop = time.perf_counter() - t_loop
        gc.unfreeze()
        if gc_enabled:
            gc.enable()
        probe.restore()
    stats = sched.kv_cache_manager.prefix_cache_stats
    settings = {
        "chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
        "prefix_caching": cfg.cache_config.enable_prefix_caching,
        "async_scheduling": cfg.scheduler_config.async_scheduling,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
        "kv_cache_dtype": kv_cache_dtype,
        "step_cost": list(step_cost),
        "engine_args": dict(engine_args or {}),
        "scheduler_module": sys.modules[type(sched).__module__].__file__,
        "note": "GPU-like scheduler settings restored over the CPU platform's (see config_overrides)",
    }
    return SimResult(
        model=model_dir.name, workload=workload.name, requests=n, seed=workload.seed, block_size=sched_bs,
        num_gpu_blocks=num_gpu_blocks, usable_blocks=probe.usable, settings=settings, config_overrides=overrides,
        steps=steps, peak_blocks_used=probe.peak, preemptions=probe.preemptions,
        preempted_requests=sum(1 for r in reqs if r.num_preemptions), recomputed_tokens=probe.recomputed,
        prefix_cache_queries=int(stats.queries), prefix_cache_hits=int(stats.hits),
        internal_waste_mean=probe.waste_mean, internal_waste_max=probe.waste_max,
        waste_bound_violations=probe.violations, output_tokens=out_tokens, scheduled_tokens=scheduled,
        virtual_makespan_s=clock, throughput_tokens_per_s=out_tokens / clock if clock else 0.0,
        mean_latency_s=sum(finish_time[i] - specs[i].arrival_s for i in range(n)) / n,
        peak_blocks_by_step=probe.trace or [],
        timing={"import_s": t_import, "setup_s": t_setup, "loop_s": t_loop, "scheduler_s": in_vllm,
                "total_s": time.perf_counter() - t0},
    )
