#!/usr/bin/env bash
# The GPU workflow's tools, in a fresh virtual environment at $1: tox, nvidia-ml-py (the hardware check and
# the cleanup read NVML) and the gate itself. Fails with a message, never silently, on a Python older than
# the project needs or an environment that cannot be made.
set -euo pipefail
venv=${1:?usage: scripts/ci-tools.sh VENV_DIR}
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "ci-tools: $("$python" --version 2>&1) is too old: vramgate needs Python >= 3.11 (set PYTHON to one)" >&2
    exit 1
fi
if ! "$python" -m venv "$venv"; then
    echo "ci-tools: '$python -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 1
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet 'tox>=4.11' 'nvidia-ml-py>=12' "$(cd "$(dirname "$0")/.." && pwd)"
"$venv/bin/python" -m vramgate --help > /dev/null
echo "ci-tools: $("$venv/bin/python" --version) in $venv with tox $("$venv/bin/python" -m tox --version | cut -d' ' -f1)"
