# cython: language_level=3, boundscheck=False, wraparound=False
"""Multi-region copies between raw addresses, with the GIL released.

Used to move each rank's shard of each (block, layer, K/V) between the shared
CPU pool and engine tensors: one ``memcpy`` per region, all regions of a call
in one C loop.  Addresses must lie inside live mappings / tensors the caller
keeps alive for the duration of the call; sizes are checked by the caller.
"""

from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy


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
