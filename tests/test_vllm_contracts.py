"""What the gate reads of vLLM's internals, checked against the vLLM this interpreter imports.

One contract per concern where the harness reaches into vLLM (the KV specs and their layout, the scheduler the
simulator builds and the probe watches, the engine's figures, the backends profiles name). The cpu-full env runs
them under the pinned vLLM; the upgrade env (``tox -e upgrade``) runs them under each supported release's engine
environment too. A release that breaks one fails here with the name of what changed, before a suite reports a
figure built on it. Skipped without vLLM.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vramgate.core.versions import pick
from vramgate.machine.software import vllm_version
from vramgate.runtime.vllm_env import vllm_environment
from vramgate.workloads import RequestSpec, Workload

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "fixtures" / "models"
#: The releases the harness has adapters for (vramgate.sim.vllm_compat and the README's upgrade section).
SUPPORTED = {"==0.31.*": "0.31", "==0.32.*": "0.32", "==0.33.*": "0.33"}


@pytest.fixture(scope="module", autouse=True)
def vllm_in_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM importable, offline, its files in this module's own folder; the release's short name."""
    pytest.importorskip("vllm")
    version = vllm_version()
    assert version is not None
    release = pick(SUPPORTED, version, "the contract tests")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in vllm_environment(tmp_path_factory.mktemp("vllm"), log_level="WARNING").items():
            if key not in os.environ:
                mp.setenv(key, value)
        yield release


def parameters(func: object) -> set[str]:
    """The names of *func*'s parameters."""
    return set(inspect.signature(func).parameters)  # type: ignore[arg-type]


def test_kv_specs_take_the_fields_the_gate_gives() -> None:
    """models.vllm_kv.layer_specs builds both specs with these keyword arguments."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    full = {f.name for f in dataclasses.fields(FullAttentionSpec)}
    mla = {f.name for f in dataclasses.fields(MLAAttentionSpec)}
    assert {"block_size", "num_kv_heads", "head_size", "dtype", "kv_quant_mode"} <= full
    assert {"block_size", "num_kv_heads", "head_size", "dtype", "cache_dtype_str", "kv_quant_mode",
            "max_tp_shards"} <= mla


@pytest.mark.parametrize(("model", "block_size", "page_bytes"), [("tiny-llama", 16, 8192),
                                                                   ("tiny-deepseek-v2", 16, 18432)])
def test_kv_layout_through_vllm(model: str, block_size: int, page_bytes: int) -> None:
    """vLLM's own accounting gives the page the gate's formula gives (2 layers x K,V x 2 heads x 64 x bf16 x 16
    tokens per layer for tiny-llama; 576 x bf16 x 16 for tiny-deepseek-v2) and as many blocks as fit (a block holds
    a page in every layer)."""
    from vramgate.models.vllm_kv import vllm_kv_layout

    layout = vllm_kv_layout(MODELS / model, block_size=block_size, budget_bytes=1 << 24)
    assert layout.page_bytes == page_bytes
    assert layout.num_blocks == (1 << 24) // (page_bytes * layout.num_layers)


def test_scheduler_has_what_the_simulator_and_probe_use() -> None:
    """sim.simulator builds Scheduler with these arguments; sim.probe wraps _preempt_request with this signature."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.scheduler import Scheduler

    assert {"vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size",
            "include_finished_set", "log_stats"} <= parameters(Scheduler.__init__)
    assert {"request", "timestamp", "drop_stale_output"} <= parameters(Scheduler._preempt_request)
    for name in ("schedule", "update_from_output", "add_request"):
        assert callable(getattr(Scheduler, name)), name
    for name in ("generate_scheduler_kv_cache_config", "resolve_kv_cache_block_sizes",
                 "get_request_block_hasher", "init_none_hash"):
        assert callable(getattr(kv_cache_utils, name)), name


def test_the_simulator_runs_and_its_probe_sees_the_blocks(vllm_in_process: str) -> None:
    """Eight requests prefilled in one step hold the sum of their per-request block ceilings (the version adapter
    for the scheduler's KV config, the block pool and the managers' req_to_blocks the probe reads)."""
    from vramgate.sim import simulate

    sizes = [(100, 1), (17, 1), (64, 1), (333, 1)]
    workload = Workload(name="contract", seed=0, requests=tuple(RequestSpec(p, o) for p, o in sizes))
    result = simulate(MODELS / "tiny-llama", workload, block_size=16, num_gpu_blocks=256, max_model_len=1024,
                      async_scheduling=False)
    assert result.peak_blocks_used == sum(-(-p // 16) for p, _ in sizes)
    assert result.steps == 1  # one step prefills all four, and each one output token comes with it


def test_engine_figures_come_from_these_attributes() -> None:
    """engine.worker and engine.measure read the engine core, its scheduler's KV cache manager and each request's
    metrics through these names."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.stats import RequestStateStats

    assert "collective_rpc" in dir(LLMEngine)
    source = inspect.getsource(KVCacheManager.__init__)
    for attribute in ("self.block_pool", "self.coordinator", "self.prefix_cache_stats"):
        assert attribute in source, attribute
    fields = {f.name for f in dataclasses.fields(RequestStateStats)}
    assert {"queued_ts", "scheduled_ts"} <= fields


def test_backends_the_profiles_name_exist() -> None:
    """Backend validation (engine.spec.backend_problem) looks these names up in vLLM's enum."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = {e.name for e in AttentionBackendEnum}
    assert {"FLASHMLA", "TRITON_MLA", "FLASH_ATTN"} <= names


def test_the_logprob_rank_helper_is_compiled_and_runs_eagerly_with_dynamo_off() -> None:
    """Note [eager sampler helpers] in vramgate.engine.worker: vLLM's sampler counts each sampled token's rank with a
    ``torch.compile``d helper when logprobs are asked for; with Dynamo off (as the worker sets it for an eager CPU
    engine) the same helper compiles no graph and gives the same counts."""
    import torch
    from torch._dynamo.utils import counters
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    helper = logprobs.batched_count_greater_than
    assert getattr(helper, "_torchdynamo_orig_callable", None) is not None, "the rank helper is no longer compiled"
    assert sampler.batched_count_greater_than is helper, "the sampler counts ranks with another function"
    x = torch.tensor([[0.1, 0.5, 0.3, 0.9], [0.2, 0.2, 0.7, 0.1]])
    values = torch.tensor([[0.5], [0.2]])
    graphs = counters["stats"]["unique_graphs"]
    before = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        counts = helper(x, values)
    finally:
        torch._dynamo.config.disable = before
    assert counts.tolist() == [2, 3]
    assert counters["stats"]["unique_graphs"] == graphs, "the helper was compiled with Dynamo off"


def test_vllm_writes_only_the_variables_the_gate_undoes(tmp_path: Path) -> None:
    """Note [a clean start for every child] in vramgate.runtime.vllm_env: a fresh interpreter that imports vLLM,
    checks an engine config (as the simulator and the KV readings do in the gate's process) and loads its video
    decoders changes no variable of its environment but :data:`VLLM_WRITES`, and still writes ``LD_PRELOAD`` on
    Linux."""
    import json
    import subprocess
    import sys

    from vramgate.runtime.vllm_env import VLLM_WRITES, child_environment

    script = (
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "EngineArgs(model=sys.argv[1], load_format='dummy', skip_tokenizer_init=True, max_model_len=512,\n"
        "           block_size=32).create_engine_config()\n"
        "import vllm.multimodal.video\n"
        "after = dict(os.environ)\n"
        "print(json.dumps(sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))))\n"
    )
    env = {**child_environment(), **vllm_environment(tmp_path, log_level="WARNING")}
    done = subprocess.run([sys.executable, "-c", script, str(MODELS / "tiny-llama")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    changed = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert changed <= VLLM_WRITES, f"vLLM writes variables the gate does not undo: {sorted(changed - VLLM_WRITES)}"
    if sys.platform == "linux":
        assert "LD_PRELOAD" in changed, "vLLM no longer preloads its allocator for the processes it starts"


def test_the_cpu_rotary_kernel_gets_the_layout_it_reads_and_then_rotates_mla_as_vllm_native_does() -> None:
    """Note [CPU rotary layout] in vramgate.engine.cpu_rope: on CPU the pinned kernel misreads a three-dimensional
    query of several heads (a vLLM that fixes it makes the first assertion fail: then the gate installs nothing,
    and the module can go); with the layout given, MLA's rope call (a non-contiguous slice of every head's query,
    one shared key head) rotates as vLLM's own PyTorch ``forward_native`` does, and the non-rotary part is left
    alone."""
    import torch
    import vllm._custom_ops as ops
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform

    from vramgate.engine import cpu_rope

    if not current_platform.is_cpu():
        pytest.skip("the CPU kernel's contract: this vLLM is not the CPU build")
    kernel = getattr(ops.rotary_embedding, "__wrapped__", ops.rotary_embedding)
    assert cpu_rope.kernel_misreads(kernel), "the CPU rotary kernel reads 3-D queries right now: drop the layout"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "rotary_embedding", kernel)
        assert cpu_rope.install() and ops.rotary_embedding is not kernel and cpu_rope.install()
        assert not cpu_rope.kernel_misreads(ops.rotary_embedding)
        with set_current_vllm_config(VllmConfig()):
            for neox in (False, True):
                rope = get_rope(64, max_position=4096, is_neox_style=neox, dtype=torch.bfloat16,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
                positions = torch.arange(7) * 37
                q = torch.randn(7, 4, 128, dtype=torch.bfloat16)
                k = torch.randn(7, 1, 64, dtype=torch.bfloat16)
                want_q, want_k = rope.forward_native(positions, q[..., 64:].clone(), k.clone())
                got_q = q.clone()
                _, got_k = rope.forward_cpu(positions, got_q[..., 64:], k.clone())
                assert torch.equal(got_q[..., :64], q[..., :64])
                torch.testing.assert_close(got_q[..., 64:], want_q, atol=0.05, rtol=0.02)
                torch.testing.assert_close(got_k, want_k, atol=0.05, rtol=0.02)
