"""The real default chat model (SmolLM2-135M-Instruct), in-process and behind tritonserver."""

import pytest
from conftest import chat_prompts, start_server

from streaming_backend.events import FinishReason
from streaming_backend.sampling.settings import SamplingSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_loaded(default_model_dir):
    from streaming_backend.model.loading import load_model

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
    from clients.library.grpc_client import GenerateRequest, stream_generate

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
        server.stop(graceful=False)  # nothing to drain


@pytest.mark.cpu_kinds
def test_answers_do_not_change_with_the_load(default_loaded):
    """The shared prompts' answers, greedy and seeded, and a follow-up turn of each, are token
    for token the same when all are asked at once, prompts prefilled in 8-token chunks beside
    running streams and follow-ups reusing the cached prompts and answers (prefix_cache on), as
    when each is asked alone with no cache. The model as served here: dtype and quantize auto
    (CI runs this natively and under the AVX2 caps: both of auto's choices)."""
    from streaming_backend.engine import Engine, EngineConfig
    from streaming_backend.prompts import encode_prompt

    tokenizer = default_loaded.tokenizer
    kinds = (
        SamplingSettings(temperature=0, max_tokens=16),
        SamplingSettings(temperature=1.0, seed=7, max_tokens=16),
    )

    def follow_up(messages, answer_ids):
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
        turn = [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
        return encode_prompt(tokenizer, messages=messages + turn)

    def answers(engine, requests, together):
        """Output ids of each (prompt, settings); cached prompt tokens of each."""
        if together:
            handles = [engine.submit(p, s) for p, s in requests]
            runs = [list(h) for h in handles]
        else:
            runs = [list(engine.submit(p, s)) for p, s in requests]
        outputs = [[t for e in r for t in e.token_ids] for r in runs]
        return outputs, [r[0].cached_tokens for r in runs]

    def conversation(config, together):
        chats = [m for m in chat_prompts() for _ in kinds]
        settings = [s for _ in chat_prompts() for s in kinds]
        with Engine(default_loaded, config) as engine:
            assert engine.forward == "compact"
            prompts = [encode_prompt(tokenizer, messages=m) for m in chats]
            firsts, _ = answers(engine, list(zip(prompts, settings)), together)
            turns = [follow_up(m, ids) for m, ids in zip(chats, firsts)]
            seconds, cached = answers(engine, list(zip(turns, settings)), together)
        return firsts, seconds, cached

    alone = EngineConfig(forward="compact", prefix_cache="off", max_streams=1)
    reference = conversation(alone, together=False)
    busy = EngineConfig(forward="compact", prefix_cache="on", prefill_chunk_tokens=8)
    firsts, seconds, cached = conversation(busy, together=True)
    assert firsts == reference[0]
    assert seconds == reference[1]
    assert reference[2] == [0] * len(cached) and min(cached) > 20  # every follow-up hit
