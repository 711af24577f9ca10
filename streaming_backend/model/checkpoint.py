"""A checkpoint folder's model read a module at a time, for model/weight_cache.py's conversion.

    source = StreamedModel.of(loaded)   # None where its files do not hold its weights by name
    with source.loaded(layer):          # the layer's weights read from the files now,
        ...                             # back on the meta device after
    source.weights_digest()             # numerics.weights_digest's, a tensor at a time

The model is a fresh skeleton of the folder (loading.skeleton), its non-persistent buffers
(RoPE's inverse frequencies, an embedding's scale) computed on the CPU as from_pretrained
computes them (the model's _init_weights), its weights read from the folder's safetensors files
with plain reads into fresh tensors, converted to the model's dtype. No file is mapped: once a
tensor is dropped, nothing of the checkpoint is left in the process. A folder whose files name a
weight otherwise than the model does (transformers renames some on load, as mixtures of experts'
stacked experts) is not streamed; HeldModel serves the conversion a model loaded whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from streaming_backend.model.loading import LoadedModel, skeleton
from streaming_backend.model.numerics import digest_weights, weights_digest

# safetensors' dtype names (its format's header)
DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Entry(NamedTuple):
    """Where a safetensors file holds one tensor."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # its first byte in the file
    end: int


def safetensors_index(folder: Path) -> dict[str, Entry] | None:
    """Every tensor of a folder's safetensors files by name; None where it has none, or
    a tensor of a dtype not in DTYPES."""
    entries = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in DTYPES:
                return None
            begin, end = info["data_offsets"]
            dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
            entries[name] = Entry(path, dtype, shape, 8 + length + begin, 8 + length + end)
    return entries or None


def read(entry: Entry) -> torch.Tensor:
    """A tensor's bytes read from its file into a fresh tensor (little-endian, as the format)."""
    tensor = torch.empty(entry.shape, dtype=entry.dtype)
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    with entry.file.open("rb", buffering=0) as f:
        f.seek(entry.start)
        done = 0
        while done < len(view):
            count = f.readinto(view[done:])
            if not count:
                raise OSError(f"{entry.file} ends inside a tensor")
            done += count
    if done != entry.end - entry.start:
        raise OSError(f"{entry.file}: a tensor of {entry.end - entry.start} bytes, not {done}")
    return tensor


class StreamedModel:
    """A skeleton whose modules' weights are read from its checkpoint's files while needed."""

    def __init__(self, loaded: LoadedModel, model: Any, sources: dict[str, Entry]):
        self.model = model
        self._tokenizer = loaded.tokenizer
        self._sources = sources  # each state dict name: where its tensor lies (a tie's, or its own)
        self._names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}

    @classmethod
    def of(cls, loaded: LoadedModel) -> StreamedModel | None:
        """The streamed model of a skeleton's checkpoint; None where its files do not hold
        every weight of the model under its name (or a tie's) in its shape, or the model keeps
        some modules in float32 whatever the dtype (from_pretrained's rule, not ours)."""
        index = safetensors_index(loaded.checkpoint)
        if index is None:
            return None
        model = skeleton(loaded.checkpoint, loaded.dtype)
        sources = _sources(model, index)
        if sources is None or getattr(model, "_keep_in_fp32_modules", None):
            return None
        _compute_buffers(model)
        return cls(loaded, model, sources)

    @contextmanager
    def loaded(self, *modules: nn.Module) -> Iterator[None]:
        """The modules' weights read in (those of a module loaded already, a tie's, kept);
        each back on the meta device after."""
        try:
            for module in modules:
                for tensor in module.state_dict(keep_vars=True).values():
                    if tensor.is_meta:
                        _swap(tensor, self._read(self._names[id(tensor)], tensor.dtype))
            yield
        finally:
            for module in modules:
                release(module)

    def weights_digest(self) -> str:
        """numerics.weights_digest of the model with its weights, read a tensor at a time (the
        embedding once, for a tied head too)."""
        weight = self.model.get_input_embeddings().weight
        where = self._sources[self._names[id(weight)]]
        embedding = self._read(self._names[id(weight)], weight.dtype)
        tensors = (
            (name, embedding if self._sources[name] == where else self._read(name, t.dtype))
            for name, t in self.model.state_dict(keep_vars=True).items()
        )
        return digest_weights(self.model.config, self._tokenizer, embedding, tensors)

    def _read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor of a state dict name, in `dtype` (as from_pretrained converts it)."""
        return read(self._sources[name]).to(dtype)


class HeldModel:
    """A model loaded whole (LoadedModel with its weights), for a conversion that cannot stream
    it: each module's weights released once derived."""

    def __init__(self, loaded: LoadedModel):
        self.model = loaded.model
        self._loaded = loaded

    @contextmanager
    def loaded(self, *modules: nn.Module) -> Iterator[None]:
        """The modules as they are; each back on the meta device after."""
        try:
            yield
        finally:
            for module in modules:
                release(module)

    def weights_digest(self) -> str:
        """numerics.weights_digest of the model."""
        return weights_digest(self._loaded)


def release(module: nn.Module) -> None:
    """Put a module's weights on the meta device (every tie of one follows it: the tensor
    objects stay, their memory goes)."""
    for tensor in module.state_dict(keep_vars=True).values():
        if not tensor.is_meta:
            _swap(tensor, torch.empty_like(tensor, device="meta"))


def _swap(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Make `tensor` (a parameter or buffer, wherever it is held) hold `value`."""
    if isinstance(tensor, nn.Parameter):
        value = nn.Parameter(value, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, value)


def _sources(model: Any, index: dict[str, Entry]) -> dict[str, Entry] | None:
    """Where each state dict tensor of `model` lies in the files: under its own name, or a
    tie's (the same tensor under another name: a tied head); None where one lies nowhere or in
    another shape."""
    names: dict[int, list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        names.setdefault(id(tensor), []).append(name)
    sources = {}
    for name, tensor in state.items():
        found = [index[n] for n in names[id(tensor)] if n in index]
        if not found or found[0].shape != tuple(tensor.shape):
            return None
        sources[name] = found[0]
    return sources


def _compute_buffers(model: Any) -> None:
    """The skeleton's non-persistent buffers on the CPU, computed as from_pretrained does
    (placed, then set by the model's _init_weights of their modules)."""
    owners = {}
    for name, buffer in list(model.named_buffers()):
        path, _, attribute = name.rpartition(".")
        owner = model.get_submodule(path)
        if buffer.is_meta and attribute in owner._non_persistent_buffers_set:
            _swap(buffer, torch.empty_like(buffer, device="cpu"))
            owners[path] = owner
    with torch.no_grad():
        for owner in owners.values():
            model._init_weights(owner)
