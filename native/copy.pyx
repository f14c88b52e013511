# cython: language_level=3, boundscheck=False, wraparound=False
"""Multi-region copies between raw addresses, with the GIL released.

Used to move each rank's shard of each (block, layer, K/V) between the shared
CPU pool and engine tensors: one ``memcpy`` per region, all regions of a call
in one C loop.  Addresses must lie inside live mappings / tensors the caller
keeps alive for the duration of the call; sizes are checked by the caller.
"""

from cpython cimport array
from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy

import array as _array

cdef array.array _INT64 = _array.array("q")


def copy_regions(uintptr_t dst_base, const int64_t[::1] dst_offsets,
                 uintptr_t src_base, const int64_t[::1] src_offsets,
                 Py_ssize_t nbytes):
    """``memcpy(dst_base + dst_offsets[i], src_base + src_offsets[i], nbytes)`` for every i."""
    if dst_offsets.shape[0] != src_offsets.shape[0]:
        raise ValueError("offset arrays differ in length")
    if nbytes < 0:
        raise ValueError("negative size")
    cdef Py_ssize_t i, n = dst_offsets.shape[0]
    cdef char *d = <char*>dst_base
    cdef const char *s = <const char*>src_base
    with nogil:
        for i in range(n):
            memcpy(d + dst_offsets[i], s + src_offsets[i], nbytes)
    return n


def piece_offsets(blocks, int64_t stride, int64_t base, Py_ssize_t per, int64_t piece_bytes,
                  int64_t num_blocks):
    """``b * stride + base + j * piece_bytes`` for each block id ``b`` of ``blocks``, for each
    ``j < per``, in that order: the offsets of ``copy_regions`` for ``per`` consecutive pieces of
    each block, built in one C loop (a Python generator over 128 blocks x 8 pieces took 127 us of
    the engine process's GIL, this 32 us).  Raises ``IndexError`` naming the first block id
    outside ``[0, num_blocks)``; the result is an ``array('q')`` of ``len(blocks) * per``."""
    if per < 0 or piece_bytes < 0:
        raise ValueError("negative piece count or size")
    cdef Py_ssize_t n = len(blocks), i = 0, j
    cdef array.array out = array.clone(_INT64, n * per, zero=False)
    cdef long long *o = out.data.as_longlongs  # ("q" is a C long long)
    cdef long long b, at
    for obj in blocks:
        if i >= n * per and per:  # (a sequence that grew while read: never write past the array)
            raise ValueError("blocks changed length")
        b = obj
        if b < 0 or b >= num_blocks:
            raise IndexError(f"block id {b} outside the pool")
        at = b * stride + base
        for j in range(per):
            o[i] = at + j * piece_bytes
            i += 1
    if i != n * per:  # (one that shrank: no unwritten offset may reach a copy)
        raise ValueError("blocks changed length")
    return out


def copy_bytes(uintptr_t dst, uintptr_t src, Py_ssize_t nbytes):
    """One plain ``memcpy`` with the GIL released (the benchmark baseline)."""
    with nogil:
        memcpy(<char*>dst, <const char*>src, nbytes)


def touch_pages(uintptr_t addr, Py_ssize_t nbytes, Py_ssize_t stride=4096):
    """Read one byte every ``stride`` bytes of ``[addr, addr + nbytes)`` with the GIL released;
    returns their XOR (so the reads cannot be optimised away).  The range must be mapped."""
    if nbytes < 0 or stride <= 0:
        raise ValueError("negative size or non-positive stride")
    cdef const unsigned char *p = <const unsigned char*>addr
    cdef Py_ssize_t off = 0
    cdef unsigned char acc = 0
    with nogil:
        while off < nbytes:
            acc ^= p[off]
            off += stride
    return acc
