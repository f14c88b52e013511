"""Cython kernels: atomics and futexes on shared memory, chained block hashing, block copies."""
