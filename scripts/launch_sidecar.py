#!/usr/bin/env python3
"""Launch the node's kvsidecar beside the serving engine (see ``kvsidecar.sidecar.app``; also
``python -m kvsidecar.sidecar`` and the ``kvsidecar-launch`` console script)."""
from kvsidecar.sidecar.app import main

raise SystemExit(main())
