#!/usr/bin/env bash
# The SGLang test environment, kept apart from the project's main .venv:
# .sglang-venv with sglang==0.5.23 (no deps: its metadata pins CUDA-only packages), torch 2.14.1 +
# torchvision 0.29.1, the runtime deps SGLang really imports, and kvsidecar itself, installed the
# ordinary way (pip install -e ., which also brings its runtime deps: the tests start sidecars
# under this interpreter).  Idempotent; caches stay inside the work tree (.cache/), TMPDIR is
# private.  Every install must succeed: a failing pip fails set-up with pip's own message.
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
want=$( (cat scripts/sglang/requirements.txt scripts/sglang/constraints.txt scripts/sglang/setup_venv.sh pyproject.toml setup.py requirements-dev.txt; echo "$root") | sha256sum | cut -d" " -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi
[ -x $V/bin/python ] || python3 -m venv $V
# -qq: errors only (this machine's pip config names index folders that may be missing, and pip
# warns about each one); --no-warn-conflicts: SGLang is installed without its dependencies on
# purpose, and pip would list some fifty of them as missing after every install (a report, exit
# status 0).  pip's exit status is the function's: a failing install fails set-up.
pip_install() { $V/bin/python -m pip install -qq --no-warn-conflicts "$@"; }
# SGLang 0.5.23 wants torch 2.14.1, and its configs import torchvision at import time: both
# come from the machine's local wheel cache as a matched pair (a lone `pip install torchvision`
# would pull a CUDA build instead).
site=$($V/bin/python -c "import site; print(site.getsitepackages()[0])")
# an earlier import-only torchvision stand-in (a bare folder, no distribution), if any; never the
# real one, which pip would then think installed
if [ -d "$site/torchvision" ] && ! $V/bin/python -m pip show -qq torchvision >/dev/null 2>&1; then
  rm -rf "$site/torchvision"
fi
pip_install torch==2.14.1 torchvision==0.29.1
# a venv whose torchvision files an earlier version of this script removed (dist-info left behind)
[ -f "$site/torchvision/__init__.py" ] || pip_install --force-reinstall --no-deps torchvision==0.29.1
pip_install --no-deps sglang==0.5.23
pip_install -r scripts/sglang/requirements.txt -c scripts/sglang/constraints.txt
# The test tools and kvsidecar's build requirements (pyproject.toml), pinned as in
# requirements-dev.txt (its torch pin does not apply: torch is not asked for here).
pip_install -c requirements-dev.txt pytest pytest-timeout mooncake-transfer-engine-non-cuda setuptools wheel cython
# kvsidecar, editable, with its runtime deps (SGLang's load_plugins() finds
# kvsidecar.connector.sglang_plugin:load through the sglang.srt.plugins entry point, so it must be
# installed, not merely importable).  Built in this venv with the pinned Cython.  The build
# requirements above are why this works: Python 3.11's venv brings setuptools 65 and no `wheel`,
# and there `pip install --no-build-isolation -e .` stops at "invalid command 'bdist_wheel'" --
# why this set-up once wrote kvsidecar's dist-info by hand.
pip_install -c requirements-dev.txt --no-build-isolation -e .
# a fresh interpreter, away from the checkout: the entry point loads this checkout's plugin
(cd / && "$root/$V/bin/python" - "$root" <<'EOF'
import sys
from importlib.metadata import entry_points
from pathlib import Path

eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kvsidecar"]
assert len(eps) == 1 and eps[0].value == "kvsidecar.connector.sglang_plugin:load", eps
module = sys.modules[eps[0].load().__module__]
assert Path(module.__file__).resolve().parents[1] == Path(sys.argv[1]).resolve(), module.__file__
print(f"kvsidecar plugin {eps[0].value} ({eps[0].dist.name} {eps[0].dist.version}) from {module.__file__}")
EOF
)
# SGLang JIT-compiles its page-hash extension on first use (~12 s); build it now, into .cache/
TORCH_EXTENSIONS_DIR="$root/.cache/torch_extensions" SGLANG_CACHE_DIR="$root/.cache/sglang" \
  $V/bin/python -c "from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash; get_native_hash()" \
  >/dev/null 2>&1 || echo "note: SGLang's native page hash did not pre-build (it will build on first use)"
$V/bin/python -c "import sglang, torch, torchvision; from sglang.srt.mem_cache.hicache_storage import HiCacheStorage; print('sglang', sglang.__version__, 'torch', torch.__version__, 'torchvision', torchvision.__version__)"
echo "$want" > "$stamp"
