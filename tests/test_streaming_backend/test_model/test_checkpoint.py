"""A checkpoint folder's model read a module at a time (model/checkpoint.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import skeleton
from safetensors.torch import load_file, save_file

from streaming_backend.model.checkpoint import StreamedModel, read, safetensors_index
from streaming_backend.model.loading import load_model
from streaming_backend.model.numerics import weights_digest


def mapped(folder: Path) -> list[str]:
    """The files of `folder` this process maps."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [line.split()[5] for line in lines if len(line.split()) >= 6 and str(folder) in line]


def test_each_tensor_reads_as_safetensors_loads_it(checkpoint):
    """Every tensor of the folder's file, read alone, equals safetensors' own reading."""
    [file] = checkpoint.glob("*.safetensors")
    expected = load_file(file)
    index = safetensors_index(checkpoint)
    assert set(index) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(read(index[name]), tensor) and read(index[name]).dtype == tensor.dtype


def test_a_layer_reads_in_as_from_pretrained_loads_it_and_goes_after(checkpoint):
    """Inside `loaded`, a layer's weights are from_pretrained's (converted to the dtype asked
    for); after it they are on the meta device again, and no file of the folder is mapped
    meanwhile or after (plain reads)."""
    source = StreamedModel.of(skeleton(checkpoint, "bfloat16"))
    full = load_model(str(checkpoint), dtype="bfloat16", device="cpu").model
    layer = source.model.model.layers[1]
    with source.loaded(layer):
        ours = dict(layer.named_parameters())
        theirs = dict(full.model.layers[1].named_parameters())
        assert ours.keys() == theirs.keys() and not mapped(checkpoint)
        for name, tensor in ours.items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, theirs[name])
    assert all(p.is_meta for p in layer.parameters()) and not mapped(checkpoint)


def test_a_tied_head_reads_as_the_embedding_and_the_rope_buffers_as_computed(checkpoint):
    """The tied head is the embedding's tensor (read once, held by both modules); RoPE's
    buffers are on the CPU with from_pretrained's values."""
    source = StreamedModel.of(skeleton(checkpoint))
    full = load_model(str(checkpoint), dtype="float32", device="cpu").model
    model = source.model
    with source.loaded(model.model.embed_tokens, model.lm_head):
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(model.lm_head.weight, full.lm_head.weight)
    assert model.lm_head.weight.is_meta
    for name, buffer in full.model.rotary_emb.named_buffers():
        assert torch.equal(dict(model.model.rotary_emb.named_buffers())[name], buffer)


def test_the_weights_digest_is_the_loaded_models(checkpoint):
    """Its weights digest, read a tensor at a time, is numerics' for the model loaded whole."""
    source = StreamedModel.of(skeleton(checkpoint))
    assert source.weights_digest() == weights_digest(load_model(str(checkpoint), "float32", "cpu"))


def test_files_that_name_a_weight_otherwise_are_not_streamed(checkpoint):
    """A weight under another name than the model's (as transformers renames some on load) or
    of another shape: None, the caller loads the model whole."""
    [file] = checkpoint.glob("*.safetensors")
    tensors = load_file(file)
    name = next(n for n in tensors if n.endswith("q_proj.weight"))
    renamed = dict(tensors)
    renamed[name.replace("q_proj", "query")] = renamed.pop(name)
    save_file(renamed, file, metadata={"format": "pt"})
    assert StreamedModel.of(skeleton(checkpoint)) is None
    reshaped = dict(tensors)
    reshaped[name] = reshaped[name][:-1]
    save_file(reshaped, file, metadata={"format": "pt"})
    assert StreamedModel.of(skeleton(checkpoint)) is None
