"""The compact forward's weights in the cache folder: derived once per checkpoint and settings,
then mapped read-only by every load.

    model = compact_model(loaded, "int4")   # from the weight file, converted first if missing

A weight file holds everything the compact forward reads (forward/convert.py's CompactWeights: the
fused and quantized linear weights, embedding, norms, RoPE tables) and the digest numerics
reports for the checkpoint. It is named by a digest of what decides its bytes: the checkpoint's
files (each one's path, size and modification time), the quantization, what runs it (our C
kernels or torch's), the dtype, torch's version, quant.LAYOUT_VERSION and the source of the
modules that derive it. The first load of a checkpoint converts it a layer at a time: reads the
layer's weights from the checkpoint's files (model/checkpoint.py), derives its compact weights,
writes them out (the file appears whole at the end, atomically: forward/weight_file.py) and
drops both, so that its peak is about one layer's, not the model's. It and every later load
then map the file read-only, so the processes serving one checkpoint the same way (the chat
model, each dialogue_model instance, a restart) share its pages and none keeps a float copy of
a quantized weight or a mapping of the checkpoint. Loads of one file wait on a lock while one
of them converts; files of the same checkpoint and settings left by older versions are removed
when a new one is written.

Only a skeleton (load_model's weights=False) of a local checkpoint on the CPU goes through a
file; a model loaded with its weights, on a GPU or from a hub id is derived in memory, as before.
"""

from __future__ import annotations

import fcntl
import gc
import hashlib
import logging
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from streaming_backend.forward import convert, family, quant, weight_file
from streaming_backend.forward.convert import compact_weights
from streaming_backend.forward.family import model_shape
from streaming_backend.forward.llama import CompactLlama
from streaming_backend.heap import trim_heap
from streaming_backend.kernels import matmul as matmul_kernels
from streaming_backend.model import checkpoint
from streaming_backend.model.checkpoint import HeldModel, StreamedModel
from streaming_backend.model.loading import LoadedModel, progress, with_weights
from streaming_backend.model.numerics import weights_digest
from streaming_backend.paths import cache_dir

log = logging.getLogger("tokenstream.model")

FOLDER = "weights"  # under the cache folder
SUFFIX = ".weights"
# the types a weight file's tree holds: the forward's, and every quantized weight format
TYPES = (
    convert.CompactWeights,
    convert.NativeParams,
    family.LlamaShape,
    convert.Block,
    convert.Experts,
    *(t for t in typing.get_args(quant.Weight) if t is not torch.Tensor),
)
# the code that decides a file's bytes: any change to it is a new file
SOURCES = (family, convert, quant, matmul_kernels, weight_file, checkpoint)


def compact_model(
    loaded: LoadedModel, quantize: str, matmul: str = "auto", huge_pages: bool = True
) -> CompactLlama:
    """The compact forward of a loaded model: on a skeleton of a local
    checkpoint on the CPU, mapped from its weight file (written first if missing); else, or
    where the cache folder cannot be written, derived in memory from the model's weights
    (placed in huge pages if `huge_pages`). UnsupportedModel, before any weight is read, for a
    family the forward does not run."""
    model_shape(loaded.model)  # the family, from the config
    if loaded.has_weights or loaded.checkpoint is None or loaded.device.type != "cpu":
        return _in_memory(loaded, quantize, matmul, huge_pages)
    path = weights_path(loaded, quantize, matmul)
    try:
        tree, meta = _mapped(loaded, quantize, matmul, path)
    except OSError as exc:  # a read-only or full cache folder: serve all the same
        progress(f"no weight file ({exc}): the weights are derived in memory")
        return _in_memory(loaded, quantize, matmul, huge_pages)
    progress(f"weights mapped from {path} (read-only, shared)")
    model = CompactLlama.from_weights(tree)  # in the file's pages: shared, so no huge-page copy
    model.weights_digest = meta["weights_digest"]
    return model


def _in_memory(loaded: LoadedModel, quantize: str, matmul: str, huge_pages: bool) -> CompactLlama:
    """The compact forward derived from the model's weights; where they were loaded here (the
    caller's model a skeleton, which cannot tell), with their weights_digest."""
    full = with_weights(loaded)
    model = CompactLlama(full.model, quantize, matmul, huge_pages=huge_pages)
    if full is not loaded:
        model.weights_digest = weights_digest(full)
    return model


def _mapped(loaded: LoadedModel, quantize: str, matmul: str, path: Path) -> tuple[Any, dict]:
    """The tree and meta of the weight file at `path`, written first if missing (one process at
    a time: the others wait, then read what it wrote)."""
    with _locked(path):
        found = _read(path)
        if found is None:
            _remove_stale(path)
            _convert(loaded, quantize, matmul, path)
            found = _read(path)
    if found is None:
        raise OSError(f"{path} did not read back whole")
    return found


def weights_path(loaded: LoadedModel, quantize: str, matmul: str) -> Path:
    """The weight file of a local checkpoint with these settings: in the cache folder, named
    for the checkpoint and the settings, ending in the digest of everything deciding its bytes."""
    checkpoint = loaded.checkpoint.resolve()
    where = hashlib.sha256(str(checkpoint).encode()).hexdigest()[:8]
    dtype = str(loaded.dtype).removeprefix("torch.")
    runs = "c" if matmul == "auto" and matmul_kernels.matmul_kernel() is not None else "aten"
    stem = f"{checkpoint.name}-{where}-{quantize}-{runs}-{dtype}"
    facts = [str(checkpoint), quantize, matmul, runs, dtype, torch.__version__]
    facts += [str(quant.LAYOUT_VERSION), *_files(checkpoint), *map(_source_digest, SOURCES)]
    digest = hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]
    return cache_dir() / FOLDER / f"{stem}-{digest}{SUFFIX}"


def _files(checkpoint: Path) -> Iterator[str]:
    """Each file of a checkpoint folder (links followed) as its path, size and mtime."""
    for path in sorted(checkpoint.rglob("*")):
        name = path.relative_to(checkpoint)
        if path.is_file() and not any(part.startswith(".") for part in name.parts):
            info = path.stat()
            yield f"{name} {info.st_size} {info.st_mtime_ns}"


def _source_digest(module: Any) -> str:
    return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`'s lock file (released when the process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(path: Path) -> tuple[Any, dict] | None:
    """The tree and meta of a weight file; None when there is none or it does not read whole
    (then it is removed, to be written again)."""
    if not path.is_file():
        return None
    try:
        return weight_file.read_tree(path, TYPES)
    except weight_file.WeightFileError as exc:
        log.warning("weight file %s not used: %s", path, exc)
        path.unlink(missing_ok=True)
        return None


def _convert(loaded: LoadedModel, quantize: str, matmul: str, path: Path) -> None:
    """Derive the compact weights from the checkpoint and write them to `path` layer by layer:
    each layer's weights read from the checkpoint's files (checkpoint.StreamedModel; or, where
    its files name them otherwise, the Hugging Face model loaded whole: HeldModel), its block
    derived, written out and dropped. Then give the memory back to the system."""
    progress(f"converting {loaded.name} for the compact forward (once; cached in {path})")
    started = time.monotonic()
    source = StreamedModel.of(loaded) or HeldModel(with_weights(loaded))
    meta = {"weights_digest": source.weights_digest(), "checkpoint": str(loaded.checkpoint)}
    with weight_file.TreeWriter(path) as writer:
        weights = compact_weights(source.model, quantize, matmul, _Written(source, writer))
        size = writer.finish(weights, meta)
    del source, weights
    _remove_older(path)
    progress(f"converted in {time.monotonic() - started:.1f} s: {size / 1e9:.2f} GB")
    release_memory()


class _Written(NamedTuple):
    """compact_weights' stream in a conversion (convert.Stream): the source's modules read while
    needed, each derived part written to the weight file at once."""

    source: StreamedModel | HeldModel
    writer: weight_file.TreeWriter

    @contextmanager
    def loaded(self, *modules: Any) -> Iterator[None]:
        with self.source.loaded(*modules):
            yield
        trim_heap()  # the released weights' memory back to the system at once (heap.py)

    def keep(self, tree: Any) -> Any:
        return self.writer.put(tree)


def _remove_stale(path: Path) -> None:
    """Remove the temporary files of conversions of `path` that were killed: under its lock no
    other process is writing one (forward/weight_file.py names them .NAME.PID.tmp)."""
    for other in path.parent.iterdir():
        if other.name.startswith(f".{path.name}.") and other.suffix == ".tmp":
            other.unlink(missing_ok=True)


def _remove_older(path: Path) -> None:
    """Remove the other weight files of the same checkpoint and settings (another digest: older
    code or checkpoint files) and those of checkpoints that are gone (a test's temporary model),
    with their locks. A process still mapping one keeps its pages."""
    for other in path.parent.iterdir():
        if other != path and other.suffix == SUFFIX:
            if _stem(other) == _stem(path) or not _checkpoint_exists(other):
                other.unlink(missing_ok=True)
                other.with_suffix(".lock").unlink(missing_ok=True)


def _checkpoint_exists(path: Path) -> bool:
    """Whether the checkpoint a weight file was converted from is still there."""
    try:
        return Path(weight_file.read_meta(path)["checkpoint"]).exists()
    except (OSError, KeyError, weight_file.WeightFileError):
        return False


def _stem(path: Path) -> str:
    """A weight file's name less its digest: the checkpoint and the settings."""
    return path.stem.rsplit("-", 1)[0]


def release_memory() -> None:
    """Collect garbage and return the C heap's free memory to the system, so that freed
    weights leave the resident size, not only Python's view."""
    gc.collect()
    trim_heap()
