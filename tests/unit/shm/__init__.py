"""Unit tests of shm/."""
