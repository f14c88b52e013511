"""Integration tests: real sidecar processes, rings, shared memory and L3 tiers."""
