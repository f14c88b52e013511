#!/usr/bin/env bash
# The test command: set up everything this project needs, then run the default suite.
# Extra arguments go to pytest (e.g. -m slow, -k ring).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1
export PATH="$PWD/.venv/bin:$PATH"  # mooncake_master comes with the venv
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
