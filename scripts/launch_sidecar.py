#!/usr/bin/env python3
"""Launch the node's kvsidecar beside the serving engine (see ``sidecar.app``; also
``python -m sidecar`` and the ``kvsidecar-launch`` console script)."""
from sidecar.app import main

raise SystemExit(main())
