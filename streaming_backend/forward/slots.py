"""A preallocated KV cache of fixed slots, one per live stream, sized from a memory budget.

K and V are each one tensor [layers, slots + 1, kv_heads, max_len, head_dim] allocated once on
the model's device: a stream holds one slot for its whole life, a step writes its new keys at
their positions, and nothing is concatenated, padded or copied when streams join or leave. The
extra last slot is scratch: padding rows of a batch write there.

`lengths[slot]` counts the positions already filled; a slot whose first N positions hold a
reused prefix or an earlier prompt chunk simply starts at length N.

`physical[slot]` is the place in k/v holding a slot's K/V; a decode step reads every row's keys
as a view of its own place, wherever it is (forward/llama.py, `exact_attention`), so slots never
move and the mapping is the identity.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from streaming_backend.forward.llama import LlamaShape


class CacheTooSmall(ValueError):
    """The memory budget does not hold even one full-context slot."""


@dataclass(frozen=True)
class CacheBudget:
    """How much memory the KV cache may take: a byte count, or a fraction of free memory."""

    bytes: int | None = None
    fraction: float | None = None  # of the device's free memory at start (CPU: MemAvailable)

    def __post_init__(self):
        if (self.bytes is None) == (self.fraction is None):
            raise ValueError("give the KV cache budget as bytes or as a fraction, not both")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"KV cache memory fraction must be in (0, 1], not {self.fraction}")
        if self.bytes is not None and self.bytes <= 0:
            raise ValueError(f"KV cache budget must be positive, not {self.bytes}")

    def resolve(self, device: torch.device) -> int:
        """The budget in bytes on `device`."""
        if self.bytes is not None:
            return self.bytes
        return int(self.fraction * free_memory(device))


def free_memory(device: torch.device) -> int:
    """Free bytes on a CUDA device, or the host's MemAvailable for the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def slot_bytes(shape: LlamaShape, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one slot of `max_len` positions."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.layers * shape.kv_heads * max_len * shape.head_dim * element


def slots_for_budget(shape: LlamaShape, max_len: int, dtype: torch.dtype, budget: int) -> int:
    """How many full-context slots (plus the scratch slot) fit in `budget` bytes."""
    per_slot = slot_bytes(shape, max_len, dtype)
    slots = budget // per_slot - 1  # one slot's worth is the scratch slot
    if slots < 1:
        raise CacheTooSmall(
            f"a KV cache budget of {budget / 2**20:.1f} MiB holds no full-context slot: one slot "
            f"of {max_len} positions needs {per_slot / 2**20:.1f} MiB (plus as much for the "
            "scratch slot); raise the memory budget or lower the context length"
        )
    return slots


class SlotCache:
    """K/V storage for `slots` streams of up to `max_len` positions, and which slots are free."""

    def __init__(
        self, shape: LlamaShape, slots: int, max_len: int, dtype: torch.dtype, device: torch.device
    ):
        if slots < 1 or max_len < 1:
            raise ValueError(f"need at least one slot and one position, not {slots}, {max_len}")
        size = (shape.layers, slots + 1, shape.kv_heads, max_len, shape.head_dim)
        self.k = _zeroed(size, dtype, device)
        self.v = _zeroed(size, dtype, device)
        self.slots = slots
        self.max_len = max_len
        self.scratch = slots  # the extra slot that padding rows write into
        self.lengths = [0] * slots  # positions filled per slot (host-side: no device sync)
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out the lowest slot first
        self.physical = list(range(slots + 1))  # slot -> the place in k/v holding it

    @classmethod
    def for_budget(
        cls,
        shape: LlamaShape,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        budget: CacheBudget,
        max_slots: int | None = None,
    ) -> SlotCache:
        """As many slots as the budget holds (at most max_slots), or CacheTooSmall."""
        slots = slots_for_budget(shape, max_len, dtype, budget.resolve(device))
        return cls(shape, min(slots, max_slots or slots), max_len, dtype, device)

    @property
    def slot_bytes(self) -> int:
        """Bytes of K and V one slot takes."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def free_slots(self) -> int:
        """Slots not held by a stream."""
        return len(self._free)

    def allocate(self) -> int:
        """Take a free slot (length 0); IndexError when every slot is held."""
        if not self._free:
            raise IndexError("every KV cache slot is in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back. Its stale K/V stay in place; the mask hides them from the next user."""
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self.lengths[slot] = 0
        self._free.append(slot)

    def reset(self) -> None:
        """Free every slot (a batch's cache reused by the next batch)."""
        self.lengths = [0] * self.slots
        self._free = list(range(self.slots - 1, -1, -1))

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Give `target` the first `length` positions of `source` (a shared prompt prefix)."""
        if length > self.lengths[source]:
            raise ValueError(f"slot {source} holds {self.lengths[source]} positions, not {length}")
        source_at, target_at = self.physical[source], self.physical[target]
        self.k[:, target_at, :, :length] = self.k[:, source_at, :, :length]
        self.v[:, target_at, :, :length] = self.v[:, source_at, :, :length]
        self.lengths[target] = length

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first `length` positions of a held slot (the rest is overwritten later)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"slot {slot} holds {self.lengths[slot]} positions, not {length}")
        self.lengths[slot] = length

    def check_room(self, slot: int, new_tokens: int) -> None:
        """Raise ValueError when `new_tokens` more positions would not fit in `slot`."""
        if self.lengths[slot] + new_tokens > self.max_len:
            raise ValueError(
                f"slot {slot} holds {self.lengths[slot]} positions; {new_tokens} more exceed "
                f"the cache's context of {self.max_len}"
            )


# Above this size a CPU allocation is a fresh anonymous mapping (glibc's mmap threshold is at most
# 32 MiB): the OS hands out zero pages, resident only once written.
LAZY_ZERO_BYTES = 64 * 2**20


def _zeroed(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; a large one on the CPU stays unresident until its positions are written.

    Writing the zeros (torch.zeros) would make the whole budget resident at start, although most
    slots only ever hold short conversations. Masked positions are read by attention, so they
    must hold finite values: the OS's zero pages do.
    """
    element = torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or math.prod(size) * element < LAZY_ZERO_BYTES:
        return torch.zeros(size, dtype=dtype, device=device)
    return torch.empty(size, dtype=dtype, device=device)
