"""The slot KV cache: sized from a memory budget, slots handed out and given back."""

from __future__ import annotations

import pytest
import torch

from streaming_backend.forward.buckets import batch_buckets, batch_for, window_buckets, window_for
from streaming_backend.forward.llama import NO_WINDOW, LlamaShape
from streaming_backend.forward.slots import CacheBudget, CacheTooSmall, SlotCache, slot_bytes

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
    assert cache.k.shape == (2, 5, 2, 128, 16) and cache.v.shape == cache.k.shape
    capped = SlotCache.for_budget(
        SHAPE, 128, torch.float32, CPU, CacheBudget(bytes=5 * per_slot), max_slots=2
    )
    assert capped.slots == 2


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
