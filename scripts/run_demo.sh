#!/usr/bin/env bash
# The main job: set up, then run the sidecar on its embedded defaults beside a simulated engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1
export PATH="$PWD/.venv/bin:$PATH"  # mooncake_master comes with the venv
exec .venv/bin/python -m scripts.demo "$@"
