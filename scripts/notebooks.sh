#!/usr/bin/env bash
# Set up (if needed) and open the course's notebooks in JupyterLab, on 127.0.0.1 only. Extra
# arguments go to `jupyter lab` (e.g. --no-browser --port 8888).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
as_root=()
# Containers often run as root, which JupyterLab refuses without this; it still listens on 127.0.0.1 only.
[ "$(id -u)" = 0 ] && as_root=(--allow-root)
exec .venv/bin/jupyter lab --ip 127.0.0.1 --notebook-dir notebooks "${as_root[@]}" "$@"
