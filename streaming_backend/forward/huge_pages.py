"""The weights in transparent huge pages: one arena, madvised before its first touch.

A decode step reads every weight once. In 4 KiB pages that is a TLB miss every 4 KiB (a
default-model step touches about 25 000 pages, the 1B model's 170 000; the second-level TLB
holds a few thousand), and the hardware prefetchers stop at each page's end. Where the kernel
gives huge pages only on request (`/sys/kernel/mm/transparent_hugepage/enabled` reads
`[madvise]`, as on the machines here), the weights are copied into one arena asked for in 2 MiB
pages; each tensor keeps its identity (`Tensor.set_`), so whatever holds it now reads the arena.
Measured on the Intel Xeon of docs/performance.md, interleaved in one process
(scripts/forward_bench.py's int4-small-pages): one stream's step 1.04x (default model) and 1.03x
(1B); the 1B shapes' int4 weights alone streamed 1.07x faster (the median of 20 alternations).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger("tokenstream.model")

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
ALIGN = 4096  # each storage's start in the arena: a page, so every dtype and cache line fits
MADV_HUGEPAGE = 14  # <sys/mman.h>
MADV_POPULATE_READ = 22  # <sys/mman.h>, Linux 5.14: fault every page of a range in, reading
SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(setting: Path = SETTING) -> str:
    """The kernel's transparent huge page mode: "always", "madvise", "never", or "absent"
    where the kernel has no such setting."""
    try:
        text = setting.read_text()
    except OSError:
        return "absent"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "absent"


def _madvise(address: int, length: int) -> None:
    """Ask for huge pages over [address, address + length) (page aligned); OSError if refused."""
    libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: its libc's madvise
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(address, length, MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")


def empty(nbytes: int) -> tuple[torch.Tensor, int]:
    """An untouched uint8 buffer holding `nbytes` from a 2 MiB boundary, that span madvised
    for huge pages before any page of it is faulted in; returns (buffer, that start's index)."""
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    address = buffer.data_ptr()
    start = -address % HUGE_PAGE
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages; the buffer's slack covers it
    _madvise(address + start, min(span, buffer.numel() - start) // 4096 * 4096)
    return buffer, start


def _storages(
    tensors: Iterable[torch.Tensor], along: Iterable[torch.Tensor]
) -> dict[int, list[torch.Tensor]]:
    """The CPU tensors grouped by the storage they view, keyed by its address, with those of
    `along` that view one of these storages (views of one storage move together, so they stay
    views of one another, and the old storage is not kept alive by a view left behind)."""
    groups: dict[int, list[torch.Tensor]] = {}

    def add(tensor: torch.Tensor, new: bool) -> None:
        key = tensor.untyped_storage().data_ptr()
        if tensor.device.type != "cpu" or (key not in groups and not new):
            return
        members = groups.setdefault(key, [])
        if not any(tensor is other for other in members):
            members.append(tensor)

    for tensor in tensors:
        add(tensor, new=True)
    for tensor in along:
        add(tensor, new=False)
    groups.pop(0, None)  # empty storages: nothing to move
    return groups


def place(
    tensors: Iterable[torch.Tensor], along: Iterable[torch.Tensor] = (), minimum: int = HUGE_PAGE
) -> int:
    """Move the storages of these CPU tensors into one huge-page arena, each tensor keeping its
    identity, shape, strides and values, and with them every tensor of `along` viewing one of
    those storages (a model's parameters); returns the bytes moved (0 when fewer than
    `minimum`, a single huge page by default, or the kernel gives no huge pages on request)."""
    if thp_mode() != "madvise":
        return 0  # "always": they are huge already where aligned; "never": nothing to gain
    groups = _storages(tensors, along)
    sizes = {key: group[0].untyped_storage().nbytes() for key, group in groups.items()}
    offsets, total = {}, 0
    for key, size in sizes.items():
        offsets[key] = total
        total += -(-size // ALIGN) * ALIGN
    if total < minimum:
        return 0
    with torch.no_grad():
        buffer, start = empty(total)
        arena = buffer.untyped_storage()
        for key in list(groups):
            group = groups.pop(key)  # its old storage is freed once the last view moves
            at = start + offsets[key]
            old = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())
            buffer[at : at + sizes[key]].copy_(old)
            for tensor in group:
                size = tensor.element_size()
                offset = at // size + tensor.storage_offset()
                tensor.set_(arena, offset, tensor.shape, tensor.stride())
    log.info("weights: %.0f MB placed in transparent huge pages", total / 1e6)
    return total


def map_file(fd: int) -> mmap.mmap:
    """A read-only mapping of the whole file open at `fd`, asked for huge pages, with every page
    read in (a weight file: the first step reads them all anyway).

    The kernel maps a file in huge pages only where its page cache holds it in huge folios, and
    it keeps what it holds: pages a write left there (weight_file lets its own go), or pages
    read back one by one after reclaim took them (a host's cold-memory pageout, DAMON's, takes
    the weights of an idle server), are small folios, and every later mapping gets them in
    4 KiB pages, a slower step (the module docstring). So where less than half the mapping came
    in huge pages, the file's unmapped pages are let go (POSIX_FADV_DONTNEED: pages another
    process maps stay) and read again through a new mapping, once; the log says what that gave.
    """
    mapped = _map_read(fd)
    if thp_mode() not in ("always", "madvise") or len(mapped) < 2 * HUGE_PAGE:
        return mapped
    huge, resident = _populate(mapped)
    if resident == 0 or huge >= resident // 2:
        return mapped
    mapped.close()
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    mapped = _map_read(fd)
    again, resident = _populate(mapped)
    log.info(
        "weights: the page cache held the weight file in small pages (%.0f of %.0f MB mapped in"
        " huge pages); read again: %.0f MB", huge / 1e6, resident / 1e6, again / 1e6,
    )  # fmt: skip
    return mapped


def _map_read(fd: int) -> mmap.mmap:
    """The whole file read-only, huge pages asked for where the platform has the advice."""
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE)
    return mapped


def _populate(mapped: mmap.mmap) -> tuple[int, int]:
    """Read every page of a mapping in; (bytes of it mapped in huge pages, bytes resident), or
    (0, 0) where the kernel cannot populate a range or the process's mappings cannot be read."""
    try:
        mapped.madvise(MADV_POPULATE_READ)
    except OSError:  # before Linux 5.14: the pages come in as the steps read them
        return 0, 0
    with warnings.catch_warnings():  # read-only, and only its address is wanted
        warnings.simplefilter("ignore", UserWarning)
        address = torch.frombuffer(mapped, dtype=torch.uint8).data_ptr()
    return mapping_sizes(address)


def mapping_sizes(address: int, smaps: Path = Path("/proc/self/smaps")) -> tuple[int, int]:
    """(bytes mapped in huge pages, bytes resident) of this process's file mapping that starts
    at `address` (smaps' FilePmdMapped and Rss); (0, 0) where there is none or no smaps."""
    try:
        text = smaps.read_text()
    except OSError:
        return 0, 0
    huge = resident = 0
    ours = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            ours = int(head.split("-")[0], 16) == address
        elif ours and head == "Rss:":
            resident = int(line.split()[1]) * 1024
        elif ours and head == "FilePmdMapped:":
            huge = int(line.split()[1]) * 1024
    return huge, resident
