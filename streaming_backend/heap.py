"""The C heap's free memory back to the system.

glibc's malloc keeps freed blocks under its mmap threshold, which it raises (up to 32 MiB) as
large blocks are freed. A conversion that makes and frees many tensors of a few MiB each (a
layer's, a head's rows) then keeps their freed memory resident under the tensors it keeps,
and its peak varies from run to run with where the kept ones land. Trimming after each part
returns that memory at once."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator keeps what it keeps
        return None


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc's malloc_trim; nothing elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
