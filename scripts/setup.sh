#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: Debian packages, a virtualenv in .venv with the
# pinned requirements, and the project installed editable (builds the Cython extensions of native/).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "warning: libibverbs1 is missing (Mooncake needs it); install it as root" >&2
  fi
fi
# tmux: the inspector's --watch test drives a real terminal (the test skips without it)
if ! command -v tmux >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null
  else
    echo "warning: tmux is missing (tests/integration/test_inspector.py's --watch test is skipped); install it as root" >&2
  fi
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvsidecar-setup
want=$(cat requirements-dev.txt pyproject.toml setup.py native/*.pyx | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # -qq: errors only (this machine's pip config names index folders that may be missing, and
  # pip warns about each); a failing install fails set-up, with pip's own message.
  .venv/bin/python -m pip install -qq -r requirements-dev.txt
  # kvsidecar, editable: one import package, kvsidecar.*, mapped onto the checkout (setup.py).
  # Built in this venv (--no-build-isolation: the pinned Cython above, no index needed).
  .venv/bin/python -m pip install -qq --no-build-isolation -e .
  .venv/bin/python -c "import kvsidecar._native.atomics, kvsidecar._native.hashing, kvsidecar._native.copy, mooncake.store, torch, msgpack, posix_ipc, prometheus_client"
  echo "$want" > "$stamp"
fi
