#!/usr/bin/env bash
# The test command: set up everything this project needs, then run the default suite, then the
# SGLang controller-level suite in its own virtualenv (marker `sglang`).
# Extra arguments go to the main pytest run (e.g. -m slow, -k ring); KVS_SKIP_SGLANG=1 skips the
# SGLang part.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1
export PATH="$PWD/.venv/bin:$PATH"  # mooncake_master comes with the venv
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
if [ "${KVS_SKIP_SGLANG:-0}" != 1 ]; then
  bash scripts/sglang/setup_venv.sh
  export TMPDIR="$PWD/.cache/tmp" TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" SGLANG_CACHE_DIR="$PWD/.cache/sglang"
  mkdir -p "$TMPDIR"
  PATH="$PWD/.sglang-venv/bin:$PATH" .sglang-venv/bin/python -m pytest -q -p no:cacheprovider -m "sglang and not slow" tests/sglang
fi
