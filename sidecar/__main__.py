"""``python -m kvsidecar.sidecar``: run this node's sidecar (the launcher, ``kvsidecar.sidecar.app.main``).

The same entry point is installed as the ``kvsidecar-launch`` console script, and
``kvsidecar.sidecar.spawn.SidecarProcess`` starts children this way.
"""

from kvsidecar.sidecar.app import main

if __name__ == "__main__":
    raise SystemExit(main())
