"""A family beyond Llama served on the compact forward: a tiny random Qwen3 (norms on each head's
queries and keys) with the default model's tokenizer, in-process and behind tritonserver."""

import pytest
from conftest import chat_prompts, save_tiny_model, start_server

from streaming_backend.settings import SamplingSettings


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_model_dir):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), default_model_dir, family="qwen3")


def test_qwen3_is_served_on_the_compact_forward_as_in_process(qwen3_dir):
    """Greedy, with int4 weights: the compact forward runs it in-process, and tritonserver's
    chat model streams the same answer, ending with FINAL."""
    from clients.grpc_client import GenerateRequest, stream_generate
    from streaming_backend.engine import Engine, EngineConfig
    from streaming_backend.loading import load_model
    from streaming_backend.prompts import encode_prompt

    messages = chat_prompts()[0]
    sampling = {"temperature": 0, "max_tokens": 12}
    loaded = load_model(str(qwen3_dir), dtype="float32", device="cpu")
    with Engine(loaded, EngineConfig(quantize="int4", forward="compact")) as engine:
        assert engine.forward == "compact"
        ids = encode_prompt(loaded.tokenizer, messages=messages)
        events = list(engine.submit(ids, SamplingSettings(**sampling)))
    expected = "".join(e.text for e in events)
    assert sum(len(e.token_ids) for e in events) == 12

    server = start_server(qwen3_dir, quantize="int4", forward="compact")  # no fallback
    try:
        request = GenerateRequest(messages=messages, sampling=sampling)
        chunks = list(stream_generate(server.grpc_url, request))
    finally:
        server.stop(graceful=False)
    assert chunks[-1].final
    assert "".join(c.text for c in chunks) == expected
