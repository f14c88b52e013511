"""Unit tests of sidecar/l3/."""
