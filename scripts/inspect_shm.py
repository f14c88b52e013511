"""``python -m scripts.inspect_shm`` (from the repo root): read-only view of a running sidecar.  The
same as ``python -m kvsidecar.sidecar.inspector`` and ``kvsidecar-inspect`` (see
``kvsidecar.sidecar.inspector``)."""
from kvsidecar.sidecar.inspector import main

raise SystemExit(main())
