"""One model whatever the load, end to end in the core: a request's tokens are the same alone, in
a crowd of 15 others, and beside long prompts prefilled in chunks while it decodes; greedy and
seeded; on the chat engine and the dialogue model.

The model loads as served (`dtype auto`, `quantize auto`), so what these tests check is what this
CPU kind gets by default. CI runs them twice (marker `cpu_kinds`): natively and under the AVX2
caps, where `auto` picks another dtype.
"""

from __future__ import annotations

import pytest
from conftest import generate

from streaming_backend.dialogue.generation import GenerationRequest
from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.model.loading import load_model
from streaming_backend.prompts import encode_prompt
from streaming_backend.sampling.settings import SamplingSettings

pytestmark = pytest.mark.cpu_kinds

GREEDY = SamplingSettings(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingSettings(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
LONG = SamplingSettings(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def served_tiny(tiny_model_dir):
    """The tiny model loaded as `tokenstream serve` loads a model: dtype auto."""
    return load_model(str(tiny_model_dir), dtype="auto", device="cpu")


def _chats(loaded) -> list[list[int]]:
    from streaming_backend.prompts import load_chat_prompts

    return [encode_prompt(loaded.tokenizer, messages=m) for m in load_chat_prompts()[:8]]


def _tokens(handle) -> list[int]:
    return [t for event in handle for t in event.token_ids]


@pytest.mark.parametrize("quantize", ["auto", "none"])
def test_the_same_chats_alone_and_in_a_crowd_give_the_same_tokens(served_tiny, quantize):
    """8 chats asked greedy and with a seed, each alone, then all 16 at once while 8 long prompts
    arrive and are prefilled in chunks of 16 tokens between their steps: token for token the
    same answers (the crowd also reuses the alone run's prompts from the prefix cache)."""
    config = EngineConfig(
        max_streams=24, queue_limit=32, quantize=quantize, prefill_chunk_tokens=16
    )
    chats = _chats(served_tiny)
    requests = [(p, GREEDY) for p in chats] + [(p, SEEDED) for p in chats]
    long_prompts = [[(7 * i + 11 * j) % 900 + 50 for j in range(120 + 9 * i)] for i in range(8)]
    with Engine(served_tiny, config) as engine:
        alone = [_tokens(engine.submit(prompt, settings)) for prompt, settings in requests]
        handles = [engine.submit(prompt, settings) for prompt, settings in requests]
        first = next(iter(handles[0]))  # decoding has begun: the long prompts arrive beside it
        long_handles = [engine.submit(prompt, LONG) for prompt in long_prompts]
        crowd = [[*first.token_ids, *_tokens(handles[0])]] + [_tokens(h) for h in handles[1:]]
        for handle in long_handles:
            assert len(_tokens(handle)) == LONG.max_tokens
    assert all(len(tokens) == 24 for tokens in alone)
    differ = [i for i, (a, c) in enumerate(zip(alone, crowd)) if a != c]
    assert not differ, f"requests {differ} changed in the crowd"


def test_a_dialogue_batch_gives_each_request_its_tokens_alone(served_tiny):
    """The dialogue model as served (quantize auto): greedy, sampled and beam requests give the
    same tokens and the same cumulative log-probabilities, exactly, alone and batched."""
    forward = EngineConfig(forward="compact", quantize="auto")
    seeded = SamplingSettings(temperature=0.9, top_p=0.95, seed=5)
    requests = [
        GenerationRequest((1, 2, 3, 4, 5, 6, 7, 8), 8),
        GenerationRequest((9, 10), 6, beam_width=3),
        GenerationRequest(tuple(range(20, 70)), 8, settings=seeded),
        GenerationRequest((11, 12, 13), 8, settings=SamplingSettings(temperature=1.0, seed=9)),
    ]
    batch = generate(served_tiny, forward, requests, 4)
    for request, together in zip(requests, batch):
        (alone,) = generate(served_tiny, forward, [request], 4)
        assert [b.tokens for b in together.beams] == [b.tokens for b in alone.beams]
        assert [b.cum_log_prob for b in together.beams] == [b.cum_log_prob for b in alone.beams]
