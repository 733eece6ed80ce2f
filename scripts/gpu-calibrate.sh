#!/usr/bin/env bash
# The gate's precision on a GPU box, without vLLM: the kernel-level campaign of
# `python -m vramgate.tools.calibration.kernel_latency` (flash decode, planted +5% / +10% delays, fresh processes),
# writing calibration.json and calibration.md into OUT_DIR. Needs pytest, torch and numpy only.
#
#   scripts/gpu-calibrate.sh OUT_DIR [kernel_latency args]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu-calibrate.sh OUT_DIR [kernel_latency args]}"
shift
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
py="${PYTHON:-python3}"
start=$(date +%s)
timeout --signal=INT --kill-after=20 300 "$py" -m vramgate.tools.calibration.kernel_latency "$out" --device cuda "$@"
rc=$?
echo "kernel_latency exit $rc after $(( $(date +%s) - start )) s"
exit "$rc"
