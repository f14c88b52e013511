"""Runnable tools: launcher and inspector wrappers, benchmarks, the engine simulator, the demo.

Each runs as ``python scripts/X.py`` (with kvsidecar installed, as ``scripts/setup.sh`` does) or
as ``python -m scripts.X`` from the repo root.  Being a package lets the tests import a tool's
code (``from scripts import simulate``) from the repo root without touching ``sys.path``.  It is
not part of the installed distribution (a top-level ``scripts`` package would collide).
"""
