#!/usr/bin/env python3
"""Launch the node's kvsidecar beside the serving engine (see ``sidecar.launcher``)."""
import sys

from sidecar.launcher import main

if __name__ == "__main__":
    sys.exit(main())
