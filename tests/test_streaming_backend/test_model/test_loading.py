"""Loading: dtype and device names, EOS ids, context length, the cached GGUF conversion."""

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_CONTEXT

from streaming_backend.model import loading
from streaming_backend.paths import CACHE_VARIABLE


def cpu_dtype(setting: str) -> torch.dtype:
    """The torch dtype load_model picks on the CPU for a dtype setting."""
    return loading.DTYPES[loading.choose_device_dtype(setting, torch.device("cpu")).dtype]


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("fp16", torch.float16),
        ("half", torch.float16),
    ],
)
def test_dtype_names(name, dtype):
    """Full names and the usual short ones."""
    assert cpu_dtype(name) == dtype


@pytest.mark.parametrize(
    "flags, dtype",
    [({"avx2"}, torch.float32), ({"avx2", "avx512_bf16"}, torch.bfloat16), (set(), torch.float32)],
)
def test_auto_dtype_follows_the_cpu_flags(monkeypatch, flags, dtype):
    """auto on the CPU: bfloat16 with native bfloat16 instructions, else float32 (faked flags)."""
    monkeypatch.setattr(loading, "cpu_flags", lambda: frozenset(flags))
    assert cpu_dtype("auto") == dtype
    assert "CPU" in loading.choose_device_dtype("auto", torch.device("cpu")).reason


def test_unknown_dtype_is_refused():
    """A dtype we do not know is refused with the choices."""
    with pytest.raises(ValueError, match="unknown dtype 'int8'; choose auto, float32"):
        cpu_dtype("int8")


def test_devices():
    """auto is CUDA when there is one, else the CPU; an explicit device is taken as given."""
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert loading.resolve_device("auto").type == expected
    assert loading.resolve_device("cpu") == torch.device("cpu")
    assert loading.resolve_device("cuda:1") == torch.device("cuda", 1)


def _model(eos, max_positions):
    return SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=eos),
        config=SimpleNamespace(max_position_embeddings=max_positions),
    )


@pytest.mark.parametrize(
    "model_eos, tokenizer_eos, ids",
    [
        (2, 2, {2}),
        ([2, 7], 2, {2, 7}),
        (None, 3, {3}),
        ((4,), None, {4}),
        (None, None, set()),
    ],
)
def test_eos_ids_from_model_and_tokenizer(model_eos, tokenizer_eos, ids):
    """EOS ids are the union of the generation config's (an int or a list) and the tokenizer's."""
    tokenizer = SimpleNamespace(eos_token_id=tokenizer_eos)
    assert loading._eos_ids(_model(model_eos, 1), tokenizer) == frozenset(ids)


@pytest.mark.parametrize(
    "max_positions, tokenizer_max, length",
    [(2048, 10**30, 2048), (None, 512, 512), (None, 10**30, 1_000_000)],
)
def test_context_length(max_positions, tokenizer_max, length):
    """The model's position limit, else the tokenizer's, capped (tokenizers say 1e30 for none)."""
    tokenizer = SimpleNamespace(model_max_length=tokenizer_max)
    assert loading._context_length(_model(None, max_positions), tokenizer) == length


def test_load_a_model_folder(tiny_model_dir, capsys):
    """A Hugging Face folder loads in the asked dtype, with its EOS ids and context; the dtype
    and the reason for it are logged."""
    loaded = loading.load_model(str(tiny_model_dir), dtype="fp32", device="cpu")
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    assert loaded.dtype_reason == "set explicitly"
    assert "dtype float32 on cpu (fp32: set explicitly)" in capsys.readouterr().err
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert loaded.eos_ids == {loaded.tokenizer.eos_token_id}
    assert loaded.context_length == TINY_CONTEXT
    assert loaded.name == tiny_model_dir.name
    assert not loaded.model.training


def test_a_missing_gguf_file(tmp_path):
    """A .gguf path that is not there fails with its path, before any conversion."""
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        loading.load_model(str(tmp_path / "absent.gguf"))


def test_the_default_model_is_converted_once(default_model_dir):
    """The bundled GGUF converts to a cached folder named by its content; later calls reuse it."""
    gguf = loading.default_model_path()
    assert gguf.name == loading.DEFAULT_MODEL_FILE
    config = default_model_dir / "config.json"
    stamp = os.stat(config).st_mtime_ns
    assert loading.convert_gguf(gguf) == default_model_dir
    assert os.stat(config).st_mtime_ns == stamp  # reused, not rewritten
    assert default_model_dir.name.startswith(gguf.stem + "-")
    assert (default_model_dir / "tokenizer.json").is_file()
    assert list(default_model_dir.glob("*.safetensors"))


@pytest.mark.parametrize(
    "kind, device_id, device",
    [("GPU", "1", "cuda:1"), ("GPU", 0, "cuda:0"), ("CPU", "0", "cpu"), ("MODEL", "0", "auto")],
)
def test_instance_device_follows_the_triton_instance(kind, device_id, device):
    """A KIND_GPU instance runs on its own GPU, not always the first; KIND_MODEL picks."""
    from streaming_backend.model.loading import instance_device

    assert instance_device(kind, device_id) == device


def write_gguf(path, architecture: str):
    """A GGUF file of one tiny tensor whose general.architecture is `architecture`."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_of_an_architecture_transformers_cannot_convert(tmp_path, monkeypatch):
    """A GGUF file whose architecture transformers' reader does not convert fails before any
    conversion, naming the file, its architecture and the ones that convert."""
    monkeypatch.setenv(CACHE_VARIABLE, str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny-olmo2.gguf", "olmo2")
    assert loading.gguf_architecture(path) == "olmo2"
    assert "olmo2" not in loading.gguf_architectures()
    with pytest.raises(ValueError, match=r"tiny-olmo2\.gguf .* architecture 'olmo2'") as refused:
        loading.load_model(str(path))
    assert "llama, mamba" in str(refused.value)  # the list transformers converts
    assert not (tmp_path / "cache").exists()  # refused before a conversion started


@pytest.mark.parametrize("architecture", ["llama", "qwen3moe", "gpt-oss"])
def test_gguf_architectures_transformers_converts_pass_the_check(tmp_path, architecture):
    """The families transformers converts pass, as llama.cpp spells them too (qwen3moe for
    transformers' qwen3_moe)."""
    loading.check_gguf_architecture(write_gguf(tmp_path / "tiny.gguf", architecture))
