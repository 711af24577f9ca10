"""The slot KV cache: sized from a memory budget, slots handed out and given back; sliding-window
layers in rings, counted as such, and the rule for reusing a slot whose rings have wrapped."""

from __future__ import annotations

import pytest
import torch

from streaming_backend.forward.buckets import batch_buckets, batch_for, window_buckets, window_for
from streaming_backend.forward.family import NO_WINDOW, LlamaShape
from streaming_backend.forward.slots import (
    WINDOW_CHUNK,
    CacheBudget,
    CacheTooSmall,
    SlotCache,
    draft_slots_for_budget,
    layer_rows,
    slot_bytes,
    slots_for_budget,
)

SHAPE = LlamaShape(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    vocab=100,
    max_positions=256,
    eps=1e-5,
    windows=(NO_WINDOW, NO_WINDOW),
)
CPU = torch.device("cpu")


def test_slot_bytes_counts_keys_and_values_of_every_layer():
    """One slot: 2 (K, V) x layers x kv_heads x positions x head_dim x element size."""
    assert slot_bytes(SHAPE, 128, torch.bfloat16) == 2 * 2 * 2 * 128 * 16 * 2


def test_budget_sets_the_number_of_slots_and_one_scratch_slot():
    """A budget of 5 slots' bytes gives 4 slots plus the scratch slot, allocated up front."""
    per_slot = slot_bytes(SHAPE, 128, torch.float32)
    cache = SlotCache.for_budget(SHAPE, 128, torch.float32, CPU, CacheBudget(bytes=5 * per_slot))
    assert cache.slots == 4 and cache.scratch == 4
    assert [k.shape for k in cache.k] == [(5, 2, 128, 16)] * 2
    assert [v.shape for v in cache.v] == [(5, 2, 128, 16)] * 2
    assert cache.bytes == 5 * per_slot
    capped = SlotCache.for_budget(
        SHAPE, 128, torch.float32, CPU, CacheBudget(bytes=5 * per_slot), max_slots=2
    )
    assert capped.slots == 2


@pytest.mark.parametrize(
    "budget, slots",
    [
        (1000 * 30, 8),  # room to spare: one draft slot a stream, the model keeps the rest
        (9 * 100 + 9 * 30, 8),  # just enough for 8 slots each (and the scratch slots)
        (9 * 100 + 9 * 30 - 1, 7),  # a byte short: one pair fewer
        (3 * 130, 2),  # little: as many draft slots as the model gets
        (2 * 130, 1),
    ],
)
def test_a_draft_models_slots_share_the_budget(budget, slots):
    """A draft model's cache (slots of 30 bytes here) beside the model's (100 bytes a slot)
    within one budget: a draft slot for each model slot, at most one a stream (8), each cache's
    scratch slot counted; what is left the model's, never less than the draft's slots."""
    got = draft_slots_for_budget(budget, 100, 30, 8)
    assert got == slots
    left = budget - (got + 1) * 30
    assert left // 100 - 1 >= got


def test_a_budget_too_small_for_a_slot_beside_the_drafts_is_a_clear_error():
    """Not one slot of each fits (with their scratch slots): the error names the draft model."""
    with pytest.raises(CacheTooSmall, match="no full-context slot beside the draft model's"):
        draft_slots_for_budget(2 * 130 - 1, 100, 30, 8)


def test_budget_too_small_for_one_full_context_slot_is_a_clear_error():
    """When not even one full-context slot fits, the error names the sizes involved."""
    per_slot = slot_bytes(SHAPE, 128, torch.float32)
    with pytest.raises(CacheTooSmall, match="holds no full-context slot.*128 positions"):
        SlotCache.for_budget(SHAPE, 128, torch.float32, CPU, CacheBudget(bytes=per_slot))


def test_budget_as_a_fraction_of_free_memory():
    """A fraction is of the memory free now; both forms at once, or neither, are refused."""
    cache = SlotCache.for_budget(SHAPE, 128, torch.float32, CPU, CacheBudget(fraction=0.001))
    assert cache.slots >= 1
    for bad in ({}, {"bytes": 1, "fraction": 0.5}, {"fraction": 1.5}, {"bytes": 0}):
        with pytest.raises(ValueError):
            CacheBudget(**bad)


def test_slots_are_handed_out_lowest_first_and_reused():
    """allocate takes the lowest free slot; free gives it back with its length reset."""
    cache = SlotCache(SHAPE, 3, 64, torch.float32, CPU)
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(IndexError, match="every KV cache slot"):
        cache.allocate()
    cache.lengths[1] = 40
    cache.free(1)
    assert cache.free_slots == 1 and cache.allocate() == 1 and cache.lengths[1] == 0
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(3)  # the scratch slot is never handed out
    cache.free(2)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(2)


def test_check_room_refuses_positions_past_the_context():
    """A slot holds at most max_len positions."""
    cache = SlotCache(SHAPE, 1, 64, torch.float32, CPU)
    slot = cache.allocate()
    cache.lengths[slot] = 60
    cache.check_room(slot, 4)
    with pytest.raises(ValueError, match="context of 64"):
        cache.check_room(slot, 5)


def test_buckets_are_powers_of_two_capped_by_the_cache():
    """Windows and batch sizes come from a short list of shapes."""
    assert [window_for(n, 300) for n in (1, 64, 65, 200, 300)] == [64, 64, 128, 256, 300]
    assert window_buckets(300) == [64, 128, 256, 300]
    assert batch_buckets(12) == [1, 2, 4, 8, 12] and batch_buckets(1) == [1]
    assert [batch_for(b, [1, 2, 4, 8, 12]) for b in (1, 3, 8, 9, 12)] == [1, 4, 8, 12, 12]


# Gemma 3 1B's shape: 26 layers, every sixth of full attention, the others in windows of 512;
# one key/value head of 256 values
GEMMA3 = LlamaShape(
    layers=26,
    hidden=1152,
    heads=4,
    kv_heads=1,
    head_dim=256,
    vocab=262144,
    max_positions=32768,
    eps=1e-6,
    windows=tuple(NO_WINDOW if layer % 6 == 5 else 512 for layer in range(26)),
)


def test_sliding_window_layers_keep_their_window_and_a_chunk():
    """A sliding-window layer keeps window + chunk - 1 positions (a prefill call's first token
    still sees its window while the call writes its last), full layers the whole context, and
    a ring no shorter than the context is no ring."""
    assert layer_rows(GEMMA3, 32768)[:6] == (1023, 1023, 1023, 1023, 1023, 32768)
    assert WINDOW_CHUNK == 512 and layer_rows(GEMMA3, 32768, chunk=8)[0] == 519
    assert layer_rows(GEMMA3, 600)[:6] == (600,) * 6
    with pytest.raises(ValueError, match="at least one position"):
        layer_rows(GEMMA3, 600, chunk=0)


def test_rings_are_counted_so_a_budget_holds_more_slots():
    """Gemma 3 1B at 32k positions in bfloat16: 4 full layers and 22 rings of 1023 per slot,
    150 MiB instead of 832 MiB, so 8 GiB holds 53 slots instead of 8; the cache allocated
    takes exactly what was counted, and reports it (the log line, /status)."""
    full = 2 * 26 * 32768 * 256 * 2  # keys and values of every layer, every position
    per_slot = slot_bytes(GEMMA3, 32768, torch.bfloat16)
    assert per_slot == 2 * (4 * 32768 + 22 * 1023) * 256 * 2 and full / per_slot > 5.5
    flat = LlamaShape(**{**GEMMA3.__dict__, "windows": (NO_WINDOW,) * 26})
    assert slot_bytes(flat, 32768, torch.bfloat16) == full
    assert slots_for_budget(flat, 32768, torch.bfloat16, 8 << 30) == 8
    assert slots_for_budget(GEMMA3, 32768, torch.bfloat16, 8 << 30) == 53
    small = SlotCache(GEMMA3, 3, 2048, torch.bfloat16, CPU, chunk=64)
    assert small.bytes == 4 * slot_bytes(GEMMA3, 2048, torch.bfloat16, chunk=64)
    assert small.slot_bytes == slot_bytes(GEMMA3, 2048, torch.bfloat16, chunk=64)
    assert [k.shape[2] for k in small.k[:6]] == [575] * 5 + [2048]
    assert "22 of 26 layers sliding-window rings of 575" in small.describe_rings()
    assert small.report() == {
        "slots": 3,
        "positions": 2048,
        "dtype": "bfloat16",
        "bytes": small.bytes,
        "ring_layers": 22,
        "ring_rows": [575],
    }
    assert SlotCache(SHAPE, 1, 64, torch.float32, CPU).describe_rings() == ""


WINDOWED = LlamaShape(**{**SHAPE.__dict__, "windows": (4, NO_WINDOW)})


def test_a_wrapped_ring_allows_only_the_prefixes_whose_window_it_still_holds():
    """Window 4, chunk 2: a ring of 5 holds the last 5 positions written. A slot holding 12
    can be continued from 10, 11 or 12 (the 3 positions before each are still there), not from
    9 or less: reusable says 0, truncate and copy_prefix refuse. Before its ring wraps a slot
    is reusable at every length; so is a slot without rings."""
    cache = SlotCache(WINDOWED, 3, 64, torch.float32, CPU, chunk=2)
    assert cache.rows == (5, 64) and cache.chunk_limit == 2
    slot, other = cache.allocate(), cache.allocate()
    cache.lengths[slot] = 12
    assert [cache.reusable(slot, n) for n in (12, 11, 10, 9, 3, 0)] == [12, 11, 10, 0, 0, 0]
    with pytest.raises(ValueError, match="no longer hold the window before position 9"):
        cache.copy_prefix(slot, other, 9)
    with pytest.raises(ValueError, match="no longer hold the window before position 9"):
        cache.truncate(slot, 9)
    with pytest.raises(ValueError, match="holds 12 positions, not 13"):
        cache.reusable(slot, 13)
    cache.copy_prefix(slot, other, 12)  # a beam fork: the whole slot
    assert cache.lengths[other] == 12 and cache.reusable(other, 10) == 10
    cache.truncate(slot, 10)
    cache.truncate(slot, 0)
    cache.lengths[slot] = 5  # not wrapped yet
    assert [cache.reusable(slot, n) for n in (5, 1)] == [5, 1]
    plain = SlotCache(SHAPE, 1, 64, torch.float32, CPU, chunk=2)
    plain.lengths[plain.allocate()] = 60
    assert plain.reusable(0, 1) == 1 and plain.chunk_limit is None


def test_copy_prefix_copies_a_rings_rows_and_the_full_layers_prefix():
    """copy_prefix gives the target what the source's rows hold: a wrapped ring whole, the
    full-attention layer's first positions."""
    cache = SlotCache(WINDOWED, 2, 64, torch.float32, CPU, chunk=2)
    source, target = cache.allocate(), cache.allocate()
    for k in cache.k:
        k[source] = torch.arange(k[source].numel(), dtype=torch.float32).view(k[source].shape)
    cache.lengths[source] = 12
    cache.copy_prefix(source, target, 11)
    assert torch.equal(cache.k[0][target], cache.k[0][source])  # the ring, all 5 rows
    assert torch.equal(cache.k[1][target, :, :11], cache.k[1][source, :, :11])
    assert not cache.k[1][target, :, 11:].any()


# In a fresh interpreter: make glibc's heap hold ~100 MiB of freed pages full of NaN bits (a
# freed 16 MiB mapping raises its mmap threshold, so 1 MiB tensors come from the heap, and a live
# one above them keeps the span from being trimmed), show that torch.empty(64 MiB) then returns
# those pages, and build a 64 MiB cache there.
DIRTY_HEAP = """
import ctypes, json, sys, torch
libc = ctypes.CDLL("libc.so.6")
# glibc's state after a large block was freed, set outright: blocks of up to 32 MiB come from the
# heap, and its freed memory stays (how far glibc raised these by itself varied with the start-up)
assert libc.mallopt(-3, 32 * 2**20) == 1  # M_MMAP_THRESHOLD
assert libc.mallopt(-1, 2**30) == 1  # M_TRIM_THRESHOLD
from streaming_backend.forward.slots import SlotCache
from streaming_backend.model.memory import Footprint
from streaming_backend.forward.family import LlamaShape
SHAPE = eval(sys.argv[1])  # the test's LlamaShape, as its repr
MIB = 2**20
nans = [torch.full((MIB // 4,), float("nan")) for _ in range(100)]
above = torch.empty(MIB, dtype=torch.uint8)
del nans
dirty = torch.empty(64 * MIB, dtype=torch.uint8)
seen = {"empty_resident": Footprint.of([dirty]).resident, "empty_zero": bool((dirty == 0).all())}
del dirty
cache = SlotCache(SHAPE, 1023, 256, torch.float32, torch.device("cpu"))
stores = [*cache.k, *cache.v]
seen["cache_bytes"] = Footprint.of(stores).reserved
seen["cache_resident"] = Footprint.of(stores).resident
seen["cache_zero"] = all(bool((t == 0).all()) for t in stores)
print(json.dumps(seen))
"""


def test_a_large_cache_is_zero_pages_even_where_the_heap_holds_freed_nans():
    """A large CPU cache is the OS's zero pages: unresident until written, and zeros, even where
    torch.empty would hand out pages an earlier tensor filled with NaN (masked positions are read
    by attention, so garbage there would poison every row's output)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    run = subprocess.run(
        [sys.executable, "-c", DIRTY_HEAP, repr(SHAPE)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.splitlines()[-1])
    assert seen["empty_resident"] >= 60 * 2**20 and not seen["empty_zero"]  # the trap is set
    assert seen["cache_bytes"] >= 64 * 2**20
    assert seen["cache_resident"] < 2**20 and seen["cache_zero"]
