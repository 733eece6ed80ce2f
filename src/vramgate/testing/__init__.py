"""What the suites build on: typed fixtures (a pytest plugin, :mod:`vramgate.testing.fixtures`) and helpers.

The project's root ``conftest.py`` loads the plugin. Suites import this
layer's public names from here (``from vramgate.testing import Engine``), not
from its modules, which may split or move.
"""

# -- figures (for the suites: import them from here) --
from vramgate.core.metrics import median

# -- engines and their results (for the suites: import them from here) --
from vramgate.engine import (
    KV_TOO_SMALL,
    EngineError,
    EngineResult,
    EngineSpec,
    PairedEngines,
    SpecError,
    backend_problem,
    confirmed_rounds,
    cpu_backend_problem,
    engine_tier,
    fusion_problem,
    kv_need,
    latency_spec,
    paired_defaults,
    run_engine,
    validate,
)
from vramgate.engine.leak import WarmUp, device_memory_slope, memory_slope, paired_slope
from vramgate.engine.load import LoadRun
from vramgate.engine.paired_load import paired_settings
from vramgate.machine import isa
from vramgate.machine.gpu_processes import alive
from vramgate.machine.hardware import computed_tier

# -- probes of this machine: memory, devices, timers (for the suites: import them from here) --
from vramgate.machine.probes.cpu import PeakRSS, children, pin_mmap_threshold, rss_bytes
from vramgate.machine.probes.cuda import CudaRegion
from vramgate.machine.probes.gpu_state import device_peak_bandwidth
from vramgate.machine.probes.nvml import NVMLUnavailable, read_device
from vramgate.machine.probes.timers import time_cuda
from vramgate.machine.software import software_versions
from vramgate.matrix import ServingLoad
from vramgate.models.attention import TORCH_FLASH_EXTRA, AttentionShape, explain_splits, torch_flash_transient_bytes
from vramgate.models.checkpoints import dequantize, reference_weights

# -- models: shapes, KV accounting, attention, MoE, quantized formats (for the suites: import them from here) --
from vramgate.models.config import ModelShape, read_config
from vramgate.models.cpu_resident import vllm_cpu_resident
from vramgate.models.moe import (
    MoEShape,
    expert_load,
    make_weights,
    naive_moe,
    reference_moe,
    reference_overhead_bound,
    route,
    workspace_bytes,
)
from vramgate.models.quant import SCHEMES, checkpoint_tensors, format_bytes, kv_gain_tokens, layout, weight_size
from vramgate.models.vllm_kv import vllm_kv_layout

# -- optimization profiles (for the suites: import them from here) --
from vramgate.profiles import PatchError, Profile, build_overlay, check, installed_target, load_profile
from vramgate.pytest_plugin.plugin import gate_session
from vramgate.runtime.engine_env import EngineEnv

# -- the simulator, workloads and the matrix (for the suites: import them from here) --
from vramgate.sim import SimResult, simulate
from vramgate.testing.answers import RecallModelCheck, check_answers, check_recall_model, check_task_accuracy
from vramgate.testing.claims import check_claims
from vramgate.testing.engines import (
    PRESSURE_SPEC,
    SMALL_RUN_BLOCK_SIZE,
    SMALL_RUN_BLOCK_SIZE_AMX,
    SMALL_RUN_BUDGET_GIB,
    UNPAIRED_LATENCY_TOLERANCE,
    Engine,
    record_paired_step,
    small_run_block_size,
    small_run_spec,
    unpaired_latency_tolerance,
)
from vramgate.testing.matrix import MatrixCase, matrix_params
from vramgate.testing.matrix_suites import matrix_suite
from vramgate.testing.models import ModelLoader
from vramgate.testing.profiles import runnable_candidate, skip_unmet, version_problem
from vramgate.testing.quantization import Checkpoints, QuantRuns, checkpoint_of, linear_kernel_problem
from vramgate.testing.serving import (
    UNSETTLED_SERVERS,
    Servers,
    memory_slope_problem,
    paired_burst,
    rate_load,
    sustained_loads,
    workload_trace,
)
from vramgate.testing.simulator import Simulator
from vramgate.testing.tp import TPRunner

# -- tensor parallelism without vLLM (for the suites: import them from here) --
from vramgate.tp import (
    DTYPE_BYTES,
    Launcher,
    MLPShape,
    RankResult,
    TPError,
    TPSpec,
    launcher,
    overlap_fraction,
    peak_change,
)
from vramgate.workloads import RequestSpec, Workload, build

__all__ = [
    "DTYPE_BYTES",
    "KV_TOO_SMALL",
    "PRESSURE_SPEC",
    "SCHEMES",
    "SMALL_RUN_BLOCK_SIZE",
    "SMALL_RUN_BLOCK_SIZE_AMX",
    "SMALL_RUN_BUDGET_GIB",
    "TORCH_FLASH_EXTRA",
    "UNPAIRED_LATENCY_TOLERANCE",
    "UNSETTLED_SERVERS",
    "AttentionShape",
    "Checkpoints",
    "CudaRegion",
    "Engine",
    "EngineEnv",
    "EngineError",
    "EngineResult",
    "EngineSpec",
    "Launcher",
    "LoadRun",
    "MLPShape",
    "MatrixCase",
    "MoEShape",
    "ModelLoader",
    "ModelShape",
    "NVMLUnavailable",
    "PairedEngines",
    "PatchError",
    "PeakRSS",
    "Profile",
    "QuantRuns",
    "RankResult",
    "RecallModelCheck",
    "RequestSpec",
    "Servers",
    "ServingLoad",
    "SimResult",
    "Simulator",
    "SpecError",
    "TPError",
    "TPRunner",
    "TPSpec",
    "WarmUp",
    "Workload",
    "alive",
    "backend_problem",
    "build",
    "build_overlay",
    "check",
    "check_answers",
    "check_claims",
    "check_recall_model",
    "check_task_accuracy",
    "checkpoint_of",
    "checkpoint_tensors",
    "children",
    "computed_tier",
    "confirmed_rounds",
    "cpu_backend_problem",
    "dequantize",
    "device_memory_slope",
    "device_peak_bandwidth",
    "engine_tier",
    "expert_load",
    "explain_splits",
    "format_bytes",
    "fusion_problem",
    "gate_session",
    "installed_target",
    "isa",
    "kv_gain_tokens",
    "kv_need",
    "latency_spec",
    "launcher",
    "layout",
    "linear_kernel_problem",
    "load_profile",
    "make_weights",
    "matrix_params",
    "matrix_suite",
    "median",
    "memory_slope",
    "memory_slope_problem",
    "naive_moe",
    "overlap_fraction",
    "paired_burst",
    "paired_defaults",
    "paired_settings",
    "paired_slope",
    "peak_change",
    "pin_mmap_threshold",
    "rate_load",
    "read_config",
    "read_device",
    "record_paired_step",
    "reference_moe",
    "reference_overhead_bound",
    "reference_weights",
    "route",
    "rss_bytes",
    "run_engine",
    "runnable_candidate",
    "simulate",
    "skip_unmet",
    "small_run_block_size",
    "small_run_spec",
    "software_versions",
    "sustained_loads",
    "time_cuda",
    "torch_flash_transient_bytes",
    "unpaired_latency_tolerance",
    "validate",
    "version_problem",
    "vllm_cpu_resident",
    "vllm_kv_layout",
    "weight_size",
    "workload_trace",
    "workspace_bytes",
]
