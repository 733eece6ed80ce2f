"""What the suites read of this machine: memory, devices, timers, software, and the median of figures (the
probes and helpers of the layers below, for the suites: import them from here)."""

from __future__ import annotations

from vramgate.core.metrics import median
from vramgate.machine import isa
from vramgate.machine.gpu_processes import alive
from vramgate.machine.hardware import computed_tier
from vramgate.machine.probes.cpu import PeakRSS, children, pin_mmap_threshold, rss_bytes
from vramgate.machine.probes.cuda import CudaRegion
from vramgate.machine.probes.gpu_state import device_peak_bandwidth
from vramgate.machine.probes.nvml import NVMLUnavailable, read_device
from vramgate.machine.probes.timers import time_cuda
from vramgate.machine.software import software_versions

__all__ = [
    "CudaRegion",
    "NVMLUnavailable",
    "PeakRSS",
    "alive",
    "children",
    "computed_tier",
    "device_peak_bandwidth",
    "isa",
    "median",
    "pin_mmap_threshold",
    "read_device",
    "rss_bytes",
    "software_versions",
    "time_cuda",
]
