"""A tree of tensors in one file, written atomically, mapped read-only (forward/weight_file.py)."""

from __future__ import annotations

import dataclasses
import mmap
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from streaming_backend.forward.weight_file import (
    MAGIC,
    PAGE,
    Stored,
    TreeWriter,
    WeightFileError,
    read_tree,
    write_tree,
)


class Pair(NamedTuple):
    packed: torch.Tensor
    scales: torch.Tensor | None
    out: int


@dataclasses.dataclass(frozen=True)
class Sizes:
    rows: int
    windows: tuple[int, ...]
    eps: float


def a_tree() -> tuple:
    """Every kind of node and leaf the compact weights have, a view shared by two places."""
    torch.manual_seed(0)
    shared = torch.randn(6, 8).to(torch.bfloat16)
    return (
        Sizes(3, (4, 1 << 62), 1e-5),
        [Pair(torch.randint(0, 255, (4, 16), dtype=torch.uint8), None, 3), Pair(shared, shared, 6)],
        "int4",
        (shared[2:4], torch.arange(5, dtype=torch.int64), torch.tensor(2.5)),
        float("inf"),
        None,
        True,
    )


def mapped_ranges(path: Path) -> list[tuple[int, int, str]]:
    """This process's mappings of `path`: (start, end, permissions)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end, fields[1]))
    return ranges


def test_a_tree_comes_back_equal_in_views_of_one_read_only_mapping(tmp_path):
    """Every node and leaf comes back with its type and value; each tensor views a read-only
    mapping of the file at a page boundary, and a view that two places hold is stored once."""
    tree, path = a_tree(), tmp_path / "w"
    write_tree(path, tree, {"weights_digest": "abc"})
    back, meta = read_tree(path, [Pair, Sizes])
    assert meta == {"weights_digest": "abc"}
    assert back[0] == tree[0] and back[2] == "int4" and back[4:] == (float("inf"), None, True)
    assert isinstance(back[1], list) and isinstance(back[1][1], Pair) and back[1][0].out == 3
    pairs = zip(torch.utils._pytree.tree_leaves(tree), torch.utils._pytree.tree_leaves(back))
    for written, read in pairs:
        if isinstance(written, torch.Tensor):
            assert read.dtype == written.dtype and torch.equal(read, written)
    [(start, end, permissions)] = mapped_ranges(path)
    assert permissions.startswith("r-")
    tensors = [back[1][0].packed, back[1][1].packed, back[3][0], back[3][1], back[3][2]]
    assert all(start <= t.data_ptr() < end and t.data_ptr() % PAGE == 0 for t in tensors)
    assert back[1][1].packed.data_ptr() == back[1][1].scales.data_ptr()  # one entry
    assert back[3][0].data_ptr() != back[1][1].packed.data_ptr()  # another view: its own


def test_a_tree_written_piece_by_piece_reads_back_as_written_whole(tmp_path):
    """Parts put one at a time (each tensor written at once, replaced by a Stored), then the
    tree of them finished: the same tree, tensors and meta as write_tree of the whole tree,
    in a file of the same size; a view two places of one part hold is stored once."""
    tree = a_tree()
    with TreeWriter(tmp_path / "w") as writer:
        sizes, pairs = writer.put(tree[0]), writer.put(tree[1])
        assert isinstance(pairs[1].packed, Stored) and pairs[1].packed == pairs[1].scales
        assert len(list(tmp_path.iterdir())) == 1  # the tensors' temporary file, nothing at w
        size = writer.finish((sizes, pairs, *tree[2:]), {"weights_digest": "abc"})
    assert [p.name for p in tmp_path.iterdir()] == ["w"]  # the temporary files gone
    assert size == write_tree(tmp_path / "whole", tree, {"weights_digest": "abc"})
    back, meta = read_tree(tmp_path / "w", [Pair, Sizes])
    whole, _ = read_tree(tmp_path / "whole", [Pair, Sizes])
    assert meta == {"weights_digest": "abc"} and back[0] == tree[0] and back[2:3] == tree[2:3]
    leaves = zip(torch.utils._pytree.tree_leaves(back), torch.utils._pytree.tree_leaves(whole))
    for piecewise, at_once in leaves:
        if isinstance(at_once, torch.Tensor):
            assert piecewise.dtype == at_once.dtype and torch.equal(piecewise, at_once)
        else:
            assert piecewise == at_once
    assert back[1][1].packed.data_ptr() == back[1][1].scales.data_ptr()


def test_a_writer_left_without_finishing_leaves_nothing(tmp_path):
    """An error between two parts: no file at the path, no temporary file."""
    with pytest.raises(RuntimeError), TreeWriter(tmp_path / "w") as writer:
        writer.put([torch.ones(4096)])
        raise RuntimeError("the conversion failed")
    assert not list(tmp_path.iterdir())


def test_the_mapping_outlives_the_tree_until_its_last_tensor(tmp_path):
    """The file stays mapped while one of its tensors lives, and only so long."""
    path = tmp_path / "w"
    write_tree(path, a_tree(), {})
    back, _ = read_tree(path, [Pair, Sizes])
    kept = back[1][1].packed
    expected = kept.clone()
    del back
    assert mapped_ranges(path) and torch.equal(kept, expected)
    del kept
    assert not mapped_ranges(path)


@pytest.mark.parametrize("cut", [1, PAGE, 10_000])
def test_a_file_cut_short_is_refused(tmp_path, cut):
    """A file shorter than its header says (bytes lost at its end) raises WeightFileError."""
    path = tmp_path / "w"
    size = write_tree(path, a_tree(), {})
    os.truncate(path, size - cut)
    with pytest.raises(WeightFileError):
        read_tree(path, [Pair, Sizes])


NOT_ONE = [b"", b"garbage", MAGIC + b"\x05\0\0\0\0\0\0\0{nope", MAGIC + b"\x02" + bytes(7) + b"[]"]


@pytest.mark.parametrize("content", NOT_ONE)
def test_a_file_that_is_not_one_is_refused(tmp_path, content):
    """Another file, an empty one, one whose header does not read: WeightFileError."""
    path = tmp_path / "w"
    path.write_bytes(content)
    with pytest.raises(WeightFileError):
        read_tree(path, [Pair, Sizes])


def test_a_type_not_given_or_of_other_fields_is_refused(tmp_path):
    """A reader that does not know a type the file holds, or knows it with other fields (the
    code changed since), gets WeightFileError, not a wrong tree."""
    path = tmp_path / "w"
    write_tree(path, a_tree(), {})
    with pytest.raises(WeightFileError, match="Pair"):
        read_tree(path, [Sizes])

    class Pair(NamedTuple):  # noqa: F811 - the same name, a field more without a default
        packed: torch.Tensor
        scales: torch.Tensor | None
        out: int
        steps: torch.Tensor

    with pytest.raises(WeightFileError, match="other fields"):
        read_tree(path, [Pair, Sizes])


def test_what_cannot_be_stored_is_refused_by_name(tmp_path):
    """A leaf of another kind raises TypeError naming its place; nothing is written."""
    with pytest.raises(TypeError, match="1.scales"):
        write_tree(tmp_path / "w", (1, Pair(torch.zeros(2), {"a": 1}, 2)), {})
    assert not list(tmp_path.iterdir())


KILLED_WRITER = """
import os, signal, sys, torch
from pathlib import Path
from streaming_backend.forward import weight_file

written = []
real = weight_file._bytes

def bytes_then_die(tensor):
    if written:  # the second tensor: die with the first one on disk
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(1)
    return real(tensor)

weight_file._bytes = bytes_then_die
weight_file.write_tree(Path(sys.argv[1]), [torch.ones(4096), torch.ones(4096)], {})
"""


def test_a_write_killed_midway_leaves_no_file_at_its_path(tmp_path):
    """A writer killed (SIGKILL) between two tensors leaves its temporary file, never a file at
    the path a reader opens; a later write of the same path succeeds and reads whole."""
    path = tmp_path / "w"
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_WRITER), str(path)])
    assert run.returncode == -signal.SIGKILL
    assert not path.exists()
    assert [p.name.endswith(".tmp") for p in tmp_path.iterdir()] == [True]
    write_tree(path, [torch.ones(4096), torch.ones(4096)], {})
    back, _ = read_tree(path, [])
    assert all(torch.equal(t, torch.ones(4096)) for t in back)


def huge_mapped_kib(path: Path) -> int:
    """KiB of this process's mappings of `path` mapped in huge pages (smaps' FilePmdMapped)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            ours = len(fields) >= 6 and fields[5] == str(path)
        elif ours and fields[0] == "FilePmdMapped:":
            total += int(fields[1])
    return total


def read_all_mapped(path: Path) -> int:
    """Map `path` as a reader maps a weight file (MADV_HUGEPAGE), touch every page; the KiB of
    it mapped in huge pages."""
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapped.madvise(mmap.MADV_HUGEPAGE)
    sum(mapped[i] for i in range(0, len(mapped), PAGE))
    try:
        return huge_mapped_kib(path)
    finally:
        mapped.close()


def huge_from_disk(plain: Path, size: int) -> int:
    """KiB of a file of `size` random bytes, read from disk through a reader's mapping, mapped
    in huge pages; skips the test where the kernel maps no file in huge pages (no large folios
    for this file system, THP off)."""
    plain.write_bytes(os.urandom(size))
    fd = os.open(plain, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    from_disk = read_all_mapped(plain)
    if from_disk == 0:
        pytest.skip("this kernel or file system maps no file in huge pages")
    return from_disk


def test_a_written_file_is_read_back_in_huge_pages(tmp_path):
    """The pages a write leaves in the page cache are small ones where it wrote in pieces, as
    a TreeWriter does: the writer lets them go, so that a reader's mapping reads the file back
    in huge folios. Where the kernel maps no file in huge pages even when read from disk (no
    large folios, THP off), there is nothing to check."""
    size = 16 << 20
    from_disk = huge_from_disk(tmp_path / "plain", size)
    path = tmp_path / "w"
    write_tree(path, [torch.randint(0, 255, (size,), dtype=torch.uint8)], {})
    assert read_all_mapped(path) >= from_disk / 2


def test_a_file_cached_in_small_pages_is_read_again_in_huge_ones(tmp_path, caplog):
    """A weight file whose pages the page cache holds as small folios (here rewritten in place
    in 1 MiB pieces; on a host, read back page by page after a pageout) is let go and read
    again by read_tree, so its mapping is in huge pages as a file read from disk is; the log
    says so. Skipped where the kernel maps no file in huge pages."""
    size = 16 << 20
    from_disk = huge_from_disk(tmp_path / "plain", size)
    path = tmp_path / "w"
    write_tree(path, [torch.randint(0, 255, (size,), dtype=torch.uint8)], {})
    with path.open("r+b") as f:
        data = f.read()
        f.seek(0)
        for at in range(0, len(data), 1 << 20):
            f.write(data[at : at + (1 << 20)])
        f.flush()
        os.fsync(f.fileno())
    assert read_all_mapped(path) < from_disk / 2  # the trap is set: small folios
    with caplog.at_level("INFO", logger="tokenstream.model"):
        back, _ = read_tree(path, [])
    assert huge_mapped_kib(path) >= from_disk / 2
    assert "read again" in caplog.text
    assert torch.equal(back[0], torch.frombuffer(bytearray(data), dtype=torch.uint8)[-size:])
