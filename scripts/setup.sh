#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: Debian packages, a virtualenv in .venv with the
# pinned requirements, and the project installed editable (builds native/).
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
    echo "warning: tmux is missing (tests/test_inspector.py's --watch test is skipped); install it as root" >&2
  fi
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvsidecar-setup
want=$(cat requirements-dev.txt pyproject.toml setup.py native/*.pyx | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -r requirements-dev.txt 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import kvsidecar._native.atomics, kvsidecar._native.hashing, kvsidecar._native.copy, mooncake.store, torch, msgpack, posix_ipc, prometheus_client"
  echo "$want" > "$stamp"
fi
