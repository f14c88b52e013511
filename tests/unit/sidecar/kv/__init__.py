"""Unit tests of sidecar/kv/."""
