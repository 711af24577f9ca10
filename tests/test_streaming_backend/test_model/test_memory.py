"""What a model's tensors cost the host: reserved, resident, shared (model/memory.py)."""

from __future__ import annotations

import mmap

import torch

from streaming_backend.forward.weight_file import read_tree, write_tree
from streaming_backend.model.memory import Footprint

MIB = 2**20


def test_a_large_allocation_is_resident_as_it_is_written():
    """64 MiB of a fresh anonymous mapping are reserved, not resident; writing half makes half
    resident. Views of one storage count once. (torch.empty is not always a fresh mapping: glibc
    may hand out freed heap pages, test_forward_slots.py)"""
    pages = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(pages, dtype=torch.uint8)
    before = Footprint.of([buffer, buffer[:MIB], buffer[5:]])
    assert before.reserved == 64 * MIB and before.resident < 4 * MIB
    buffer[: 32 * MIB].fill_(1)
    after = Footprint.of([buffer])
    assert 32 * MIB <= after.resident < 36 * MIB
    assert after.shared == 0 and after.private == after.reserved


def test_a_weight_files_tensors_are_shared_and_the_rest_private(tmp_path):
    """Tensors mapped from a weight file count as shared (its pages), others as private."""
    write_tree(tmp_path / "w", [torch.ones(MIB), torch.zeros(MIB)], {})
    mapped, _ = read_tree(tmp_path / "w", [])
    own = torch.ones(MIB)
    footprint = Footprint.of([*mapped, own])
    assert footprint.shared == mapped[0].untyped_storage().nbytes() >= 8 * MIB
    assert footprint.private == 4 * MIB and footprint.reserved == footprint.shared + 4 * MIB
