"""Unit tests of sidecar/prefetch/."""
