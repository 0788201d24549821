#!/usr/bin/env bash
# Set up (if needed) and run labkit's main job on the embedded default model.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m labkit "$@"
