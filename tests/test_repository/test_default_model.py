"""The real default chat model (SmolLM2-135M-Instruct), in-process and behind tritonserver."""

import pytest
from conftest import chat_prompts, start_server

from streaming_backend.events import FinishReason
from streaming_backend.settings import SamplingSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_loaded(default_model_dir):
    from streaming_backend.loading import load_model

    return load_model(None, dtype="auto")


def test_default_model_answers_a_chat_prompt(default_loaded):
    """The shared prompt 'What is the capital of France?' gets an answer naming Paris."""
    from streaming_backend.engine import Engine
    from streaming_backend.prompts import encode_prompt

    messages = chat_prompts()[0]
    assert "France" in messages[-1]["content"]
    ids = encode_prompt(default_loaded.tokenizer, messages=messages)
    with Engine(default_loaded) as engine:
        events = list(engine.submit(ids, SamplingSettings(temperature=0, max_tokens=48)))
    text = "".join(e.text for e in events)
    assert "Paris" in text, text
    assert events[-1].finish_reason is FinishReason.STOP  # the model ended its answer itself


def test_default_model_behind_triton(default_model_dir):  # fixture: converted once, cached
    """`tokenstream serve`'s default model streams a sensible Chinese answer over gRPC."""
    from clients.grpc_client import GenerateRequest, stream_generate

    server = start_server(None, dtype="auto")  # the model config's own default: the GGUF
    try:
        chinese = next(m for m in chat_prompts() if "长城" in m[-1]["content"])
        chunks = list(
            stream_generate(
                server.grpc_url,
                GenerateRequest(messages=chinese, sampling={"temperature": 0, "max_tokens": 40}),
            )
        )
        text = "".join(c.text for c in chunks)
        assert len(chunks) > 5 and chunks[-1].final
        assert any("\u4e00" <= ch <= "\u9fff" for ch in text), text  # answers in Chinese
        assert "\ufffd" not in text
    finally:
        server.stop()
