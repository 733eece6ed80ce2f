#!/usr/bin/env bash
# The prepared device check: every GPU suite that needs no vLLM, on a bare torch box (pytest, torch,
# numpy, nvidia-ml-py), run from the source tree. Writes the report, the hardware fingerprint and the
# baselines of this GPU's hardware key into OUT_DIR. Missing baselines are recorded (so the first run
# on a new GPU records them for review); existing ones are compared. Pass --update to re-record all.
#
#   scripts/gpu-check.sh OUT_DIR [--update] [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu-check.sh OUT_DIR [--update] [pytest args]}"
shift
mode=(--gate-missing=record)
if [[ "${1:-}" == "--update" ]]; then
    mode=(--gate-update)
    shift
fi
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
py="${PYTHON:-python3}"
"$py" -m vramgate hardware | tee "$out/hardware.txt"
read -r key tier < <("$py" -c 'from vramgate.machine.hardware import detect; fp = detect(); print(fp.key, fp.tier)')
suites=(suites/attention suites/stream_priority suites/cuda_graphs suites/moe)
start=$(date +%s)
timeout --signal=INT --kill-after=20 480 \
    "$py" -m pytest "${suites[@]}" -p no:cacheprovider -rA "${mode[@]}" --gate-report "$out/report" "$@" \
    2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
echo "pytest exit $rc after $(( $(date +%s) - start )) s"
# Machine-bound baselines under the hardware key, portable ones (if any) under the tier's key.
for folder in "$key" "$tier"; do
    if [[ -d "baselines/$folder" ]]; then
        mkdir -p "$out/baselines"
        cp -r "baselines/$folder" "$out/baselines/"
    fi
done
exit "$rc"
