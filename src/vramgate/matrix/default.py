"""The built-in default matrix: the one a project without a ``vramgate.toml`` gets.

It declares the suites' own fixtures (the models, block sizes and KV dtypes of
the kv_cache, capacity and latency suites); the repository ships the same
entries in its ``vramgate.toml``, which a team edits to add what it serves.
"""

from __future__ import annotations

from vramgate.matrix.loader import Matrix, parse_matrix

#: The default matrix's TOML text.
DEFAULT_TOML = """\
# The gate's matrix: which suites run which model, how, on which machines, under which budgets.
# Format: docs/matrix.md. Check it with `vramgate matrix --check`; see what runs here with `vramgate matrix`.
# Without this file the built-in default applies (the same entries as these).

[models.deepseek-v2-lite]
[models.deepseek-v2]
[models.deepseek-v3]
[models."llama-3.1-8b"]
[models.tiny-llama]
[models.tiny-deepseek-v2]

# KV pages and capacity by vLLM's own accounting (no engine run): every tier.
[[entries]]
suites = ["kv_cache"]
model = "deepseek-v2-lite"
block_size = [16, 64, 128]
kv_cache_dtype = ["auto", "fp8"]

[[entries]]
suites = ["kv_cache"]
model = "deepseek-v2"
block_size = [16, 64, 128]
kv_cache_dtype = ["auto", "fp8"]

[[entries]]
suites = ["kv_cache"]
model = "deepseek-v3"
block_size = [16, 64, 128]
kv_cache_dtype = ["auto", "fp8"]

[[entries]]
suites = ["kv_cache"]
model = "llama-3.1-8b"
block_size = [16, 64, 128]
kv_cache_dtype = ["auto", "fp8"]

# The shared small engine runs (capacity and latency run the same spec, so each engine runs once a session):
# vLLM's CPU attention needs a block size that is a multiple of 32; its MLA runs 16 only on CPUs without AMX
# (CPU_MLA) and multiples of 32 on CPUs with AMX (AMX_MLA).
[[entries]]
suites = ["capacity", "latency"]
model = "tiny-llama"
tier = "cpu"
block_size = 32

[[entries]]
suites = ["capacity"]
model = "tiny-llama"
tier = "cpu"
block_size = [64, 128]
nightly = "more block sizes of the same accounting: no profile changes them"

[[entries]]
suites = ["capacity", "latency"]
model = "tiny-deepseek-v2"
tier = "cpu"
cpu_isa = "not amx"
block_size = 16

[[entries]]
suites = ["capacity", "latency"]
model = "tiny-deepseek-v2"
tier = "cpu"
cpu_isa = "amx"
block_size = 32

[[entries]]
suites = ["capacity", "latency"]
model = "tiny-llama"
tier = "gpu"
block_size = 16

[[entries]]
suites = ["capacity"]
model = "tiny-llama"
tier = "gpu"
block_size = [32, 128]
nightly = "more block sizes of the same accounting: no profile changes them"

[[entries]]
suites = ["capacity", "latency"]
model = "tiny-deepseek-v2"
tier = "gpu"
block_size = 16

[[entries]]
suites = ["capacity"]
model = "tiny-deepseek-v2"
tier = "gpu"
block_size = 64
nightly = "more block sizes of the same accounting: no profile changes them"

# The KV cache a serving team gets: no KV budget, vLLM sizes it itself at the team's memory after its warm-up
# (CPU: the requested memory minus the worker's RSS after the compiled model's warm-up) or its memory profiling
# and CUDA-graph capture (GPU: gpu_memory_utilization of the device). docs/serving.md.
[[entries]]
suites = ["serving_capacity"]
model = "tiny-llama"
tier = "cpu"
block_size = 32
nightly = "its fresh engine's compiled warm-up takes both cores: the other worker's timings ran 2.6-6x slower"
[entries.serving]
cpu_memory = "2 GiB"
max_model_len = 2048
max_num_seqs = 32
[entries.budgets]
capacity_tokens = ">= 1000000"
max_concurrency = ">= 500"

[[entries]]
suites = ["serving_capacity"]
model = "tiny-deepseek-v2"
tier = "cpu"
cpu_isa = "not amx"
block_size = 16
nightly = "the MLA model's serving capacity: the same warm-up and sizing path as tiny-llama's"
[entries.serving]
cpu_memory = "2 GiB"
max_model_len = 2048
max_num_seqs = 32

[[entries]]
suites = ["serving_capacity"]
model = "tiny-deepseek-v2"
tier = "cpu"
cpu_isa = "amx"
block_size = 32
nightly = "the MLA model's serving capacity: the same warm-up and sizing path as tiny-llama's"
[entries.serving]
cpu_memory = "2 GiB"
max_model_len = 2048
max_num_seqs = 32

[[entries]]
suites = ["serving_capacity"]
model = "tiny-llama"
tier = "gpu"
block_size = 16
[entries.serving]
gpu_memory_utilization = 0.90
max_model_len = 2048
max_num_seqs = 32

[[entries]]
suites = ["serving_capacity"]
model = "tiny-deepseek-v2"
tier = "gpu"
block_size = 16
[entries.serving]
gpu_memory_utilization = 0.90
max_model_len = 2048
max_num_seqs = 32

# Online serving: vLLM's OpenAI-compatible server under the team's load, measured by vLLM's own benchmark client
# (vllm bench serve). The pre-merge case: one request rate and the memory slope of a sustained load; the second
# rate in the full gate. docs/online-serving.md.
[[entries]]
suites = ["serving"]
model = "tiny-llama"
tier = "cpu"
block_size = 32
[entries.serving]
cpu_memory = "2 GiB"
enforce_eager = true
max_model_len = 1024
max_num_seqs = 32
[entries.load]
request_rates = [4]
num_prompts = 40
input_len = 64
output_len = 32
slo = { ttft = "1 s", tpot = "100 ms" }
[entries.budgets]
memory_slope = "<= 24 MiB per 1000 requests"

[[entries]]
suites = ["serving"]
model = "tiny-llama"
tier = "cpu"
block_size = 32
nightly = "the second request rate: the same server, near its capacity on 2 cores (about 15 req/s)"
[entries.serving]
cpu_memory = "2 GiB"
enforce_eager = true
max_model_len = 1024
max_num_seqs = 32
[entries.load]
request_rates = [10]
num_prompts = 40
input_len = 64
output_len = 32
slo = { ttft = "1 s", tpot = "100 ms" }

[[entries]]
suites = ["serving"]
model = "tiny-llama"
tier = "gpu"
block_size = 16
[entries.serving]
gpu_memory_utilization = 0.90
max_model_len = 2048
max_num_seqs = 64
[entries.load]
request_rates = [4, 16, "inf"]
num_prompts = 200
input_len = 256
output_len = 128
slo = { ttft = "250 ms", tpot = "50 ms" }
sustained_requests = 2000
sustained_concurrency = 32
"""

#: Where errors in the built-in default say it came from.
DEFAULT_SOURCE = "<built-in default matrix>"


def default_matrix() -> Matrix:
    """The built-in default matrix (model configs not checked against a project: they are the repository's)."""
    return parse_matrix(DEFAULT_TOML, DEFAULT_SOURCE)
