"""``python -m scripts.launch_sidecar`` (from the repo root): launch the node's kvsidecar beside the
serving engine.  The same as ``python -m kvsidecar.sidecar`` and the ``kvsidecar-launch`` console
script (see ``kvsidecar.sidecar.app``)."""
from kvsidecar.sidecar.app import main

raise SystemExit(main())
