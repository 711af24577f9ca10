"""The weights moved into transparent huge pages (forward/huge_pages.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from streaming_backend.forward import convert, huge_pages, llama
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import load_model

MADVISE = huge_pages.thp_mode() == "madvise"


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_thp_mode_reads_the_bracketed_setting(tmp_path):
    """The kernel's setting is the bracketed word; a missing file means none is available."""
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(setting) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert huge_pages.thp_mode(setting) == "always"
    assert huge_pages.thp_mode(tmp_path / "missing") == "absent"


def test_an_arena_is_asked_for_in_huge_pages_from_a_huge_page_boundary():
    """The buffer's span from its 2 MiB boundary is madvised (VmFlags "hg") before any write."""
    buffer, start = huge_pages.empty(3 * huge_pages.HUGE_PAGE)
    address = buffer.data_ptr() + start
    assert address % huge_pages.HUGE_PAGE == 0
    assert buffer.numel() - start >= 3 * huge_pages.HUGE_PAGE
    assert "hg" in vm_flags(address)
    assert "hg" in vm_flags(address + 3 * huge_pages.HUGE_PAGE - 1)


@pytest.mark.skipif(not MADVISE, reason="the kernel does not give huge pages on request")
def test_placed_tensors_keep_their_identity_values_and_views():
    """Each tensor keeps its object, dtype, shape, strides and values; views of one storage
    stay views of one another; `along` tensors move only with a storage being moved."""
    torch.manual_seed(0)
    big = torch.randn(1024, 1024, dtype=torch.bfloat16)  # 2 MiB
    column = big[:, 3]  # a strided view of it
    steps = torch.rand(1000, dtype=torch.float16)
    packed = torch.randint(0, 255, (777, 33), dtype=torch.uint8)
    shared = big.detach()  # a parameter's view of it, passed only along
    other = torch.randn(100)  # passed only along, viewing nothing placed
    expected = [t.clone() for t in (big, column, steps, packed, other)]
    other_address = other.data_ptr()
    placed = huge_pages.place([big, column, steps, packed], along=[shared, other])
    assert placed >= big.numel() * 2 + steps.numel() * 2 + packed.numel()
    for tensor, values in zip((big, column, steps, packed, other), expected):
        assert torch.equal(tensor, values) and tensor.dtype == values.dtype
    assert column.stride() == (1024,) and column.data_ptr() == big.data_ptr() + 3 * 2
    assert shared.data_ptr() == big.data_ptr()
    assert other.data_ptr() == other_address
    addresses = [t.data_ptr() for t in (big, steps, packed)]
    assert all(address % huge_pages.ALIGN == 0 for address in addresses)
    assert max(addresses) - min(addresses) < placed  # one arena
    assert "hg" in vm_flags(big.data_ptr())


def test_too_little_to_fill_a_huge_page_is_left_where_it_is():
    """Below `minimum` bytes nothing moves and 0 is returned."""
    small = torch.ones(1000)
    address = small.data_ptr()
    assert huge_pages.place([small]) == 0
    assert small.data_ptr() == address


@pytest.mark.skipif(not MADVISE, reason="the kernel does not give huge pages on request")
@pytest.mark.parametrize("kind", ["none", "int4"])
def test_the_forward_gives_the_same_bits_from_weights_in_huge_pages(
    tiny_model_dir, kind, monkeypatch
):
    """What a step reads moves into one arena, and prefill and decode give the logits of the
    weights left where they were, to the bit (unquantized, the loaded model's parameters move
    with them, since ours view theirs)."""
    monkeypatch.setattr(
        llama, "place_in_huge_pages", functools.partial(huge_pages.place, minimum=0)
    )
    loaded = load_model(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    logits = {}
    for huge in (False, True):
        config = ForwardConfig(
            CacheBudget(bytes=16 << 20), max_len=64, max_slots=2, quantize=kind, huge_pages=huge
        )
        forward = SlotForward.create(loaded, config)
        model = forward.model
        assert (model.huge_page_bytes > 0) == huge
        slots = [forward.cache.allocate() for _ in range(2)]
        steps = [forward.prefill([PromptChunk(slots[0], [5, 6, 7]), PromptChunk(slots[1], [9])])]
        for step in range(3):
            steps.append(forward.decode(slots, [20 + step, 30 + step]))
        logits[huge] = torch.stack(steps).float()
    weights = [model.head, *(w for block in model.blocks for w in block.weights())]
    addresses = [t.data_ptr() for t in convert.all_tensors(weights)]
    assert max(addresses) - min(addresses) < model.huge_page_bytes
    if kind == "none":
        assert loaded.model.lm_head.weight.data_ptr() in addresses
    assert torch.equal(logits[True], logits[False])
