"""The per-node kvsidecar process: control loop, pool, index, leases, sessions, L3 workers."""
