"""Prefetch sessions: the pure lifecycle machine and its executor."""
