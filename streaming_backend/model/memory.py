"""What a model's tensors cost the host: bytes reserved, resident, and shared through a file.

    memory = Footprint.of(tensors)   # each storage once; CPU tensors only
    memory.reserved, memory.resident, memory.shared
    report = MemoryReport.of(weights, kv_cache)   # a compact forward's, now
    report.as_dict(), report.describe()           # for /status and the load log

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


class MemoryReport(NamedTuple):
    """What a compact forward costs the host now: its weights (shared where they lie in its
    weight file) and its KV cache (reserved whole, touched as positions are written)."""

    weights: Footprint
    kv_cache: Footprint

    @classmethod
    def of(cls, weights: Iterable[torch.Tensor], kv_cache: Iterable[torch.Tensor]) -> MemoryReport:
        """The report of the weights' and the KV cache's tensors, read now."""
        return cls(Footprint.of(weights), Footprint.of(kv_cache))

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Bytes by part, as /status shows them (wire.MEMORY)."""
        return {
            "weights": {"shared_bytes": self.weights.shared, "private_bytes": self.weights.private},
            "kv_cache": {
                "reserved_bytes": self.kv_cache.reserved,
                "touched_bytes": self.kv_cache.resident,
            },
        }

    def describe(self) -> str:
        """The load log's line."""
        weights, kv = self.weights, self.kv_cache
        return (
            f"memory: weights {weights.shared / 1e6:.0f} MB shared through a file, "
            f"{weights.private / 1e6:.0f} MB private; KV cache {kv.reserved / 2**20:.0f} MiB "
            f"reserved, {kv.resident / 2**20:.0f} MiB touched (resident as positions are written)"
        )


def resident_bytes(address: int, size: int) -> int:
    """Bytes of the pages of [address, address + size) in memory now (mincore), at most
    `size` (a span that is not page-aligned shares its end pages)."""
    page = mmap.PAGESIZE
    start = address - address % page
    pages = -(-(address + size - start) // page)
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), pages * page, vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return min(int(torch.frombuffer(vector, dtype=torch.uint8).bitwise_and(1).sum()) * page, size)


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
