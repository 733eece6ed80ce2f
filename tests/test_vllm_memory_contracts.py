"""What the gate reads of vLLM's own memory sizing (Note [automatic KV] in vramgate.engine.memory_decision),
pinned against vLLM's source: the CUDA worker's memory profiling and graph capture, the CPU worker's RSS-based
sizing, the engine core's and the cache config's figures; and the online-serving entry points (the server's
``main``, its argument parser, the benchmark client's options and result fields).

The CUDA paths cannot run here, so these read the source, not a running engine: each release's ``.py`` files
(the CUDA wheel's, unpacked by ``scripts/vllm_sources.py``; ``tox -e contracts`` does it for vLLM 0.31.0, 0.32.0
and 0.33.0 and names the folders in ``VRAMGATE_VLLM_SOURCES``), and the installed vLLM's where there is one. A
release that renames one of these fails here naming it, before a GPU run records a figure built on it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest

from vramgate.engine.memory_decision import PROFILE_FIELDS


def _sources() -> list[Path]:
    found = [Path(p) for p in os.environ.get("VRAMGATE_VLLM_SOURCES", "").split(os.pathsep) if p]
    for folder in found:
        if not (folder / "vllm" / "v1" / "worker" / "gpu_worker.py").is_file():
            raise AssertionError(f"VRAMGATE_VLLM_SOURCES: {folder} holds no vLLM source (vllm/v1/worker/gpu_worker.py)")
    spec = importlib.util.find_spec("vllm")  # finds the installed package without importing it
    if spec is not None and spec.submodule_search_locations:
        found.append(Path(next(iter(spec.submodule_search_locations))).parent)
    return found


SOURCES = _sources()
pytestmark = pytest.mark.skipif(not SOURCES, reason="no vLLM source: install vLLM or set VRAMGATE_VLLM_SOURCES "
                                                   "(tox -e contracts)")


def _version(root: Path) -> str:
    version = root / "vllm" / "_version.py"
    text = version.read_text() if version.is_file() else ""
    import re

    found = re.search(r"^__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)['\"]", text, re.M) or \
        re.search(r"^__version__(?:\s*:\s*str)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else root.name


@pytest.fixture(params=SOURCES, ids=[_version(p) for p in SOURCES])
def vllm_src(request: pytest.FixtureRequest) -> Path:
    return request.param / "vllm"


def module(src: Path, name: str) -> ast.Module:
    path = src / name
    assert path.is_file(), f"vLLM {src.parent.name}: {name} is gone"
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def cls(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} is gone"
    return found[0]


def method(klass: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{klass.name}.{name} is gone"
    return found[0]


def self_assigned(node: ast.AST) -> set[str]:
    """The ``self.X`` attributes *node* assigns."""
    names = set()
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def attributes_read(node: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def calls(node: ast.AST) -> set[str]:
    """The names of what *node* calls: ``f(...)`` as ``f``, ``a.b.f(...)`` as ``f``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def fields(klass: ast.ClassDef) -> set[str]:
    return {n.target.id for n in klass.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_engine_core_keeps_the_available_kv_memory(vllm_src: Path) -> None:
    """decide() reads EngineCore.available_gpu_memory_for_kv_cache, set from the executor's
    determine_available_memory."""
    init = method(cls(module(vllm_src, "v1/engine/core.py"), "EngineCore"), "_initialize_kv_caches")
    assert "available_gpu_memory_for_kv_cache" in self_assigned(init)
    assert "determine_available_memory" in calls(init)


def test_cache_config_holds_the_capacity_figures(vllm_src: Path) -> None:
    config = cls(module(vllm_src, "config/cache.py"), "CacheConfig")
    assert {"gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks", "kv_cache_size_tokens",
            "kv_cache_max_concurrency"} <= fields(config)
    utils = (vllm_src / "v1/core/kv_cache_utils.py").read_text(encoding="utf-8")
    assert "cache_config.kv_cache_size_tokens = " in utils and "cache_config.kv_cache_max_concurrency = " in utils


def test_cpu_worker_sizes_the_kv_cache_from_its_rss_after_warm_up(vllm_src: Path) -> None:
    """worker_memory_decision reads CPUWorker.requested_cpu_memory; the plant (tests/data/profiles) patches
    CPUModelRunner.warming_up_model, which determine_available_memory runs before it reads the RSS; the memory hooks
    wrap determine_available_memory, a method of CPUWorker's own, to read the RSS's file-backed part as it returns
    (Note [file-backed RSS] in vramgate.engine.memory_decision)."""
    worker = cls(module(vllm_src, "v1/worker/cpu_worker.py"), "CPUWorker")
    assert "requested_cpu_memory" in self_assigned(method(worker, "__init__"))
    decide = method(worker, "determine_available_memory")
    assert {"requested_cpu_memory", "kv_cache_memory_bytes", "rss"} <= attributes_read(decide)
    assert {"warming_up_model", "get_memory_node_info", "get_allowed_cpu_list"} <= calls(decide)
    method(cls(module(vllm_src, "v1/worker/cpu_model_runner.py"), "CPUModelRunner"), "warming_up_model")
    utils = module(vllm_src, "utils/cpu_resource_utils.py")
    assert {"get_allowed_cpu_list", "get_memory_node_info"} <= {n.name for n in utils.body
                                                                 if isinstance(n, ast.FunctionDef)}
    assert "total_memory" in fields(cls(utils, "MemoryNodeInfo"))


def test_gpu_worker_profiles_and_keeps_what_the_gate_reads(vllm_src: Path) -> None:
    """install_hooks replaces gpu_worker.memory_profiling (a module-level name the method calls) and
    worker_memory_decision reads the worker's attributes."""
    tree = module(vllm_src, "v1/worker/gpu_worker.py")
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "memory_profiling" in imported
    worker = cls(tree, "Worker")
    decide = method(worker, "determine_available_memory")
    with_calls = {c.context_expr.func.id for n in ast.walk(decide) if isinstance(n, ast.With) for c in n.items
                  if isinstance(c.context_expr, ast.Call) and isinstance(c.context_expr.func, ast.Name)}
    assert "memory_profiling" in with_calls
    assert {"available_kv_cache_memory_bytes", "cudagraph_memory_estimate"} <= self_assigned(decide)
    assert {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "profile_cudagraph_memory", "requested_memory",
            "init_snapshot", "kv_cache_memory_bytes"} <= attributes_read(decide) | calls(decide)
    assigned = set().union(*(self_assigned(m) for m in worker.body if isinstance(m, ast.FunctionDef)))
    assert {"requested_memory", "init_snapshot"} <= assigned
    # 0.33.0 moved the capture into _compile_or_warm_up_model: the hook is on GPUModelRunner.capture_model itself
    method(worker, "compile_or_warm_up_model")
    assert "capture_model" in set().union(*(calls(m) for m in worker.body if isinstance(m, ast.FunctionDef)))


def test_profiling_result_and_snapshot_fields(vllm_src: Path) -> None:
    tree = module(vllm_src, "utils/mem_utils.py")
    assert set(PROFILE_FIELDS) <= fields(cls(tree, "MemoryProfilingResult"))
    assert {"total_memory", "free_memory"} <= fields(cls(tree, "MemorySnapshot"))
    assert "memory_profiling" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_model_runner_captures_and_estimates_graphs(vllm_src: Path) -> None:
    runner = cls(module(vllm_src, "v1/worker/gpu_model_runner.py"), "GPUModelRunner")
    capture = method(runner, "capture_model")
    assert isinstance(capture.returns, ast.Name) and capture.returns.id == "int", "capture_model returns the pool"
    method(runner, "profile_cudagraph_memory")



# -- Online serving (vramgate.engine.api_server, vramgate.engine.load_client): the entry points the gate calls
# and the options and result fields of vLLM's benchmark client it uses.


def _defines(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in tree.body)


def test_the_server_entry_point_the_gate_runs_is_there(vllm_src: Path) -> None:
    entry = module(vllm_src, "entrypoints/launchers/api_server/entry.py")
    assert _defines(entry, "main") and _defines(entry, "run_server")
    parsers = [p for p in ("entrypoints/common/cli_args.py", "entrypoints/launchers/cli_args.py")
               if (vllm_src / p).is_file()]
    assert parsers, "make_arg_parser's module is gone (vramgate.engine.api_server.server_options)"
    assert _defines(module(vllm_src, parsers[0]), "make_arg_parser")
    envs = (vllm_src / "envs.py").read_text(encoding="utf-8")
    assert '"VLLM_RPC_BASE_PATH"' in envs  # the short folder of the server's IPC sockets
    # The GPU server reads the device's memory without a CUDA context (vramgate.engine.arguments.engine_kwargs).
    nvml = cls(module(vllm_src, "platforms/cuda.py"), "NvmlCudaPlatform")
    assert "nvmlDeviceGetMemoryInfo" in attributes_read(method(nvml, "get_device_total_memory"))


def test_the_benchmark_client_takes_the_options_and_gives_the_fields_the_gate_reads(vllm_src: Path) -> None:
    serve = module(vllm_src, "benchmarks/serve.py")
    assert _defines(serve, "add_cli_args") and _defines(serve, "main")
    text = (vllm_src / "benchmarks" / "serve.py").read_text(encoding="utf-8")
    datasets = (vllm_src / "benchmarks" / "datasets" / "datasets.py").read_text(encoding="utf-8")
    for option in ("--save-detailed", "--percentile-metrics", "--metric-percentiles", "--goodput", "--ignore-eos",
                   "--disable-tqdm", "--max-concurrency", "--burstiness", "--request-rate", "--self-timed"):
        assert f'"{option}"' in text, f"vllm bench serve has no {option}"
    for option in ("--random-input-len", "--random-output-len", "--random-range-ratio", "--dataset-path"):
        assert f'"{option}"' in datasets, f"vllm bench serve's datasets have no {option}"
    assert '"timed_trace"' in datasets
    for key in ("request_goodput", "ttfts", "latencies", "start_times", "output_lens", "errors", "completed",
                "failed", "request_throughput", "output_throughput"):
        assert f'"{key}"' in text, f"vllm bench serve's result has no {key!r}"
    assert 'f"p{p_word}_{metric_attribute_name}_ms"' in text  # p50_ttft_ms, ...: LoadResult.from_client


def test_every_ipc_socket_is_named_under_vllm_rpc_base_path(vllm_src: Path) -> None:
    """Note [IPC socket path] in vramgate.runtime.vllm_env: the socket folder the gate sets is the one vLLM uses."""
    net = module(vllm_src, "utils/network_utils.py")
    fn = [n for n in net.body if isinstance(n, ast.FunctionDef) and n.name == "get_open_zmq_ipc_path"]
    assert fn and "VLLM_RPC_BASE_PATH" in attributes_read(fn[0])
    for user in ("distributed/device_communicators/shm_broadcast.py", "v1/engine/utils.py"):
        assert "get_open_zmq_ipc_path" in calls(module(vllm_src, user)), user


def test_mixed_precision_kernels_are_chosen_by_platform_and_cuda_has_no_cpu_kernel(vllm_src: Path) -> None:
    """Note [linear kernels by platform] (vramgate.testing.quantization): vLLM's 4-bit linear methods choose their
    kernel from the platform's list (``_POSSIBLE_KERNELS[current_platform._enum]``), never from the tensors'
    device, and the CUDA list holds no CPU kernel: the quantization suite's CPU case cannot run on the GPU tier."""
    tree = module(vllm_src, "model_executor/kernels/linear/__init__.py")
    table = next(node for node in tree.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                 and node.target.id == "_POSSIBLE_KERNELS")
    assert isinstance(table.value, ast.Dict)
    pairs = zip(table.value.keys, table.value.values, strict=True)
    kernels = {ast.unparse(k): {ast.unparse(e) for e in v.elts} for k, v in pairs
               if k is not None and isinstance(v, ast.List)}
    assert "CPUWNA16LinearKernel" in kernels["PlatformEnum.CPU"]
    assert {"MarlinLinearKernel", "MacheteLinearKernel"} <= kernels["PlatformEnum.CUDA"]
    assert not {k for k in kernels["PlatformEnum.CUDA"] if "CPU" in k}
    choose = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                  and node.name == "choose_mp_linear_kernel")
    assert "_POSSIBLE_KERNELS.get(current_platform._enum, [])" in ast.unparse(choose)
    assert "device" not in {a.arg for a in choose.args.args}
    for name in ("auto_awq.py", "auto_gptq.py", "compressed_tensors/schemes/compressed_tensors_wNa16.py"):
        assert "choose_mp_linear_kernel" in calls(module(vllm_src, f"model_executor/layers/quantization/{name}")), name


def test_the_cuda_platform_imports_the_extension_the_install_check_imports(vllm_src: Path) -> None:
    """vramgate.tools.install.GPU_EXTENSION is what vLLM's CUDA platform imports at module level: an environment
    where it does not import cannot start a GPU engine."""
    from vramgate.tools.install import GPU_EXTENSION

    tree = module(vllm_src, "platforms/cuda.py")
    top = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    assert GPU_EXTENSION in top


def test_vllm_looks_a_device_entry_that_is_no_index_up_by_full_uuid(vllm_src: Path) -> None:
    """Note [full UUIDs for vLLM] (vramgate.machine.devices): vLLM's CUDA platform maps a CUDA_VISIBLE_DEVICES
    entry that is not an index through nvmlDeviceGetHandleByUUID, and splits the whole value on commas."""
    nvml = cls(module(vllm_src, "platforms/cuda.py"), "NvmlCudaPlatform")
    assert "nvmlDeviceGetHandleByUUID" in calls(method(nvml, "device_control_id_to_physical_device_id"))
    base = cls(module(vllm_src, "platforms/interface.py"), "Platform")
    assert "device_control_env.split(',')" in ast.unparse(method(base, "visible_device_id_to_physical_device_id"))


def test_the_all_reduce_fusion_pass_keeps_its_state_on_the_object(vllm_src: Path) -> None:
    """Note [fusion pass state] (vramgate.engine.measure): fuse_allreduce_rms adds an AllReduceFusionPass to the
    post-grad pass manager; the pass sets ``disabled`` in __init__ (True on every early return), counts what it
    replaced in ``matched_count`` when it runs, and its module holds ``flashinfer_comm``."""
    from vramgate.engine.measure import FUSION_MODULE, FUSION_PASSES

    path = FUSION_MODULE.removeprefix("vllm.").replace(".", "/") + ".py"
    tree = module(vllm_src, path)
    klass = cls(tree, FUSION_PASSES[0])
    assert {"disabled"} <= self_assigned(method(klass, "__init__"))
    assert "matched_count" in self_assigned(method(klass, "__call__"))
    assert "flashinfer_comm" in {t.id for node in ast.walk(tree) for t in getattr(node, "targets", [])
                                 if isinstance(t, ast.Name)} | {a.asname or a.name for node in ast.walk(tree)
                                                                if isinstance(node, ast.ImportFrom | ast.Import)
                                                                for a in node.names}
    manager = ast.unparse(module(vllm_src, "compilation/passes/pass_manager.py"))
    assert "fuse_allreduce_rms" in manager and "AllReduceFusionPass(config)" in manager


def test_a_named_attention_backend_is_judged_by_its_own_validate_configuration(
    vllm_src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vramgate.engine.spec.backend_problem asks the backend a spec names its ``validate_configuration`` with the
    arguments vLLM's selector passes (``AttentionSelectorConfig``'s fields and the device capability), as vLLM's
    CUDA platform does for a chosen backend; the reasons it returns for the spec's own choices are
    ``SPEC_REASONS`` (any other is the GPU's: a skip); FlashMLA's backend asks its dense kernel, Hopper-only,
    which its own capability check (9.x and 10.x) does not cover."""
    import sys
    import types

    from vramgate.engine import EngineSpec
    from vramgate.engine.spec import SPEC_REASONS, _selector_config
    from vramgate.models.config import load_model

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(bfloat16="bf16", float16="f16", float32="f32"))
    root = Path(__file__).resolve().parents[1]
    config = _selector_config(EngineSpec(model="tiny-deepseek-v2", block_size=64),
                              load_model(root, "tiny-deepseek-v2"), 64)
    assert config is not None
    passed = set(config) | {"device_capability", "attn_type"}
    base = module(vllm_src, "v1/attention/backend.py")
    validate = method(cls(base, "AttentionBackend"), "validate_configuration")
    params = [a.arg for a in validate.args.args][1:]  # after cls
    required = params[:len(params) - len(validate.args.defaults)]
    assert set(required) <= passed <= set(params), sorted(passed ^ set(params))
    assert validate.returns is not None and ast.unparse(validate.returns) == "list[str]"
    reasons = {n.value for n in ast.walk(validate) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert SPEC_REASONS <= reasons, sorted(SPEC_REASONS - reasons)
    assert passed - {"device_capability"} <= fields(cls(module(vllm_src, "v1/attention/selector.py"),
                                                        "AttentionSelectorConfig"))
    assert any(isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "DECODER"
               for n in cls(base, "AttentionType").body)  # the attention type passed
    chosen = method(cls(module(vllm_src, "platforms/cuda.py"), "CudaPlatformBase"), "get_attn_backend_cls")
    assert "validate_configuration" in calls(chosen)
    flashmla = cls(module(vllm_src, "v1/attention/backends/mla/flashmla.py"), "FlashMLABackend")
    assert "is_flashmla_dense_supported" in calls(method(flashmla, "supports_combination"))
    ops = module(vllm_src, "v1/attention/ops/flashmla.py")
    assert _defines(ops, "is_flashmla_dense_supported")
    assert "Hopper" in ast.unparse(next(n for n in ops.body if isinstance(n, ast.FunctionDef)
                                        and n.name == "is_flashmla_dense_supported"))


# -- Tensor parallelism without a KV budget: the hooks in every rank (Note [hooks in every rank] in
# vramgate.engine.vllm_plugin), no CUDA in the engine's process before vLLM starts its ranks (Note [no CUDA before the
# ranks] in vramgate.engine.worker), the smallest rank's KV memory (Note [the smallest rank decides] in
# vramgate.engine.memory_decision) and the load's peak counted from vLLM's init snapshot (worker_load_peak).


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{name} is gone"
    return found[0]


def test_vllm_loads_the_general_plugins_in_the_engine_core_and_every_worker(vllm_src: Path) -> None:
    """The gate's entry point is in the group vLLM loads in every process: in the engine arguments (the engine's own
    process), the engine core and each worker's init, before the worker class is made."""
    import tomllib

    plugins = module(vllm_src, "plugins/__init__.py")
    group = next(n.value for n in plugins.body if isinstance(n, ast.Assign)
                 and ast.unparse(n.targets[0]) == "DEFAULT_PLUGINS_GROUP")
    assert isinstance(group, ast.Constant) and group.value == "vllm.general_plugins"
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["entry-points"][group.value] == {"vramgate": "vramgate.engine.vllm_plugin:register"}
    load = _function(plugins, "load_general_plugins")
    assert "load_plugins_by_group(group=DEFAULT_PLUGINS_GROUP)" in ast.unparse(load)
    assert "plugins_loaded" in ast.unparse(load)  # once per process: the hook's idempotence is not relied on
    init = method(cls(module(vllm_src, "v1/worker/worker_base.py"), "WorkerWrapperBase"), "init_worker")
    lines = {c: [n.lineno for n in ast.walk(init) if isinstance(n, ast.Call) and ast.unparse(n.func) == c]
             for c in ("load_general_plugins", "resolve_obj_by_qualname")}
    assert lines["load_general_plugins"] and min(lines["load_general_plugins"]) < min(lines["resolve_obj_by_qualname"])
    assert "load_general_plugins" in calls(method(cls(module(vllm_src, "v1/engine/core.py"), "EngineCore"),
                                                  "__init__"))
    assert "load_general_plugins" in calls(method(cls(module(vllm_src, "engine/arg_utils.py"), "EngineArgs"),
                                                  "__post_init__"))


def test_vllm_spawns_its_ranks_only_where_cuda_is_initialized(vllm_src: Path) -> None:
    """vLLM forks its workers unless CUDA is initialized in the parent (``torch.cuda.is_initialized``), and makes
    ``torch.cuda.is_available`` an NVML check on import."""
    force = _function(module(vllm_src, "utils/system_utils.py"), "_maybe_force_spawn")
    assert "cuda_is_initialized" in calls(force) and "VLLM_WORKER_MULTIPROC_METHOD" in ast.unparse(force)
    check = _function(module(vllm_src, "utils/platform_utils.py"), "cuda_is_initialized")
    assert "torch.cuda.is_initialized()" in ast.unparse(check)
    assert 'os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"' in (vllm_src / "env_override.py").read_text()


def test_the_engine_core_keeps_rank_0s_kv_memory_and_every_rank_gets_the_smallest(vllm_src: Path) -> None:
    """available_gpu_memory_for_kv_cache is one number, rank 0's of the executor's per-rank list; the KV cache
    configs cut every rank to the smallest block count; the GPU worker keeps its own figure."""
    core = method(cls(module(vllm_src, "v1/engine/core.py"), "EngineCore"), "_initialize_kv_caches")
    text = ast.unparse(core)
    assert "self.available_gpu_memory_for_kv_cache = available_gpu_memory[0]" in text
    assert "available_gpu_memory = self.model_executor.determine_available_memory()" in text
    assert "get_kv_cache_configs" in calls(core)
    executor = method(cls(module(vllm_src, "v1/executor/abstract.py"), "Executor"), "determine_available_memory")
    assert "collective_rpc('determine_available_memory')" in ast.unparse(executor)
    homes = [p for p in ("v1/core/kv_cache_utils.py", "v1/core/kv_cache_planning.py") if (vllm_src / p).is_file()
             and _defines(module(vllm_src, p), "get_kv_cache_configs")]
    assert homes, "get_kv_cache_configs is gone"
    configs = ast.unparse(_function(module(vllm_src, homes[0]), "get_kv_cache_configs"))
    assert "min_num_blocks = min(" in configs and "kv_cache_config.num_blocks" in configs
    worker = cls(module(vllm_src, "v1/worker/gpu_worker.py"), "Worker")
    assert "available_kv_cache_memory_bytes" in self_assigned(method(worker, "determine_available_memory"))


def test_the_init_snapshot_is_taken_after_nccl_and_measures_what_the_load_peak_reads(vllm_src: Path) -> None:
    """worker_load_peak takes a MemorySnapshot of the rank's device (``Worker.device``) and subtracts the worker's
    init snapshot, taken after the distributed environment (NCCL) is up, before the weights."""
    init = method(cls(module(vllm_src, "v1/worker/gpu_worker.py"), "Worker"), "init_device")
    assert {"device", "init_snapshot", "requested_memory"} <= self_assigned(init)
    line = {c: min(n.lineno for n in ast.walk(init) if isinstance(n, ast.Call) and ast.unparse(n.func) == c)
            for c in ("init_worker_distributed_environment", "MemorySnapshot")}
    assert line["init_worker_distributed_environment"] < line["MemorySnapshot"]
    assert "MemorySnapshot(device=self.device)" in ast.unparse(init)
    snapshot = cls(module(vllm_src, "utils/mem_utils.py"), "MemorySnapshot")
    assert {"cuda_memory", "torch_memory", "device"} <= fields(snapshot)
    measure = ast.unparse(method(snapshot, "measure"))
    assert "self.cuda_memory = self.total_memory - self.free_memory" in measure
    assert "self.torch_memory = torch.accelerator.memory_reserved(device)" in measure


# -- What vLLM does with the figures the gate reads (Note [automatic KV] in vramgate.engine.memory_decision, Notes
# [allocator peak] and [fusion pass state] in vramgate.engine.measure): behaviour, not only names.


def _top_def(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{name} is gone"
    return found[0]


def _reached(klass: ast.ClassDef, start: str) -> list[ast.FunctionDef]:
    """*start* and the methods of *klass* it calls through ``self``, transitively."""
    methods = {n.name: n for n in klass.body if isinstance(n, ast.FunctionDef)}
    todo, seen = [start], []
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.append(name)
            todo += [n.func.attr for n in ast.walk(methods[name]) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                     and n.func.value.id == "self" and n.func.attr in methods]
    return [methods[name] for name in seen]


def _calls_of(node: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute | ast.Name)
            and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) == name]


def _files_calling(src: Path, name: str) -> set[str]:
    """The files under *src* that call *name* (``x.name(...)`` or ``name(...)``)."""
    out = set()
    for path in src.rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if f"{name}(" in text and _calls_of(ast.parse(text), name):
            out.add(path.relative_to(src).as_posix())
    return out


def _use_v2_model_runner(src: Path, **inputs: object) -> bool:
    """vLLM's ``VllmConfig.use_v2_model_runner`` run on stand-ins: the property and the methods of ``VllmConfig``
    it calls, compiled from the source, with *inputs* overriding the gate's engines' values (Note [automatic KV]):
    no ``VLLM_USE_V2_MODEL_RUNNER``, Triton present (vLLM's CUDA wheels depend on it), the CUDA platform, a Llama
    decoder at tensor parallel 1, 2 or 4 with the mp executor, compiled or eager, no speculative decoding, LoRA,
    dual batch overlap, sequence parallelism or HiSparse. A name or attribute the stand-ins lack fails the test
    naming it: a release that decides on something new."""
    import __future__

    import builtins
    import copy
    from types import SimpleNamespace
    from typing import Any

    klass = cls(module(src, "config/vllm.py"), "VllmConfig")
    members: dict[str, Any] = {}
    defs = [copy.deepcopy(fn) for fn in _reached(klass, "use_v2_model_runner")]
    wrappers = {fn.name: [ast.unparse(d) for d in fn.decorator_list] for fn in defs}
    for fn in defs:
        fn.decorator_list = []
    code = compile(ast.Module(body=list(defs), type_ignores=[]), str(src / "config/vllm.py"), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    v: dict[str, Any] = dict(inputs)
    platform = SimpleNamespace(is_rocm=lambda: False, is_cuda=lambda: True, is_cuda_alike=lambda: True,
                               is_unspecified=lambda: False, is_xpu=lambda: False, is_cpu=lambda: False)

    def imports(name: str, *args: object, **kwargs: object) -> object:
        if name == "vllm.platforms":
            return SimpleNamespace(current_platform=platform)
        raise ImportError(f"use_v2_model_runner imports {name}: say what the gate's engines get from it")

    def quiet(*args: object, **kwargs: object) -> None:
        return None

    namespace: dict[str, Any] = {
        "__builtins__": {**vars(builtins), "__import__": imports},
        "envs": SimpleNamespace(VLLM_USE_V2_MODEL_RUNNER=v.pop("VLLM_USE_V2_MODEL_RUNNER", None)),
        "HAS_TRITON": v.pop("HAS_TRITON", True), "current_platform": platform,
        "logger": SimpleNamespace(warning_once=quiet, info_once=quiet, warning=quiet, info=quiet, debug=quiet),
        "CompilationMode": SimpleNamespace(NONE="NONE", STOCK_TORCH_COMPILE="STOCK_TORCH_COMPILE",
                                           DYNAMO_TRACE_ONCE="DYNAMO_TRACE_ONCE", VLLM_COMPILE="VLLM_COMPILE"),
    }
    exec(code, namespace)
    for fn in defs:
        found = namespace[fn.name]
        members[fn.name] = property(found) if {"property", "cached_property", "functools.cached_property"} & \
            set(wrappers[fn.name]) else found
    tp, eager = int(v.pop("tensor_parallel_size", 1)), bool(v.pop("enforce_eager", False))
    assert not v, f"unknown inputs {v}"
    config = type("VllmConfig", (), members)()
    config.attention_config = SimpleNamespace(hisparse_config=None)
    config.speculative_config = config.lora_config = None
    config.parallel_config = SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1,
        distributed_executor_backend="mp" if tp > 1 else "uni", use_ubatching=False, enable_dbo=False,
        enable_elastic_ep=False, prefill_context_parallel_size=1, decode_context_parallel_size=1,
        enable_batch_sharded_sampling=False)
    config.compilation_config = SimpleNamespace(
        mode="NONE" if eager else "VLLM_COMPILE",
        pass_config=SimpleNamespace(enable_sp=False, fuse_gemm_comms=False, fuse_allreduce_rms=tp > 1))
    config.cache_config = SimpleNamespace(mamba_cache_mode="none")
    config.model_config = SimpleNamespace(architectures=["LlamaForCausalLM"], is_diffusion=False,
                                          enforce_eager=eager)
    config.scheduler_config = SimpleNamespace(async_scheduling=True)
    try:
        return bool(config.use_v2_model_runner)
    except (AttributeError, NameError) as exc:
        raise AssertionError(f"vLLM {src.parent.name}: use_v2_model_runner reads something new ({exc}): say "
                             f"what the gate's engines have for it in _use_v2_model_runner") from None


@pytest.mark.parametrize(("tp", "eager"), [(1, False), (1, True), (2, False), (4, False)])
def test_cuda_builds_the_v2_model_runner_for_the_gates_engines(vllm_src: Path, tp: int, eager: bool) -> None:
    """``VllmConfig.use_v2_model_runner`` is True for the gate's engines with ``VLLM_USE_V2_MODEL_RUNNER``
    unset and Triton present; the variable, when set, and Triton's absence decide it instead."""
    assert _use_v2_model_runner(vllm_src, tensor_parallel_size=tp, enforce_eager=eager)
    assert not _use_v2_model_runner(vllm_src, tensor_parallel_size=tp, VLLM_USE_V2_MODEL_RUNNER=False)
    assert _use_v2_model_runner(vllm_src, tensor_parallel_size=tp, VLLM_USE_V2_MODEL_RUNNER=True)
    assert not _use_v2_model_runner(vllm_src, tensor_parallel_size=tp, HAS_TRITON=False)


def test_the_cuda_worker_builds_the_runner_use_v2_model_runner_names(vllm_src: Path) -> None:
    """On CUDA the worker is ``gpu_worker.Worker``; it keeps ``vllm_config.use_v2_model_runner`` and, when it is
    set, makes its ``model_runner`` a ``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` (otherwise V1's): both
    are modules install_hooks hooks (``RUNNER_MODULES``)."""
    from vramgate.engine.memory_decision import RUNNER_MODULES

    platform = cls(module(vllm_src, "platforms/cuda.py"), "CudaPlatformBase")
    assert "vllm.v1.worker.gpu_worker.Worker" in {n.value for n in ast.walk(platform) if isinstance(n, ast.Constant)}
    worker = cls(module(vllm_src, "v1/worker/gpu_worker.py"), "Worker")
    assert "self.use_v2_model_runner = vllm_config.use_v2_model_runner" in ast.unparse(method(worker, "__init__"))
    built: dict[str, str] = {}  # module -> the name it is imported as
    for fn in (m for m in worker.body if isinstance(m, ast.FunctionDef)):
        for n in ast.walk(fn):
            if isinstance(n, ast.ImportFrom) and n.module:
                built.update((n.module, a.asname or a.name) for a in n.names if a.name == "GPUModelRunner")
    assert set(built) == {"vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"}, built
    assert set(built) <= set(RUNNER_MODULES)
    v2 = built["vllm.v1.worker.gpu.model_runner"]
    branches = [n for n in ast.walk(worker) if isinstance(n, ast.If)
                and ast.unparse(n.test) == "self.use_v2_model_runner"
                and any(isinstance(i, ast.ImportFrom) and i.module == "vllm.v1.worker.gpu.model_runner"
                        for i in ast.walk(n))]
    assert len(branches) == 1, "the V2 runner is built under one `if self.use_v2_model_runner:`"
    made = [s for s in branches[0].body if isinstance(s, ast.Assign | ast.AnnAssign | ast.Return)
            and isinstance(s.value, ast.Call) and ast.unparse(s.value.func) == v2]
    assert made, f"the branch does not build {v2}"
    if isinstance(made[0], ast.Return):  # built in a method of its own: what self.model_runner is set from
        maker = next(m.name for m in worker.body if isinstance(m, ast.FunctionDef) and branches[0] in ast.walk(m))
        assert f"self.model_runner: GPUModelRunner = self.{maker}()" in ast.unparse(worker) or \
            f"self.model_runner = self.{maker}()" in ast.unparse(worker)
    else:
        assert ast.unparse(made[0]).startswith("self.model_runner")


def test_the_hooked_capture_is_the_one_warm_up_runs_and_the_estimate_runs_it_profile_only(vllm_src: Path) -> None:
    """The pool is what ``compile_or_warm_up_model`` (0.33.0: the ``_compile_or_warm_up_model`` it calls) gets
    from ``self.model_runner.capture_model()``; V2's ``profile_cudagraph_memory``, which
    ``determine_available_memory`` runs before the KV cache exists, calls the same method with
    ``profile_only=True`` (a throwaway pool, the estimate); nothing else in vLLM calls it, and V1's
    ``capture_model`` takes no argument (its estimate captures by other means)."""
    worker = cls(module(vllm_src, "v1/worker/gpu_worker.py"), "Worker")
    warm_up = _reached(worker, "compile_or_warm_up_model")
    captures = [c for fn in warm_up for c in _calls_of(fn, "capture_model")]
    assert [ast.unparse(c) for c in captures] == ["self.model_runner.capture_model()"]
    assert "self.model_runner.profile_cudagraph_memory()" in ast.unparse(method(worker, "determine_available_memory"))
    v2_tree = module(vllm_src, "v1/worker/gpu/model_runner.py")
    v2 = cls(v2_tree, "GPUModelRunner")
    capture = method(v2, "capture_model")
    assert [a.arg for a in capture.args.kwonlyargs] == ["profile_only"] and not capture.args.args[1:]
    assert [None if d is None else ast.unparse(d) for d in capture.args.kw_defaults] == ["False"]
    assert capture.returns is not None and ast.unparse(capture.returns) == "int"
    aliases = {a.asname or a.name for n in v2_tree.body if isinstance(n, ast.ImportFrom)
               and n.module == "vllm.v1.worker.gpu.cudagraph_utils" for a in n.names
               if a.name == "profile_cudagraph_memory"}
    assert aliases & calls(method(v2, "profile_cudagraph_memory")), "V2's estimate is cudagraph_utils'"
    estimate = _top_def(module(vllm_src, "v1/worker/gpu/cudagraph_utils.py"), "profile_cudagraph_memory")
    assert [ast.unparse(c) for c in _calls_of(estimate, "capture_model")] == ["runner.capture_model(profile_only=True)"]
    v1 = cls(module(vllm_src, "v1/worker/gpu_model_runner.py"), "GPUModelRunner")
    v1_capture = method(v1, "capture_model")
    assert [a.arg for a in v1_capture.args.args] == ["self"] and not v1_capture.args.kwonlyargs
    assert not _calls_of(method(v1, "profile_cudagraph_memory"), "capture_model")
    assert _files_calling(vllm_src, "capture_model") == {"v1/worker/gpu_worker.py", "v1/worker/gpu/cudagraph_utils.py"}


def test_the_worker_freezes_its_heap_after_warm_up(vllm_src: Path) -> None:
    """Note [fusion pass state]: the warm-up ends with ``freeze_gc_heap()`` (after the graph capture, not under a
    condition), which collects and then ``gc.freeze()``s: the compile passes are frozen when the gate reads them."""
    tree = module(vllm_src, "v1/worker/gpu_worker.py")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "vllm.utils.gc_utils"
               and "freeze_gc_heap" in {a.name for a in n.names} for n in tree.body)
    warm_up = [fn for fn in _reached(cls(tree, "Worker"), "compile_or_warm_up_model")
               if _calls_of(fn, "capture_model")]
    assert len(warm_up) == 1
    body = warm_up[0].body
    freezes = [i for i, s in enumerate(body) if isinstance(s, ast.Expr) and ast.unparse(s) == "freeze_gc_heap()"]
    capture = max(i for i, s in enumerate(body) if _calls_of(s, "capture_model"))
    assert freezes and freezes[-1] > capture, "freeze_gc_heap() is no longer run after the capture, unconditionally"
    assert not any(_calls_of(s, "unfreeze") for s in body[freezes[-1]:])
    freeze = _top_def(module(vllm_src, "utils/gc_utils.py"), "freeze_gc_heap")
    assert [ast.unparse(c) for c in _calls_of(freeze, "freeze")] == ["gc.freeze()"]
    assert not _calls_of(freeze, "unfreeze")


def test_the_allocator_peak_is_reset_as_the_model_loads_and_as_profiling_starts(vllm_src: Path) -> None:
    """Note [allocator peak]: on CUDA ``get_current_memory_usage`` empties the cache and resets the peak; the
    ``DeviceMemoryProfiler`` both runners' ``load_model`` wrap the load in reads it on entering and on leaving;
    ``memory_profiling`` resets it before the profile run, which a KV budget skips. Nothing else in vLLM resets
    it (the ROCm and XPU platforms and a FlashAttention benchmark aside)."""
    platforms = module(vllm_src, "platforms/cuda.py")
    usage = method(cls(platforms, "CudaPlatformBase"), "get_current_memory_usage")
    assert [ast.unparse(c) for c in ast.walk(usage) if isinstance(c, ast.Call)] == \
        ["torch.cuda.empty_cache()", "torch.cuda.reset_peak_memory_stats(device)",
         "torch.cuda.max_memory_allocated(device)"]
    for sub in ("NvmlCudaPlatform", "NonNvmlCudaPlatform"):
        assert "get_current_memory_usage" not in {n.name for n in cls(platforms, sub).body
                                                  if isinstance(n, ast.FunctionDef)}, sub
    mem = module(vllm_src, "utils/mem_utils.py")
    profiler = cls(mem, "DeviceMemoryProfiler")
    assert "current_platform.get_current_memory_usage" in ast.unparse(method(profiler, "current_memory_usage"))
    for name in ("__enter__", "__exit__"):
        assert "current_memory_usage" in calls(method(profiler, name)), name
    for path in ("v1/worker/gpu_model_runner.py", "v1/worker/gpu/model_runner.py"):
        load = method(cls(module(vllm_src, path), "GPUModelRunner"), "load_model")
        withs = [n for n in ast.walk(load) if isinstance(n, ast.With)
                 and any(ast.unparse(i.context_expr) == "DeviceMemoryProfiler()" for i in n.items)]
        assert withs and "model_loader.load_model" in ast.unparse(withs[0]), f"{path}: the load is not profiled"
    profiling = _top_def(mem, "memory_profiling")
    steps = [s for s in profiling.body if not isinstance(s, ast.Expr) or not isinstance(s.value, ast.Constant)]
    reset = next(i for i, s in enumerate(steps) if _calls_of(s, "reset_peak_memory_stats"))
    assert reset < next(i for i, s in enumerate(steps) if any(isinstance(n, ast.Yield) for n in ast.walk(s)))
    decide = method(cls(module(vllm_src, "v1/worker/gpu_worker.py"), "Worker"), "determine_available_memory")
    budget = next(n for n in decide.body if isinstance(n, ast.If) and "kv_cache_memory_bytes" in ast.unparse(n.test))
    assert isinstance(budget.body[-1], ast.Return) and not _calls_of(budget, "memory_profiling")
    assert _files_calling(vllm_src, "reset_peak_memory_stats") <= {
        "platforms/cuda.py", "platforms/rocm.py", "platforms/xpu.py", "utils/mem_utils.py",
        "vllm_flash_attn/cute/benchmark.py"}
    from vramgate.engine.measure import worker_allocator

    assert "DeviceMemoryProfiler" in (worker_allocator.__doc__ or ""), "Note [allocator peak] names the resets"
    assert _files_calling(vllm_src, "get_current_memory_usage") == {"utils/mem_utils.py"}
    assert _files_calling(vllm_src, "DeviceMemoryProfiler") == {"v1/worker/gpu_model_runner.py",
                                                               "v1/worker/gpu/model_runner.py"}


def test_the_non_kv_memory_is_what_the_profile_consumed_plus_its_transient_peak(vllm_src: Path) -> None:
    """Note [automatic KV]: ``non_kv_cache_memory = total_consumed + transient_peak_headroom`` (the device's free
    memory lost since the worker's first snapshot, plus the profile run's torch peak above what it still holds),
    the ROCm fallback's too; the KV cache gets the requested memory minus it minus the graph estimate, which is
    applied only where the flag is on (an eager engine's estimate is 0). PROFILE_FIELDS keeps its terms."""
    mem = _top_def(module(vllm_src, "utils/mem_utils.py"), "memory_profiling")
    assigned = {ast.unparse(n.targets[0]): ast.unparse(n.value) for n in ast.walk(mem) if isinstance(n, ast.Assign)}
    assert assigned["result.non_kv_cache_memory"] == "result.total_consumed + result.transient_peak_headroom"
    assert assigned["result.total_consumed"] == "result.before_create.free_memory - result.after_profile.free_memory"
    assert assigned["result.transient_peak_headroom"] == \
        "result.after_profile.torch_peak - result.after_profile.torch_allocated"
    assert {"total_consumed", "transient_peak_headroom"} <= set(PROFILE_FIELDS)
    from vramgate.engine import memory_decision

    assert "non_kv_cache_memory = total_consumed + transient_peak_headroom" in (memory_decision.__doc__ or "")
    decide = method(cls(module(vllm_src, "v1/worker/gpu_worker.py"), "Worker"), "determine_available_memory")
    sets = [ast.unparse(n.value) for n in ast.walk(decide) if isinstance(n, ast.Assign)
            and ast.unparse(n.targets[0]) == "profile_result.non_kv_cache_memory"]
    assert sets == ["profile_result.total_consumed + profile_result.transient_peak_headroom"]  # ROCm's fallback
    values = {ast.unparse(n.targets[0]): ast.unparse(n.value) for n in ast.walk(decide) if isinstance(n, ast.Assign)}
    assert values["cudagraph_memory_estimate_applied"] == \
        "cudagraph_memory_estimate if envs.VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS else 0"
    assert values["self.available_kv_cache_memory_bytes"] == \
        "self.requested_memory - profile_result.non_kv_cache_memory - cudagraph_memory_estimate_applied"
    assert values["self.cudagraph_memory_estimate"] == "cudagraph_memory_estimate"
