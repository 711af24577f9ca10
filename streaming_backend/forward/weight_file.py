"""A tree of tensors in one file: written once, atomically, then mapped read-only by its readers.

    write_tree(path, tree, meta)           # a temporary file beside it, fsynced, then renamed
    tree, meta = read_tree(path, types)    # every tensor a view of one read-only mapping

    with TreeWriter(path) as writer:       # a tree too large to hold whole: written as it comes
        block = writer.put(block)          # its tensors written now, each replaced by a Stored
        writer.finish(tree, meta)          # tree: Stored leaves (and tensors not put yet)

The tree is tuples, lists, NamedTuples and dataclasses (of `types` when read back) with tensors,
None, booleans, numbers and strings at its leaves. Each tensor is named by its path in the tree
("blocks.3.qkv.packed": field qkv of item 3 of field blocks) and stored once however often it
appears, contiguous and at a page boundary. A reader's tensors view the file's pages in the page
cache: every process that maps the file shares them, none can write them, and on kernels that
keep large folios for the file (ext4 on Linux 6.x) they are mapped in huge pages. Only pages read
in through the mapping come in huge folios (MADV_HUGEPAGE): those a write leaves in the page
cache are 4 KiB ones, and a file mapped right after it was written was read from them (none of
it in huge pages; one stream's step of the default model 0.94x). So the writer lets its pages go
once they are on disk (POSIX_FADV_DONTNEED), and the first reader's mapping reads them back.

A TreeWriter writes the tensors to a temporary file as they are put, in that order, and at
`finish` the header, then those bytes after it, into the file renamed to `path`: a caller
deriving a tree piece by piece holds one piece at a time. write_tree puts a whole tree at once
(its tensors in the order of the tree).

Layout: MAGIC, the header's length (8 bytes, little-endian), the header (JSON: the tree, each
tensor's dtype, shape and offset, the tensors' bytes, the caller's `meta`), zeros up to a page
boundary, the tensors. A file of another length than its header says (the rename makes that
rare: a disk error, a copy cut short) raises WeightFileError, never gives short tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch

from streaming_backend.forward import huge_pages

MAGIC = b"tokenstream-weights\n"
PAGE = 4096  # each tensor's start in the file: a page, so any dtype and cache line fits
HEADER_KEYS = {"tree", "tensors", "bytes", "meta"}
COPY_CHUNK = 1 << 20  # bytes a finish copies at once: the tensors go through the page cache


class WeightFileError(ValueError):
    """The file is not a whole weight file of this format."""


class Stored(NamedTuple):
    """A tensor a TreeWriter has written: its dtype, shape and place among the tensors' bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def write_tree(path: Path, tree: Any, meta: dict[str, Any]) -> int:
    """Write `tree` and `meta` (JSON values) to `path` as a new file that appears whole or not
    at all: written to a temporary file in the same folder, fsynced, renamed over `path`, the
    folder fsynced. Returns the bytes written."""
    with TreeWriter(path) as writer:
        return writer.finish(tree, meta)


class TreeWriter:
    """A weight file written piece by piece (see the module docstring); leaving the block
    without `finish` (an error) removes what it wrote, and a process killed midway leaves only
    temporary files (.NAME.PID.*tmp beside `path`), never a file at `path`."""

    def __init__(self, path: Path):
        self.path = path
        self._tensors = path.with_name(f".{path.name}.{os.getpid()}.tensors.tmp")
        self._file: BinaryIO | None = None
        self._end = 0  # the tensors' bytes so far, each tensor's padding to a page included

    def __enter__(self) -> TreeWriter:
        self._tensors.unlink(missing_ok=True)  # a killed write's, whose process id came back
        self._file = self._tensors.open("xb")
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()
        self._tensors.unlink(missing_ok=True)

    def put(self, tree: Any) -> Any:
        """`tree` with each tensor written now and replaced by its Stored (a view already
        written in this call, by the same memory, shape and strides, written once)."""
        return _stored(tree, "", self._write, {})

    def finish(self, tree: Any, meta: dict[str, Any]) -> int:
        """Write the file: the header of `tree` (its tensors put first) and `meta`, then every
        tensor put; fsynced and renamed to `path`, the folder fsynced. Returns its bytes."""
        tree = self.put(tree)
        layout: dict[str, list] = {}
        encoded = _encode(tree, "", layout, {})
        header = json.dumps({"tree": encoded, "tensors": layout, "bytes": self._end, "meta": meta})
        header = header.encode()
        start = _page_up(len(MAGIC) + 8 + len(header))
        self._file.truncate(self._end)  # the last tensor's padding
        self._file.flush()
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        temporary.unlink(missing_ok=True)
        try:
            with temporary.open("xb") as f, self._tensors.open("rb") as tensors:
                f.write(MAGIC + len(header).to_bytes(8, "little") + header)
                f.seek(start)
                shutil.copyfileobj(tensors, f, COPY_CHUNK)
                f.truncate(start + self._end)  # the file's length says it is whole
                f.flush()
                os.fsync(f.fileno())
                _drop_cached(f.fileno())
            os.replace(temporary, self.path)
        finally:
            temporary.unlink(missing_ok=True)
        _fsync_folder(self.path.parent)
        return start + self._end

    def _write(self, tensor: torch.Tensor) -> Stored:
        """Append one tensor's bytes at the next page boundary."""
        stored = Stored(tensor.dtype, tuple(tensor.shape), self._end)
        self._file.seek(self._end)
        self._file.write(_bytes(tensor))
        self._end += _page_up(tensor.numel() * tensor.element_size())
        return stored


def _drop_cached(fd: int) -> None:
    """Let a file's pages, written and on disk, go from the page cache, so that a mapping reads
    them back in huge folios (see the module docstring); where the call is missing, keep them."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_meta(path: Path) -> dict[str, Any]:
    """A weight file's meta, from its header alone; WeightFileError if it is not one."""
    with path.open("rb") as f:
        return _header(f, path)[0]["meta"]


def read_tree(path: Path, types: Iterable[type]) -> tuple[Any, dict[str, Any]]:
    """The tree and meta of a weight file, every tensor a view of one read-only mapping of it
    (kept open while any of them lives); `types`: the NamedTuple and dataclass types it holds.
    WeightFileError if the file is not whole or names a type not given."""
    with path.open("rb") as f:
        header, length = _header(f, path)
        start = _page_up(len(MAGIC) + 8 + length)
        size = os.fstat(f.fileno()).st_size
        if size != start + header["bytes"]:  # the tensors' bytes, their padding included
            raise WeightFileError(f"{path} holds {size} bytes, not {start + header['bytes']}")
        mapped = huge_pages.map_file(f.fileno())
    with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is meant to be
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping open
    tensors = {}
    for name, (dtype, shape, offset) in header["tensors"].items():
        kind = getattr(torch, dtype)
        count = torch.Size(shape).numel() * torch.empty((), dtype=kind).element_size()
        tensors[name] = whole[start + offset : start + offset + count].view(kind).view(shape)
    by_name = {t.__name__: t for t in types}
    return _decode(header["tree"], tensors, by_name), header["meta"]


def _header(f: BinaryIO, path: Path) -> tuple[dict[str, Any], int]:
    """The header of the weight file open as `f` and its length in bytes."""
    if f.read(len(MAGIC)) != MAGIC:
        raise WeightFileError(f"{path} is not a weight file")
    length = int.from_bytes(f.read(8), "little")
    try:
        header = json.loads(f.read(length))
    except ValueError as exc:
        raise WeightFileError(f"{path}: its header does not read ({exc})") from None
    if not isinstance(header, dict) or not HEADER_KEYS <= set(header):
        raise WeightFileError(f"{path}: its header has not {', '.join(sorted(HEADER_KEYS))}")
    return header, length


def _stored(value: Any, name: str, write, seen: dict) -> Any:
    """`value` with each tensor replaced by write(tensor) (a view already written, by the same
    memory, shape and strides, by the same Stored); TypeError naming a leaf that cannot be
    stored."""
    if isinstance(value, torch.Tensor):
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.dtype,
               tuple(value.shape), value.stride())  # fmt: skip
        if key not in seen:
            seen[key] = write(value)
        return seen[key]
    if isinstance(value, Stored) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    fields = _fields(value)
    if fields is not None:
        parts = {f: _stored(getattr(value, f), _join(name, f), write, seen) for f in fields}
        return type(value)(**parts)
    if isinstance(value, (tuple, list)):
        items = [_stored(v, _join(name, str(i)), write, seen) for i, v in enumerate(value)]
        return type(value)(items)
    raise TypeError(f"{name or 'the tree'}: a {type(value).__name__} cannot be stored")


def _encode(value: Any, name: str, layout: dict, names: dict) -> Any:
    """A tree of Stored leaves as JSON, each Stored added to `layout` under the name of its
    first place in the tree."""
    if isinstance(value, Stored):
        if value not in names:
            names[value] = name
            dtype = str(value.dtype).removeprefix("torch.")
            layout[name] = [dtype, list(value.shape), value.offset]
        return {"tensor": names[value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    fields = _fields(value)
    if fields is not None:
        parts = {f: _encode(getattr(value, f), _join(name, f), layout, names) for f in fields}
        return {"type": type(value).__name__, "fields": parts}
    items = [_encode(v, _join(name, str(i)), layout, names) for i, v in enumerate(value)]
    return {type(value).__name__: items}


def _fields(value: Any) -> list[str] | None:
    """The field names of a NamedTuple or dataclass; None for any other value."""
    if hasattr(value, "_fields"):
        return list(value._fields)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [f.name for f in dataclasses.fields(value)]
    return None


def _decode(value: Any, tensors: dict[str, torch.Tensor], types: dict[str, type]) -> Any:
    """The inverse of _encode."""
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        return tensors[value["tensor"]]
    if "type" in value:
        kind = types.get(value["type"])
        if kind is None:
            raise WeightFileError(f"the file holds a {value['type']}, not one of {sorted(types)}")
        fields = {k: _decode(v, tensors, types) for k, v in value["fields"].items()}
        try:
            return kind(**fields)
        except TypeError as exc:  # the type's fields changed since the file was written
            raise WeightFileError(f"a {value['type']} of other fields: {exc}") from None
    [(kind, items)] = value.items()  # {"tuple": [...]} or {"list": [...]}
    decoded = [_decode(v, tensors, types) for v in items]
    return tuple(decoded) if kind == "tuple" else decoded


def _join(name: str, part: str) -> str:
    return f"{name}.{part}" if name else part


def _page_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes, contiguous, on the host (any dtype, bfloat16 included)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
