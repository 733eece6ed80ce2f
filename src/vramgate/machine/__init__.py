"""The machine: hardware fingerprint and keys, CPU instruction sets, visible GPUs, software versions,
GPU processes, and the memory and time probes (:mod:`vramgate.machine.probes`)."""
