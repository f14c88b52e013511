#!/usr/bin/env bash
# GPU host only: kvsidecar's vLLM connector on CUDA (TP workers, CUDA copies, TTFT cold vs
# restored).  Needs a CUDA vLLM in the current Python and this checkout's native/ built
# (bash scripts/setup.sh, or pip install -e . in that environment).  Not run on CPU machines.
#   bash scripts/vllm/gpu_check.sh [--model M] [--tp 2] [--tokens 4096]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs a GPU host')"
exec "$PY" -m scripts.vllm.gpu_check --model "${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}" "$@"
