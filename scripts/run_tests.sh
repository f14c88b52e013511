#!/usr/bin/env bash
# The test command: set up everything this project needs, then run the default suite, then the
# SGLang controller-level suite in its own virtualenv (marker `sglang`), then the vLLM suite in
# its own (marker `vllm`: vLLM's real scheduler, and a real CPU engine).
# Between them, the wall-clock bounds (marker `timing`: each such test's [timed] copy) run as a
# step of their own; a bound that fails there fails the run (the bounds are generous: seconds for
# what takes milliseconds, so they hold on a loaded 2-core machine).
# Extra arguments go to the main pytest run (e.g. -m slow, -k ring); KVS_SKIP_TIMING=1 /
# KVS_SKIP_SGLANG=1 / KVS_SKIP_VLLM=1 skip those parts.
set -euo pipefail
cd "$(dirname "$0")/.."
free_space() { echo "== free disk before $1: $(df -h . | awk 'NR==2 {print $4}') (the SGLang and vLLM venvs take ~6 and ~4 GiB) =="; }
free_space "setup"
bash scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1
export PATH="$PWD/.venv/bin:$PATH"  # mooncake_master comes with the venv
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
if [ "${KVS_SKIP_TIMING:-0}" != 1 ]; then
  echo "== timing: wall-clock bounds (pytest -m timing) =="
  .venv/bin/python -m pytest -q -p no:cacheprovider -m "timing and not slow" tests --ignore=tests/sglang --ignore=tests/vllm
fi
if [ "${KVS_SKIP_SGLANG:-0}" != 1 ]; then
  free_space "the SGLang venv"
  bash scripts/sglang/setup_venv.sh
  export TMPDIR="$PWD/.cache/tmp" TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" SGLANG_CACHE_DIR="$PWD/.cache/sglang"
  mkdir -p "$TMPDIR"
  PATH="$PWD/.sglang-venv/bin:$PATH" .sglang-venv/bin/python -m pytest -q -p no:cacheprovider -m "sglang and not slow" tests/sglang
fi
if [ "${KVS_SKIP_VLLM:-0}" != 1 ]; then
  free_space "the vLLM venv"
  bash scripts/vllm/setup_venv.sh
  VLLM_TARGET_DEVICE=cpu PATH="$PWD/.vllm-venv/bin:$PATH" .vllm-venv/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/vllm
fi
