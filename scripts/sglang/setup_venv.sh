#!/usr/bin/env bash
# The SGLang test environment, kept apart from the project's main .venv:
# .sglang-venv with sglang==0.5.23 (no deps: its metadata pins CUDA-only packages), torch 2.14.1 +
# torchvision 0.29.1, the runtime deps SGLang really imports, and kvsidecar itself (with its own
# runtime deps: the tests start sidecars under this interpreter).
# Idempotent; caches stay inside the work tree (.cache/), TMPDIR is private.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
V=.sglang-venv
export TMPDIR="$root/.cache/tmp"
mkdir -p "$TMPDIR" .cache
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  need=""
  for p in ninja-build libssl-dev libibverbs1; do dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"; done
  if [ -n "$need" ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null; fi
fi
stamp=$V/.kvsidecar-sglang
want=$( (cat scripts/sglang/requirements.txt scripts/sglang/constraints.txt scripts/sglang/setup_venv.sh scripts/sglang/install_metadata.py pyproject.toml requirements-dev.txt; echo "$root") | sha256sum | cut -d" " -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
[ -x $V/bin/python ] || python3 -m venv $V
pip() { $V/bin/python -m pip "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# SGLang 0.5.23 wants torch 2.14.1, and its configs import torchvision at import time: both
# come from the machine's local wheel cache as a matched pair (a lone `pip install torchvision`
# would pull a CUDA build instead).
site=$($V/bin/python -c "import site; print(site.getsitepackages()[0])")
rm -rf "$site/torchvision"  # an earlier import-only stand-in, if any
pip install -q torch==2.14.1 torchvision==0.29.1
pip install -q --no-deps sglang==0.5.23
pip install -q -r scripts/sglang/requirements.txt -c scripts/sglang/constraints.txt
pip install -q msgpack posix-ipc cython pytest pytest-timeout mooncake-transfer-engine-non-cuda prometheus-client==0.26.0
# kvsidecar's metadata (entry points: SGLang's sglang.srt.plugins loads kvsidecar.connector.sglang_plugin in
# every scheduler process) plus a .pth naming this checkout; checked in a fresh interpreter
$V/bin/python scripts/sglang/install_metadata.py
# SGLang JIT-compiles its page-hash extension on first use (~12 s); build it now, into .cache/
TORCH_EXTENSIONS_DIR="$root/.cache/torch_extensions" SGLANG_CACHE_DIR="$root/.cache/sglang" \
  $V/bin/python -c "from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash; get_native_hash()" \
  >/dev/null 2>&1 || echo "note: SGLang's native page hash did not pre-build (it will build on first use)"
$V/bin/python -c "import sglang, torch; from sglang.srt.mem_cache.hicache_storage import HiCacheStorage; print('sglang', sglang.__version__, 'torch', torch.__version__)"
echo "$want" > "$stamp"
