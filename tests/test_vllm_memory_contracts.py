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
    CPUModelRunner.warming_up_model, which determine_available_memory runs before it reads the RSS."""
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
