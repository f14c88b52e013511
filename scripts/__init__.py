"""Runnable tools: launcher and inspector wrappers, benchmarks, the engine simulators, the demo.

A package, not a folder of scripts: each tool runs as ``python -m scripts.X`` **from the repo
root** (the working directory is what puts ``scripts`` on ``sys.path``), with kvsidecar installed
(``scripts/setup.sh`` installs it editable into ``.venv``).  The tools import each other and
kvsidecar absolutely (``from scripts import trials``, ``from kvsidecar.sidecar.spawn import
SidecarProcess``), so ``python scripts/X.py`` is not supported.  Being a package also lets the
tests import a tool's code (``from scripts import simulate``).  Not part of the installed
distribution, which holds only ``kvsidecar``.
"""
