#!/usr/bin/env python3
"""Read-only view of a running sidecar (see ``kvsidecar.sidecar.inspector``; also ``kvsidecar-inspect``)."""
from kvsidecar.sidecar.inspector import main

raise SystemExit(main())
