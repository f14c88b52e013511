"""Unit tests of sidecar/."""
