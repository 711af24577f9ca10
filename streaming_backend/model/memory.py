"""What a model's tensors cost the host: bytes reserved, resident, and shared through a file.

    memory = Footprint.of(tensors)   # each storage once; CPU tensors only
    memory.reserved, memory.resident, memory.shared

A storage that lies in a file mapping (a weight file's, model/weight_cache.py) is shared: its
pages are the page cache's, held once for every process that maps the file. Any other is the
process's own. Resident bytes are the storages' pages in memory now (mincore): a fresh anonymous
mapping stays unresident until written, as the KV cache's do (forward/slots.py).
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch


class Footprint(NamedTuple):
    """Bytes of a set of storages: all of them, those in memory now, those in file mappings."""

    reserved: int
    resident: int
    shared: int

    @classmethod
    def of(cls, tensors: Iterable[torch.Tensor]) -> Footprint:
        """The footprint of the CPU storages these tensors view, each counted once."""
        spans = {}
        for tensor in tensors:
            if tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                if storage.nbytes():
                    spans[storage.data_ptr()] = storage.nbytes()
        files = _file_mappings()
        return cls(
            reserved=sum(spans.values()),
            resident=sum(resident_bytes(start, size) for start, size in spans.items()),
            shared=sum(size for start, size in spans.items() if _within(start, files)),
        )

    @property
    def private(self) -> int:
        """Bytes that are this process's own (not in a file mapping)."""
        return self.reserved - self.shared


def resident_bytes(address: int, size: int) -> int:
    """Bytes of the pages of [address, address + size) in memory now (mincore)."""
    page = mmap.PAGESIZE
    start = address - address % page
    pages = -(-(address + size - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), pages * page, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return int(torch.frombuffer(vector, dtype=torch.uint8).bitwise_and(1).sum()) * page


def _file_mappings() -> list[tuple[int, int]]:
    """This process's mappings of files: (start, end)."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def _within(address: int, spans: list[tuple[int, int]]) -> bool:
    return any(start <= address < end for start, end in spans)
