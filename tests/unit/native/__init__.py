"""Unit tests of native/."""
