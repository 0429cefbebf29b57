"""Freed memory given back to the operating system, so a long job's footprint is its window's.

glibc keeps freed heap memory for reuse, and raises its mmap threshold each time a large block
(a chunk's arrays) is freed, so that later blocks of that size come from the heap too: a bulk job
of 3,000 proteins' per-residue states grew by about their whole size (measured: 90 -> 193 MB for
83 MB of states) although it held one chunk at a time. malloc_trim(0) after each chunk gives the
freed pages back (serving/responses.release_memory, what the served models call after a large
request). Where there is no glibc it does nothing.
"""

from __future__ import annotations

import ctypes

from bionemo_export.serving.responses import TRIM_BYTES, release_memory

try:
    _MALLOPT = ctypes.CDLL("libc.so.6").mallopt
except (OSError, AttributeError):
    _MALLOPT = None
M_MMAP_THRESHOLD = -3  # malloc.h
LARGE_BLOCK = 1 << 20
"""Blocks from this size up are mapped on their own and unmapped when freed."""


def map_large_blocks() -> None:
    """Keep blocks of LARGE_BLOCK bytes and more out of the heap for the rest of the process: each
    is mapped on its own and goes back to the system when freed. Setting the threshold also stops
    glibc from raising it after every large free (which is what moved a chunk's arrays into the
    heap, where they stayed)."""
    if _MALLOPT is not None:
        _MALLOPT(M_MMAP_THRESHOLD, LARGE_BLOCK)


def give_back_memory() -> None:
    """malloc_trim(0): tens of microseconds to a few milliseconds; call it once per chunk, not per row."""
    release_memory(TRIM_BYTES)
