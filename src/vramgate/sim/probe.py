"""Watching a live vLLM scheduler: blocks in use, preemptions, recomputed tokens, internal waste.

The simulator (:mod:`vramgate.sim.simulator`) and the engine worker (:mod:`vramgate.engine.worker`) both
watch vLLM's real scheduler with :class:`SchedulerProbe`.

Note [waste]: internal waste at a step is the unfilled share of the slots that
running requests own: ``(owned blocks x block_size - tokens held) /
(owned blocks x block_size)``. Counting owned blocks per request (rather than
the pool's used blocks) keeps it correct when prefix blocks are shared. Per
step it can never exceed ``(block_size - 1) x running / tokens held``.
"""

from __future__ import annotations

from typing import Any


class SchedulerProbe:
    """Watches a live vLLM scheduler: blocks in use, preemptions, recomputed tokens, waste.

    Used by the simulator and by the engine worker alike. :meth:`observe` is
    called right after each ``schedule()`` with the step's weight (its virtual
    or measured duration). Preemptions are seen by wrapping the scheduler's
    ``_preempt_request``; a preempted request's computed tokens are its
    high-water mark, and scheduled positions below it count as recomputed
    (positions recovered from the prefix cache are not scheduled, so not counted).
    """

    def __init__(self, sched: Any, block_size: int, *, keep_trace: bool = False) -> None:
        self.sched = sched
        self.block_size = block_size
        self.pool = sched.kv_cache_manager.block_pool
        self.usable = self.pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        self.req_to_blocks = [m.req_to_blocks for m in managers]
        self.lost: dict[str, int] = {}
        self.preemptions = self.recomputed = self.peak = self.violations = self.steps = 0
        self.waste_weighted = self.weight = self.waste_max = 0.0
        self.trace: list[int] | None = [] if keep_trace else None
        self._original = sched._preempt_request

        def preempt(request: Any, timestamp: float, drop_stale_output: bool = False) -> Any:
            self.lost[request.request_id] = max(self.lost.get(request.request_id, 0), request.num_computed_tokens)
            self.preemptions += 1
            return self._original(request, timestamp, drop_stale_output=drop_stale_output)

        sched._preempt_request = preempt

    def restore(self) -> None:
        """Give the scheduler its own ``_preempt_request`` back."""
        self.sched._preempt_request = self._original

    def observe(self, out: Any, weight: float = 1.0) -> None:
        """Count one step whose ``schedule()`` returned *out*, weighing its waste by *weight*."""
        sched, bs = self.sched, self.block_size
        if self.lost:
            for rid, k in out.num_scheduled_tokens.items():
                hw = self.lost.get(rid)
                if hw is not None:
                    end = sched.requests[rid].num_computed_tokens
                    if end - k < hw:
                        self.recomputed += min(hw, end) - (end - k)
                    if end >= hw:
                        del self.lost[rid]
        used = self.usable - self.pool.get_num_free_blocks()
        self.peak = max(self.peak, used)
        if self.trace is not None:
            self.trace.append(used)
        held = owned = 0
        for r in sched.running:
            held += r.num_computed_tokens
            owned += len(self.req_to_blocks[0][r.request_id])
        self.steps += 1
        if owned:  # Note [waste]
            waste = (owned * bs - held) / (owned * bs)
            if held and waste > (bs - 1) * len(sched.running) / (owned * bs) + 1e-12:
                self.violations += 1
            self.waste_max = max(self.waste_max, waste)
            self.waste_weighted += waste * weight
            self.weight += weight

    @property
    def waste_mean(self) -> float:
        """The weighted mean of the per-step internal waste (Note [waste])."""
        return self.waste_weighted / self.weight if self.weight else 0.0
