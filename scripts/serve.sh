#!/usr/bin/env bash
# Set up (if needed) and run labkit's main job: the OpenAI-compatible server on the embedded model
# (127.0.0.1:30000; extra arguments go to `python -m labkit.server`, see --help).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m labkit.server "$@"
