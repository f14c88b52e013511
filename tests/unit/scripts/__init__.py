"""Unit tests of scripts/."""
