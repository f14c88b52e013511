"""``python -m sidecar``: run this node's sidecar (the launcher, ``sidecar.app.main``).

The same entry point is installed as the ``kvsidecar-launch`` console script, and
``sidecar.spawn.SidecarProcess`` starts children this way.
"""

from sidecar.app import main

if __name__ == "__main__":
    raise SystemExit(main())
