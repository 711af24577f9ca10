"""The compact forward's weights converted once into the cache folder and mapped by every load
(model/weight_cache.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import skeleton

from streaming_backend.forward import quant
from streaming_backend.forward.convert import compact_weights
from streaming_backend.forward.llama import CompactLlama
from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model import weight_cache
from streaming_backend.model.checkpoint import StreamedModel
from streaming_backend.model.loading import load_model
from streaming_backend.model.numerics import weights_digest
from streaming_backend.model.weight_cache import FOLDER, compact_model

CONFIG = ForwardConfig(CacheBudget(bytes=16 << 20), max_len=64, max_slots=2)
PROMPT = list(range(5, 30))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache folder of this test's own; its weight files' folder."""
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / FOLDER


def logits(loaded, model: CompactLlama) -> torch.Tensor:
    """The logits after PROMPT on a fresh slot cache."""
    forward = SlotForward.create(loaded, CONFIG, model)
    return forward.prefill([PromptChunk(forward.cache.allocate(), PROMPT)])


def conversions(monkeypatch) -> list[Path]:
    """The paths each conversion writes, from now on."""
    seen: list[Path] = []
    convert = weight_cache._convert

    def recording(loaded, quantize, matmul, path):
        seen.append(path)
        convert(loaded, quantize, matmul, path)

    monkeypatch.setattr(weight_cache, "_convert", recording)
    return seen


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_a_skeleton_maps_its_converted_weights_and_gives_the_same_logits(
    cache, checkpoint, quantize, monkeypatch
):
    """The first load converts, the second maps the file it wrote without converting; both
    give bit for bit the logits of the forward derived in memory from the model's weights,
    and the weights digest numerics reports for the model itself."""
    seen = conversions(monkeypatch)
    loaded = skeleton(checkpoint)
    first = compact_model(loaded, quantize)
    assert len(seen) == 1 and seen[0].parent == cache and seen[0].is_file()
    again = compact_model(skeleton(checkpoint), quantize)
    assert len(seen) == 1
    full = load_model(str(checkpoint), dtype="float32", device="cpu")
    in_memory = CompactLlama(full.model, quantize)
    expected = logits(full, in_memory)
    assert torch.equal(logits(loaded, first), expected)
    assert torch.equal(logits(loaded, again), expected)
    assert first.weights_digest == again.weights_digest == weights_digest(full)
    assert (again.matmul, again.attention, again.native) == (
        in_memory.matmul,
        in_memory.attention,
        in_memory.native,
    )


# the families the compact forward runs; a mixture of experts' files name its experts one by
# one where transformers stacks them on load, so its conversion loads the model whole
STREAMED = ["llama", "qwen3", "granite", "olmo2", "smollm3", "phi3", "gemma2", "gemma3_text"]
WHOLE = ["qwen3_moe"]


@pytest.mark.parametrize("family", STREAMED + WHOLE)
def test_a_conversion_writes_what_the_whole_model_derives(
    cache, tmp_path, default_model_dir, family
):
    """A conversion read layer by layer from the checkpoint's files (loaded whole where they
    name weights otherwise) writes bit for bit the compact weights derived from the model
    from_pretrained loads (in bfloat16 from float32 files: converted alike), and its digest."""
    from conftest import save_tiny_model

    folder = save_tiny_model(tmp_path / family, default_model_dir, family=family)
    loaded = load_model(str(folder), dtype="bfloat16", device="cpu", weights=False)
    assert (StreamedModel.of(loaded) is not None) == (family in STREAMED)
    mapped = compact_model(loaded, "int4").weights
    full = load_model(str(folder), dtype="bfloat16", device="cpu")
    derived = compact_weights(full.model, "int4")
    ours, structure = torch.utils._pytree.tree_flatten(mapped)
    theirs, expected_structure = torch.utils._pytree.tree_flatten(derived)
    assert structure == expected_structure
    for read, made in zip(ours, theirs, strict=True):
        if isinstance(made, torch.Tensor):
            assert read.dtype == made.dtype and torch.equal(read, made)
        else:
            assert read == made
    assert weight_cache.weight_file.read_meta(next(cache.glob("*.weights")))["weights_digest"] == (
        weights_digest(full)
    )


PEAK = """
import sys
from pathlib import Path
from streaming_backend.model.loading import load_model
from streaming_backend.model.weight_cache import compact_model

def kilobytes(key):
    [line] = [x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key)]
    return int(line.split()[1])

loaded = load_model(sys.argv[1], dtype="float32", device="cpu", weights=False)
Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
before = kilobytes("VmRSS:")
compact_model(loaded, "int8")
print(kilobytes("VmHWM:") - before)
"""


def test_a_conversion_holds_about_a_layer_at_a_time(cache, tmp_path, default_model_dir):
    """Converting a checkpoint of 16 layers of 14 MB and an embedding of 50 MB (float32)
    raises the converting process's peak resident size by less than half the checkpoint's
    bytes (loading the model whole, as before, took more than all of them)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=4096,
        num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    folder = tmp_path / "layers"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    code = textwrap.dedent(PEAK)
    run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) * 1024 < size / 2, (int(run.stdout) * 1024, size)


def test_another_checkpoint_quantization_or_layout_is_another_file(cache, checkpoint, monkeypatch):
    """Touching a checkpoint file converts again (its older file removed); another quantization
    or another LAYOUT_VERSION is another file beside it."""
    seen = conversions(monkeypatch)
    compact_model(skeleton(checkpoint), "int4")
    weights = next(checkpoint.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    compact_model(skeleton(checkpoint), "int4")
    assert len(seen) == 2 and seen[0] != seen[1]
    assert not seen[0].exists() and seen[1].exists()  # the older one removed
    compact_model(skeleton(checkpoint), "int8")
    monkeypatch.setattr(quant, "LAYOUT_VERSION", quant.LAYOUT_VERSION + 1)
    compact_model(skeleton(checkpoint), "int4")
    assert len(set(seen)) == 4
    # int4 under the new layout replaced int4 under the old; int8 stays
    assert sorted(p.name for p in cache.glob("*.weights")) == sorted(p.name for p in seen[2:])


def test_the_file_of_a_checkpoint_gone_is_removed_at_the_next_conversion(cache, checkpoint):
    """Converting a checkpoint removes the weight files whose checkpoints are gone (the
    temporary models of earlier test runs), not those of checkpoints still there."""
    gone = checkpoint.parent / "gone"
    gone.mkdir()
    for path in checkpoint.iterdir():
        (gone / path.name).write_bytes(path.read_bytes())
    compact_model(skeleton(gone), "int4")
    compact_model(skeleton(checkpoint), "int8")
    [kept] = cache.glob("*int8*.weights")
    for path in gone.iterdir():
        path.unlink()
    gone.rmdir()
    compact_model(skeleton(checkpoint), "int4")
    names = sorted(p.name for p in cache.glob("*.weights"))
    assert len(names) == 2 and kept.name in names and not any(n.startswith("gone-") for n in names)


def test_a_file_not_whole_is_converted_again(cache, checkpoint, monkeypatch):
    """A weight file cut short (not what a rename leaves, but a disk can) is not trusted: the
    load converts again and gives the same logits."""
    loaded = skeleton(checkpoint)
    expected = logits(loaded, compact_model(loaded, "int4"))
    [path] = cache.glob("*.weights")
    os.truncate(path, path.stat().st_size - 4096)
    seen = conversions(monkeypatch)
    assert torch.equal(logits(loaded, compact_model(loaded, "int4")), expected)
    assert seen == [path]


KILLED_CONVERSION = """
import os, signal, sys
from streaming_backend.forward import weight_file
from streaming_backend.model.loading import load_model
from streaming_backend.model.weight_cache import compact_model

real, written = weight_file._bytes, []

def bytes_then_die(tensor):  # killed with part of the tensors on disk
    if len(written) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(1)
    return real(tensor)

weight_file._bytes = bytes_then_die
compact_model(load_model(sys.argv[1], dtype="float32", device="cpu", weights=False), "int4")
"""


def test_a_conversion_killed_midway_leaves_nothing_a_later_load_trusts(cache, checkpoint):
    """A conversion killed (SIGKILL) while it writes leaves only its temporary file; the next
    load converts again, removes that file and gives the logits of an untroubled conversion."""
    code = textwrap.dedent(KILLED_CONVERSION)
    run = subprocess.run([sys.executable, "-c", code, str(checkpoint)], env=os.environ.copy())
    assert run.returncode == -signal.SIGKILL
    assert not list(cache.glob("*.weights")) and list(cache.glob(".*.tmp"))
    loaded = skeleton(checkpoint)
    mapped = logits(loaded, compact_model(loaded, "int4"))
    full = load_model(str(checkpoint), dtype="float32", device="cpu")
    assert torch.equal(mapped, logits(full, CompactLlama(full.model, "int4")))
    assert len(list(cache.glob("*.weights"))) == 1 and not list(cache.glob(".*.tmp"))


def mappings(pid: int | str = "self") -> list[tuple[int, int, str, str]]:
    """A process's file mappings: (start, end, permissions, path)."""
    found = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, fields[1], fields[5]))
    return found


def test_no_float_weight_or_checkpoint_mapping_remains_after_the_load(cache, checkpoint):
    """After an int4 load from a skeleton, converted now or mapped: the model holds no weights,
    no checkpoint file is mapped, every tensor of the forward lies in the weight file's
    read-only mapping, and every linear weight (the head's included) is quantized."""
    for _ in ("converted", "mapped"):
        loaded = skeleton(checkpoint)
        model = compact_model(loaded, "int4")
        assert not loaded.has_weights
        maps = mappings()
        assert not [m for m in maps if Path(m[3]).parent == checkpoint]
        [(start, end, permissions, _)] = [m for m in maps if m[3].endswith(".weights")]
        assert permissions.startswith("r-")
        tensors = list(torch.utils._pytree.tree_leaves(model.weights))
        tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.numel()]
        assert tensors and all(start <= t.data_ptr() < end for t in tensors)
        linear = [model.head, *(w for block in model.blocks for w in block.weights())]
        assert all(isinstance(w, quant.NATIVE_WEIGHTS + (quant.Int4Weight, quant.Int8Weight))
                   for w in linear)  # fmt: skip
        del model, tensors, linear  # its mapping goes with it


SHARER = """
import sys, torch
from streaming_backend.model.loading import load_model
from streaming_backend.model.weight_cache import compact_model

model = compact_model(load_model(sys.argv[1], dtype="float32", device="cpu", weights=False), "int4")
tensors = [t for t in torch.utils._pytree.tree_leaves(model.weights) if isinstance(t, torch.Tensor)]
print(sum(float(t.float().sum()) for t in tensors if t.numel()), flush=True)  # every page read
sys.stdin.read()  # until the test has looked
"""


def weight_file_memory(pid: int) -> tuple[int, int]:
    """(Rss, Pss) in kB of a process's mapping of its weight file (/proc/PID/smaps)."""
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split()[0] and not line.split()[0].endswith(":"):
            inside = line.rstrip().endswith(".weights")
        elif inside and line.startswith(("Rss:", "Pss:")):
            value = int(line.split()[1])
            rss, pss = (rss + value, pss) if line.startswith("Rss:") else (rss, pss + value)
    return rss, pss


def test_two_processes_share_the_weight_pages(cache, checkpoint):
    """Two processes that load the same checkpoint the same way map one file: each has all of
    its pages resident, and each is charged half of them (PSS)."""
    compact_model(skeleton(checkpoint), "int4")  # converted here: both children map it
    code = textwrap.dedent(SHARER)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(checkpoint)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        sums = [child.stdout.readline() for child in children]
        assert sums[0] == sums[1] and sums[0].strip()
        [size] = [p.stat().st_size for p in cache.glob("*.weights")]
        for child in children:
            rss, pss = weight_file_memory(child.pid)
            assert rss * 1024 > 0.9 * size  # the whole file resident in each
            assert abs(pss - rss / 2) <= 0.05 * rss  # charged half: the pages are shared
    finally:
        for child in children:
            child.communicate("")


def test_a_cache_folder_that_cannot_be_written_serves_from_memory(
    tmp_path, monkeypatch, checkpoint
):
    """Where the cache folder cannot be made (a file in its place; read-only, full), the load
    derives the weights in memory and gives the same logits."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TOKENSTREAM_CACHE", str(tmp_path / "a-file" / "cache"))
    loaded = skeleton(checkpoint)
    model = compact_model(loaded, "int4")
    full = load_model(str(checkpoint), dtype="float32", device="cpu")
    assert torch.equal(logits(loaded, model), logits(full, CompactLlama(full.model, "int4")))
    assert model.weights_digest == weights_digest(full)


def test_the_load_log_says_what_the_weights_and_kv_cache_cost(cache, checkpoint, capsys):
    """A served model's load log: its weights shared through the file, none private; the KV
    cache's reserved MiB and the few written by the calibration."""
    from streaming_backend.configuration.models import EngineConfig
    from streaming_backend.steps.build import build_steps

    steps = build_steps(skeleton(checkpoint), EngineConfig(quantize="int4"), print)
    [line] = [x for x in capsys.readouterr().err.splitlines() if "memory:" in x]
    [file] = cache.glob("*.weights")
    shared = f"weights {file.stat().st_size / 1e6:.0f} MB shared through a file, 0 MB private"
    assert shared in line and f"KV cache {steps.cache.bytes / 2**20:.0f} MiB reserved" in line
