"""Unit tests of sidecar/observe/."""
