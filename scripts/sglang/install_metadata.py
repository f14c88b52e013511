"""Make this checkout an installed distribution of the Python that runs this script.

SGLang finds its plugins through ``importlib.metadata`` entry points, so kvsidecar must be
*installed* (metadata) in the SGLang virtualenv, not merely importable.  This writes, into the
interpreter's site-packages:

* ``kvsidecar-<version>.dist-info`` (METADATA, entry_points.txt from ``pyproject.toml``'s
  ``[project.entry-points]`` and ``[project.scripts]``, INSTALLER, RECORD), and
* ``kvsidecar-checkout.pth`` putting this checkout on ``sys.path``,

replacing an earlier kvsidecar installation there.  No build, no dependencies (the checkout's
``native/`` extensions are built by ``scripts/setup.sh``).  Usage, with the target interpreter::

    .sglang-venv/bin/python scripts/sglang/install_metadata.py [--check]

``--check`` only verifies that the ``sglang.srt.plugins`` entry point resolves to this checkout
(exit 1 if not).
"""

from __future__ import annotations

import argparse
import shutil
import site
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _site_dir() -> Path:
    dirs = [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]
    if not dirs:
        raise SystemExit("no site-packages directory for this interpreter")
    return dirs[0]


def install() -> Path:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    target = _site_dir()
    for old in target.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    for old in target.glob(f"__editable__*{name}*"):
        old.unlink()
    info = target / f"{name}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   f"Summary: {project.get('description', '')}\n")
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    eps = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
                  for g, entries in groups.items())
    (info / "entry_points.txt").write_text(eps)
    (info / "INSTALLER").write_text("kvsidecar-install-metadata\n")
    pth = target / f"{name}-checkout.pth"
    pth.write_text(f"{ROOT}\n")
    files = ["METADATA", "entry_points.txt", "INSTALLER", "RECORD"]
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in files) + f"{pth.name},,\n")
    return info


def check() -> bool:
    eps = [ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.name == "kvsidecar"]
    if len(eps) != 1:
        print(f"kvsidecar entry point: found {len(eps)} in group sglang.srt.plugins", file=sys.stderr)
        return False
    from kvsidecar import connector

    where = Path(connector.__file__).resolve().parents[1]
    ok = where == ROOT and eps[0].value == "kvsidecar.connector.sglang_plugin:load"
    print(f"kvsidecar entry point {eps[0].value} from {eps[0].dist.name} {eps[0].dist.version}; "
          f"connector imported from {where}{'' if ok else ' (not this checkout)'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only verify the installed entry point")
    args = ap.parse_args(argv)
    if not args.check:
        print(f"installed {install()}")
        # verify in a fresh interpreter: the .pth and the entry points are read at start-up
        return subprocess.call([sys.executable, str(Path(__file__).resolve()), "--check"], cwd="/")
    return 0 if check() else 1


if __name__ == "__main__":
    raise SystemExit(main())
