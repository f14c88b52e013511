"""The SGLang servers' start-up module (``tests/sglang/server_standins/sitecustomize.py``), in a
fresh interpreter as a server process loads it: torch flushes denormals to zero from its import on
(what removes the slow path of SGLang's CPU attention over uninitialised padding; the cost itself
is measured in the README, not timed here)."""

import subprocess
import sys
from pathlib import Path

STANDINS = Path(__file__).resolve().parents[2] / "sglang" / "server_standins"

PROBE = "import torch; print((torch.tensor([1e-40]) * 1.0).item() == 0.0, torch.tensor([1e-40]).item() == 0.0)"


def _probe(pythonpath: str | None) -> str:
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                          check=True).stdout.split()


def test_a_server_process_flushes_denormals_from_torchs_import_on():
    assert _probe(None) == ["False", "False"]  # (the probe can tell: a plain interpreter keeps them)
    # a product with a denormal operand is zero, as is a denormal read back
    assert _probe(str(STANDINS)) == ["True", "True"]
