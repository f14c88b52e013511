#!/usr/bin/env python3
"""Read-only view of a running sidecar (see ``sidecar.inspector``; also ``kvsidecar-inspect``)."""
from sidecar.inspector import main

raise SystemExit(main())
