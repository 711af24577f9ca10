"""Families beyond Llama served on the compact forward: a tiny random model of each (its
differences from Llama made visible: tests/families.py) with the default model's tokenizer,
in-process and behind tritonserver."""

import pytest
from conftest import chat_prompts, save_tiny_model, start_server

from streaming_backend.sampling.settings import SamplingSettings


@pytest.mark.parametrize(
    "family",
    ["qwen3", "granite", "olmo2", "smollm3", "phi3", "gemma2", "gemma3_text", "qwen3_moe", "olmoe"],
)
def test_a_family_is_served_on_the_compact_forward_as_in_process(
    tmp_path, default_model_dir, family
):
    """Greedy, with int4 weights: the compact forward runs it in-process, and tritonserver's
    chat model streams the same answer, ending with FINAL."""
    from clients.library.grpc_client import GenerateRequest, stream_generate
    from streaming_backend.engine import Engine, EngineConfig
    from streaming_backend.model.loading import load_model
    from streaming_backend.prompts import encode_prompt

    model_dir = save_tiny_model(tmp_path, default_model_dir, family=family)
    messages = chat_prompts()[0]
    sampling = {"temperature": 0, "max_tokens": 12}
    loaded = load_model(str(model_dir), dtype="float32", device="cpu")
    with Engine(loaded, EngineConfig(quantize="int4", forward="compact")) as engine:
        assert engine.forward == "compact"
        ids = encode_prompt(loaded.tokenizer, messages=messages)
        events = list(engine.submit(ids, SamplingSettings(**sampling)))
    expected = "".join(e.text for e in events)
    assert sum(len(e.token_ids) for e in events) == 12

    server = start_server(model_dir, quantize="int4", forward="compact")  # no fallback
    try:
        request = GenerateRequest(messages=messages, sampling=sampling)
        chunks = list(stream_generate(server.grpc_url, request))
    finally:
        server.stop(graceful=False)
    assert chunks[-1].final
    assert "".join(c.text for c in chunks) == expected
