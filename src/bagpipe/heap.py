"""How glibc's malloc serves this process's large arrays, set for the work at hand (``mallopt``); elsewhere than
glibc these do nothing and the allocator's own policy stands.

glibc gives an allocation of at least its mmap threshold a mapping of its own, unmapped when freed, and starts
with a threshold of 128 KiB that it raises (up to 32 MiB) to the size of each large block freed; memory freed at
the top of a heap goes back to the system past the trim threshold. Two kinds of process here want otherwise:

- ``bounded_heap``: a server with a memory budget maps every large transient buffer, so freeing it returns it.
- ``kept_heap``: a converter allocates and frees the same tens of MiB of numpy temporaries for every block, on
  several threads; mapped or trimmed, each page of them is faulted in and zeroed again for every block, which cost
  a fifth of the Criteo conversion's CPU. Kept in the heap, they are reused.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters
KEPT_BYTES = 1 << 30  # kept_heap: blocks up to this size come from the heap and stay there when freed
# after kept_heap: where glibc's own adaptation ends for a process that frees large blocks
SETTLED_MMAP_THRESHOLD, SETTLED_TRIM_THRESHOLD = 32 << 20, 64 << 20


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def bounded_heap(threshold_bytes: int = 1 << 20) -> None:
    """Give every allocation of ``threshold_bytes`` or more its own mapping, returned to the system when
    freed. glibc otherwise raises that threshold after the first large free, up to 32 MiB, and serves
    later large arrays from a heap it rarely shrinks: a budgeted process would keep every transient
    fetch buffer it ever had."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes)


def trim() -> None:
    """Give back to the system what the heap holds free (after ``kept_heap``, up to its settled trim threshold
    of freed memory stays mapped): what is resident after it is what the process holds."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextmanager
def kept_heap() -> Iterator[None]:
    """Within: large blocks come from the heap and stay there when freed, to be reused. After: the thresholds
    glibc's adaptation settles at (no longer adapted further), and what the heap holds free is given back."""
    libc = _libc()
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, KEPT_BYTES)
    libc.mallopt(M_TRIM_THRESHOLD, KEPT_BYTES)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, SETTLED_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, SETTLED_TRIM_THRESHOLD)
        libc.malloc_trim(0)
