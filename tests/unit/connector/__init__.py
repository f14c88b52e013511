"""Unit tests of connector/."""
