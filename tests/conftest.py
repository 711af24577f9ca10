"""Shared fixtures: a tiny random model of the default model's family, and a real tritonserver."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_CONTEXT = 256


def wait_for(condition, timeout: float = 20.0) -> None:
    """Poll a condition another thread or process makes true, up to a deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def chat_prompts() -> list[list[dict[str, str]]]:
    """The chat prompts shipped in the package (English, Chinese, emoji, multi-turn)."""
    from streaming_backend.prompts import load_chat_prompts

    return load_chat_prompts()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default chat model converted to a safetensors folder (cached across runs)."""
    from streaming_backend.loading import convert_gguf, default_model_path

    return convert_gguf(default_model_path())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A randomly initialised 2-layer Llama with the default model's tokenizer, saved to disk."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_CONTEXT,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    """The tiny model loaded in float32 on the CPU."""
    from streaming_backend.loading import load_model

    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


def start_server(model_dir, **overrides):
    """Start a real tritonserver on free loopback ports serving `model_dir` as the chat model
    (only the chat model is loaded unless `models=` names others)."""
    from streaming_backend.launcher import ServerConfig, TritonServer, free_port
    from streaming_backend.wire import CHAT_MODEL

    config = ServerConfig(
        model=str(model_dir) if model_dir is not None else None,
        dtype=overrides.pop("dtype", "float32"),
        models=overrides.pop("models", (CHAT_MODEL,)),
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        **overrides,
    )
    server = TritonServer(config, on_log=None)
    server.start()
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def triton_server(tiny_model_dir):
    """A real tritonserver serving the tiny model, shared by the server tests of a session."""
    server = start_server(tiny_model_dir, max_streams=8, queue_limit=16)
    try:
        yield server
    finally:
        server.stop()


DIALOGUE_MAX_BEAM = 4
DIALOGUE_QUEUE_DELAY_US = 100_000


@pytest.fixture(scope="session")
def dialogue_server(tiny_model_dir):
    """tritonserver with only the dialogue_model on the tiny model: two instances, dynamic
    batching with a queue delay of 100 ms (5 ms as shipped), so that requests sent together
    reliably share a batch, and max_beam_width 4."""
    from streaming_backend.serve_models import DialogueBatching
    from streaming_backend.wire import DIALOGUE_MODEL

    server = start_server(
        tiny_model_dir,
        models=(DIALOGUE_MODEL,),
        model_parameters={"max_beam_width": str(DIALOGUE_MAX_BEAM)},
        dialogue=DialogueBatching(queue_delay_us=DIALOGUE_QUEUE_DELAY_US),
    )
    try:
        yield server
    finally:
        server.stop()
