"""The remote tier (L3): one small interface, several backends, and the workers that run it."""
