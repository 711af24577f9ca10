"""A preallocated KV cache of fixed slots, one per live stream, sized from a memory budget.

K and V are each one tensor per layer, [slots + 1, kv_heads, rows, head_dim], allocated once on
the model's device: a stream holds one slot for its whole life, a step writes its new keys at
their positions, and nothing is concatenated, padded or copied when streams join or leave. The
extra last slot is scratch: padding rows of a batch write there.

A full-attention layer keeps `max_len` rows, position p in row p. A sliding-window layer (Gemma
2/3's local layers, Mistral's sliding_window) keeps a ring of window + chunk - 1 rows, position
p in row p mod rows (`layer_rows`): its tokens attend over their last `window` positions only,
and a prefill call writes all of its (up to `chunk`) tokens' keys before any of them attends,
so the ring holds the window of the call's first token while the call writes its last
(llama.cpp's SWA cache holds n_swa + n_ubatch likewise). SlotForward splits longer chunks
(`chunk_limit`). Layers of one row count share one allocation.

`lengths[slot]` counts the positions already filled; a slot whose first N positions hold a
reused prefix or an earlier prompt chunk simply starts at length N. A ring that has wrapped has
overwritten its slot's early positions, so a slot's first N positions can be reused (taken over
with `truncate`, copied with `copy_prefix`) only while every ring still holds the window before
position N: `reusable` is that rule, and both refuse what it refuses.

`physical[slot]` is the place in k/v holding a slot's K/V; a decode step reads every row's keys
as a view of its own place, wherever it is (forward/layers.py, `exact_attention`), so slots never
move and the mapping is the identity.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from typing import Any

import torch

from streaming_backend.forward.family import LlamaShape


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


# The most positions one prefill call writes per slot where a layer keeps a ring: its ring
# holds window + WINDOW_CHUNK - 1 positions. As llama.cpp's default micro-batch: calls of 512
# tokens keep the matmuls efficient, and Gemma 3's rings (windows of 512 and 1024) stay small.
WINDOW_CHUNK = 512


def layer_rows(shape: LlamaShape, max_len: int, chunk: int = WINDOW_CHUNK) -> tuple[int, ...]:
    """Positions each layer keeps per slot: max_len for full attention, window + chunk - 1
    (a ring) for a sliding window, unless that is no shorter."""
    if chunk < 1:
        raise ValueError(f"a prefill call must write at least one position, not {chunk}")
    return tuple(min(max_len, window + chunk - 1) for window in shape.windows)


def slot_bytes(
    shape: LlamaShape, max_len: int, dtype: torch.dtype, chunk: int = WINDOW_CHUNK
) -> int:
    """Bytes of K and V for one slot of `max_len` positions (sliding-window layers: their ring)."""
    element = torch.empty((), dtype=dtype).element_size()
    rows = sum(layer_rows(shape, max_len, chunk))
    return 2 * rows * shape.kv_heads * shape.head_dim * element


def slots_for_budget(
    shape: LlamaShape, max_len: int, dtype: torch.dtype, budget: int, chunk: int = WINDOW_CHUNK
) -> int:
    """How many full-context slots (plus the scratch slot) fit in `budget` bytes."""
    per_slot = slot_bytes(shape, max_len, dtype, chunk)
    slots = budget // per_slot - 1  # one slot's worth is the scratch slot
    if slots < 1:
        raise CacheTooSmall(
            f"a KV cache budget of {budget / 2**20:.1f} MiB holds no full-context slot: one slot "
            f"of {max_len} positions needs {per_slot / 2**20:.1f} MiB (plus as much for the "
            "scratch slot); raise the memory budget or lower the context length"
        )
    return slots


def draft_slots_for_budget(budget: int, slot: int, draft_slot: int, most: int) -> int:
    """How many slots (plus its scratch slot) a draft model's KV cache gets where it shares
    `budget` bytes with the model's cache: one a model slot, at most `most` (one a stream), the
    rest of the budget the model's. `slot`, `draft_slot`: one slot's bytes in each cache (a
    scratch slot costs as much). CacheTooSmall when not even one slot of each fits."""
    if (budget - (most + 1) * draft_slot) // slot - 1 >= most:
        return most  # the model keeps at least as many slots
    slots = budget // (slot + draft_slot) - 1  # pairs of slots, the scratch pair aside
    if slots < 1:
        raise CacheTooSmall(
            f"a KV cache budget of {budget / 2**20:.1f} MiB holds no full-context slot beside "
            f"the draft model's: one of each needs {(slot + draft_slot) / 2**20:.1f} MiB (plus "
            "as much for their scratch slots); raise the memory budget or lower the context length"
        )
    return slots


class SlotCache:
    """K/V storage for `slots` streams of up to `max_len` positions, and which slots are free."""

    def __init__(
        self,
        shape: LlamaShape,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        chunk: int = WINDOW_CHUNK,
    ):
        if slots < 1 or max_len < 1:
            raise ValueError(f"need at least one slot and one position, not {slots}, {max_len}")
        self.rows = layer_rows(shape, max_len, chunk)  # per layer
        # the layers of each row count in one allocation: (their numbers, K, V)
        self._stores = []
        for rows in sorted(set(self.rows), reverse=True):
            layers = [i for i, r in enumerate(self.rows) if r == rows]
            size = (len(layers), slots + 1, shape.kv_heads, rows, shape.head_dim)
            self._stores.append(
                (layers, _zeroed(size, dtype, device), _zeroed(size, dtype, device))
            )
        # per layer: [slots + 1, kv_heads, rows, head_dim], a view of its store
        self.k = _per_layer(self._stores, 1, shape.layers)
        self.v = _per_layer(self._stores, 2, shape.layers)
        # (window, rows) of the rings: the layers whose early positions get overwritten
        self._rings = sorted({(w, r) for w, r in zip(shape.windows, self.rows) if r < max_len})
        # the most positions a prefill call may write per slot; None: as many as fit
        self.chunk_limit = chunk if self._rings else None
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
        chunk: int = WINDOW_CHUNK,
    ) -> SlotCache:
        """As many slots as the budget holds (at most max_slots), or CacheTooSmall."""
        slots = slots_for_budget(shape, max_len, dtype, budget.resolve(device), chunk)
        return cls(shape, min(slots, max_slots or slots), max_len, dtype, device, chunk)

    @property
    def bytes(self) -> int:
        """The memory K and V take, the scratch slot's included."""
        return sum(t.numel() * t.element_size() for _, k, v in self._stores for t in (k, v))

    def report(self) -> dict[str, Any]:
        """What the cache holds, for /status: slots, positions per slot, its dtype, bytes (the
        scratch slot's included), and how many layers keep a ring of how many rows (0, [] when
        none)."""
        return {
            "slots": self.slots,
            "positions": self.max_len,
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes": self.bytes,
            "ring_layers": sum(rows < self.max_len for rows in self.rows),
            "ring_rows": sorted({rows for _, rows in self._rings}),
        }

    def describe_rings(self) -> str:
        """How the sliding-window layers keep their positions, for the log ('' when none wrap)."""
        report = self.report()
        if not report["ring_layers"]:
            return ""
        sizes = "/".join(map(str, report["ring_rows"]))
        return (
            f"; {report['ring_layers']} of {len(self.rows)} layers sliding-window rings of {sizes}"
        )

    @property
    def device(self) -> torch.device:
        """Where K and V live."""
        return self.k[0].device

    @property
    def dtype(self) -> torch.dtype:
        """What K and V are kept in."""
        return self.k[0].dtype

    @property
    def slot_bytes(self) -> int:
        """Bytes of K and V one slot takes."""
        return self.bytes // (self.slots + 1)  # every slot, the scratch one too, alike

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

    def reusable(self, slot: int, length: int) -> int:
        """How many of `slot`'s first `length` positions a stream can continue from: `length`
        while every sliding-window layer's ring still holds the window before position
        `length`, else 0 (positions the ring overwrote are gone; a shorter prefix needs earlier
        ones still, so nothing shorter is reusable either). Full-attention layers keep all.

        A ring of R rows holds positions [held - R, held) of the `held` written; the token at
        `length` attends back to length - window + 1. So a prefix is reusable up to R - window
        + 1 (the chunk) positions short of what the slot holds: a conversation resent whole,
        or a beam fork of the whole slot, always is.
        """
        held = self.lengths[slot]
        if not 0 <= length <= held:
            raise ValueError(f"slot {slot} holds {held} positions, not {length}")
        kept = all(
            held <= rows or length - window + 1 >= held - rows for window, rows in self._rings
        )
        return length if kept else 0

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Give `target` the first `length` positions of `source` (a shared prompt prefix, a
        beam fork); ValueError unless `reusable` allows that length."""
        self._check_reusable(source, length)
        source_at, target_at = self.physical[source], self.physical[target]
        held = self.lengths[source]
        for _, k, v in self._stores:
            rows = k.shape[3]  # a ring that has wrapped: all of it (the rows past `length`
            count = length if held <= rows else rows  # are rewritten before they are read)
            k[:, target_at, :, :count] = k[:, source_at, :, :count]
            v[:, target_at, :, :count] = v[:, source_at, :, :count]
        self.lengths[target] = length

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first `length` positions of a held slot (the rest is overwritten later);
        ValueError unless `reusable` allows that length."""
        self._check_reusable(slot, length)
        self.lengths[slot] = length

    def _check_reusable(self, slot: int, length: int) -> None:
        if length and self.reusable(slot, length) != length:
            raise ValueError(
                f"slot {slot} holds {self.lengths[slot]} positions, but its sliding-window "
                f"layers no longer hold the window before position {length} (ask reusable())"
            )

    def check_room(self, slot: int, new_tokens: int) -> None:
        """Raise ValueError when `new_tokens` more positions would not fit in `slot`."""
        if self.lengths[slot] + new_tokens > self.max_len:
            raise ValueError(
                f"slot {slot} holds {self.lengths[slot]} positions; {new_tokens} more exceed "
                f"the cache's context of {self.max_len}"
            )


def _per_layer(stores, which: int, layers: int) -> tuple[torch.Tensor, ...]:
    """Each layer's view of its store's K (which 1) or V (2)."""
    views: list[torch.Tensor | None] = [None] * layers
    for store in stores:
        for index, view in zip(store[0], store[which].unbind(0)):
            views[index] = view
    return tuple(views)


# Above this size a CPU KV allocation is a private anonymous mapping of its own.
LAZY_ZERO_BYTES = 64 * 2**20


def _zeroed(size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; a large one on the CPU stays unresident until its positions are written.

    Writing the zeros (torch.zeros) would make the whole budget resident at start, although most
    slots only ever hold short conversations. Masked positions are read by attention, so they
    must hold finite values. A fresh private anonymous mapping is the OS's zero pages, resident
    only once written. torch.empty is not one: glibc serves even a 64 MiB request from the top
    of its heap, pages an earlier tensor wrote (any bits, NaN among them), once frees have
    raised its trim threshold.
    """
    element = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(size) * element
    if device.type != "cpu" or nbytes < LAZY_ZERO_BYTES:
        return torch.zeros(size, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(size)  # the tensor keeps the mapping
