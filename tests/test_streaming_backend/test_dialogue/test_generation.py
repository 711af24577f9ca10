"""Batched non-streaming generation (streaming_backend.dialogue.generation) on the tiny model."""

from __future__ import annotations

import pytest
from conftest import batch_forward_for, sequence_log_prob

from streaming_backend.dialogue.generation import (
    GenerationRequest,
    generate_batch,
)
from streaming_backend.errors import InvalidRequest
from streaming_backend.sampling.settings import SamplingSettings

MAX_BEAM = 4


def sampled(seed, **kw):
    return SamplingSettings(temperature=0.9, top_p=0.95, seed=seed, **kw)


def mixed_batch():
    """Different prompt lengths, greedy, beams, sampling, a repetition penalty, an early end id."""
    return [
        GenerationRequest((1, 2, 3, 4, 5, 6, 7, 8), 6),
        GenerationRequest((9, 10), 5, beam_width=3, length_penalty=0.5),
        GenerationRequest((11, 12, 13), 7, settings=sampled(5)),
        GenerationRequest((14, 15, 16, 17), 4, settings=sampled(6, repetition_penalty=1.3)),
        GenerationRequest((18,), 3, beam_width=2, settings=SamplingSettings(temperature=0.0)),
    ]


def test_a_batch_equals_each_request_alone(batch_forward, tiny_loaded):
    """Rows sharing one forward pass see only their own tokens: the same output as alone."""
    batch = generate_batch(
        tiny_loaded, mixed_batch(), MAX_BEAM, forward=batch_forward_for(tiny_loaded, batch_forward)
    )
    for request, together in zip(mixed_batch(), batch):
        (alone,) = generate_batch(
            tiny_loaded, [request], MAX_BEAM, forward=batch_forward_for(tiny_loaded, batch_forward)
        )
        assert [b.tokens for b in together.beams] == [b.tokens for b in alone.beams]
        for a, b in zip(together.beams, alone.beams):
            assert a.cum_log_prob == pytest.approx(b.cum_log_prob, abs=1e-3)


def test_lengths_and_widths_are_kept(batch_forward, tiny_loaded):
    results = generate_batch(
        tiny_loaded, mixed_batch(), MAX_BEAM, forward=batch_forward_for(tiny_loaded, batch_forward)
    )
    for request, result in zip(mixed_batch(), results):
        assert len(result.beams) == request.beam_width
        assert all(1 <= len(b.tokens) <= request.max_new_tokens for b in result.beams)


def test_greedy_is_deterministic(batch_forward, tiny_loaded):
    request = GenerationRequest((3, 1, 4, 1, 5), 10)
    first = (
        generate_batch(
            tiny_loaded, [request], 1, forward=batch_forward_for(tiny_loaded, batch_forward)
        )[0]
        .beams[0]
        .tokens
    )
    second = (
        generate_batch(
            tiny_loaded,
            [request, request],
            1,
            forward=batch_forward_for(tiny_loaded, batch_forward),
        )[1]
        .beams[0]
        .tokens
    )
    assert first == second and len(first) == 10


def test_a_seed_reproduces_sampled_output(batch_forward, tiny_loaded):
    """The same seed gives the same tokens, alone or beside other requests; another seed differs."""
    prompt = (2, 7, 1, 8)
    one = GenerationRequest(prompt, 12, settings=sampled(42))
    (alone,) = generate_batch(
        tiny_loaded, [one], 1, forward=batch_forward_for(tiny_loaded, batch_forward)
    )
    _, beside, _ = generate_batch(
        tiny_loaded,
        [GenerationRequest(prompt, 5, settings=sampled(1)), one, GenerationRequest(prompt, 3)],
        1,
    )
    other = generate_batch(tiny_loaded, [GenerationRequest(prompt, 12, settings=sampled(43))], 1)
    assert alone.beams[0].tokens == beside.beams[0].tokens
    assert alone.beams[0].tokens != other[0].beams[0].tokens


def test_sampled_cum_log_probs_are_the_models(batch_forward, tiny_loaded):
    """cum_log_probs of a sampled sequence: its log-probability under the model's raw logits."""
    request = GenerationRequest((4, 4, 4), 6, settings=sampled(9))
    (result,) = generate_batch(
        tiny_loaded, [request], 1, forward=batch_forward_for(tiny_loaded, batch_forward)
    )
    beam = result.beams[0]
    expected = sequence_log_prob(tiny_loaded, request.prompt_ids, beam.tokens)
    assert beam.cum_log_prob == pytest.approx(expected, abs=1e-3)


def test_an_end_id_ends_a_sequence(batch_forward, tiny_loaded):
    prompt = (6, 5, 4)
    (free,) = generate_batch(
        tiny_loaded,
        [GenerationRequest(prompt, 8)],
        1,
        forward=batch_forward_for(tiny_loaded, batch_forward),
    )
    end = free.beams[0].tokens[3]
    first = free.beams[0].tokens.index(end)
    request = GenerationRequest(prompt, 8, end_ids=frozenset({end}))
    (ended,) = generate_batch(
        tiny_loaded, [request], 1, forward=batch_forward_for(tiny_loaded, batch_forward)
    )
    assert ended.beams[0].tokens == free.beams[0].tokens[: first + 1]


@pytest.mark.parametrize(
    "bad, message",
    [
        (GenerationRequest((), 4), "input_ids is empty"),
        (GenerationRequest((1, 10**9), 4), "input_ids must be in [0, "),
        (GenerationRequest((1, -3), 4), "input_ids must be in [0, "),
        (GenerationRequest((1, 2), 4, beam_width=MAX_BEAM + 1), "beam_width must be in [1, 4]"),
        (GenerationRequest((1, 2), 255), "exceed the model's context of 256"),
        (GenerationRequest((1, 2), 4, end_ids=frozenset({10**9})), "end_id must be in [0, "),
    ],
)
def test_a_bad_request_fails_alone(batch_forward, tiny_loaded, bad, message):
    """Its own InvalidRequest with a clear message; the rest of the batch is served as usual."""
    good = mixed_batch()
    results = generate_batch(
        tiny_loaded,
        [good[0], bad, good[1]],
        MAX_BEAM,
        forward=batch_forward_for(tiny_loaded, batch_forward),
    )
    assert isinstance(results[1], InvalidRequest)
    assert message in str(results[1])
    clean = generate_batch(
        tiny_loaded,
        [good[0], good[1]],
        MAX_BEAM,
        forward=batch_forward_for(tiny_loaded, batch_forward),
    )
    assert [r.beams for r in (results[0], results[2])] == [r.beams for r in clean]
