"""Unit tests, one folder per package: one process, real objects, no sidecar process."""
