"""The test suite.  Importing it (the runner does; so does every spawned rank process, whose
target lives in this package) makes every ``KVConnector`` the suite builds verify every block
it loads against its writer's checksum (DESIGN §7: ``verify_loads = "all"`` in the test suite),
so a wrong block anywhere in the suite is a ``CorruptBlock``, never a silent pass."""

from kvsidecar.connector import kv_client as _kv_client

_kv_client.KVConnector.__init__.__kwdefaults__["verify_loads"] = "all"
