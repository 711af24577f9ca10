"""Batched non-streaming generation (streaming_backend.dialogue.generation) on the tiny model."""

from __future__ import annotations

import pytest
from conftest import generate, save_tiny_model, sequence_log_prob

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.dialogue.generation import GenerationRequest, Generator
from streaming_backend.errors import InvalidRequest, StreamingError
from streaming_backend.model.loading import load_model
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
    batch = generate(tiny_loaded, batch_forward, mixed_batch(), MAX_BEAM)
    for request, together in zip(mixed_batch(), batch):
        (alone,) = generate(tiny_loaded, batch_forward, [request], MAX_BEAM)
        assert [b.tokens for b in together.beams] == [b.tokens for b in alone.beams]
        for a, b in zip(together.beams, alone.beams):
            assert a.cum_log_prob == pytest.approx(b.cum_log_prob, abs=1e-3)


def test_lengths_and_widths_are_kept(batch_forward, tiny_loaded):
    results = generate(tiny_loaded, batch_forward, mixed_batch(), MAX_BEAM)
    for request, result in zip(mixed_batch(), results):
        assert len(result.beams) == request.beam_width
        assert all(1 <= len(b.tokens) <= request.max_new_tokens for b in result.beams)


def test_greedy_is_deterministic(batch_forward, tiny_loaded):
    request = GenerationRequest((3, 1, 4, 1, 5), 10)
    first = generate(tiny_loaded, batch_forward, [request], 1)[0].beams[0].tokens
    second = generate(tiny_loaded, batch_forward, [request, request], 1)[1].beams[0].tokens
    assert first == second and len(first) == 10


def test_a_seed_reproduces_sampled_output(batch_forward, tiny_loaded):
    """The same seed gives the same tokens, alone or beside other requests; another seed differs."""
    prompt = (2, 7, 1, 8)
    one = GenerationRequest(prompt, 12, settings=sampled(42))
    (alone,) = generate(tiny_loaded, batch_forward, [one], 1)
    _, beside, _ = generate(
        tiny_loaded,
        batch_forward,
        [GenerationRequest(prompt, 5, settings=sampled(1)), one, GenerationRequest(prompt, 3)],
        1,
    )
    other = generate(
        tiny_loaded, batch_forward, [GenerationRequest(prompt, 12, settings=sampled(43))], 1
    )
    assert alone.beams[0].tokens == beside.beams[0].tokens
    assert alone.beams[0].tokens != other[0].beams[0].tokens


def test_sampled_cum_log_probs_are_the_models(batch_forward, tiny_loaded):
    """cum_log_probs of a sampled sequence: its log-probability under the model's raw logits."""
    request = GenerationRequest((4, 4, 4), 6, settings=sampled(9))
    (result,) = generate(tiny_loaded, batch_forward, [request], 1)
    beam = result.beams[0]
    expected = sequence_log_prob(tiny_loaded, request.prompt_ids, beam.tokens)
    assert beam.cum_log_prob == pytest.approx(expected, abs=1e-3)


def test_an_end_id_ends_a_sequence(batch_forward, tiny_loaded):
    prompt = (6, 5, 4)
    (free,) = generate(tiny_loaded, batch_forward, [GenerationRequest(prompt, 8)], 1)
    end = free.beams[0].tokens[3]
    first = free.beams[0].tokens.index(end)
    request = GenerationRequest(prompt, 8, end_ids=frozenset({end}))
    (ended,) = generate(tiny_loaded, batch_forward, [request], 1)
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
    results = generate(tiny_loaded, batch_forward, [good[0], bad, good[1]], MAX_BEAM)
    assert isinstance(results[1], InvalidRequest)
    assert message in str(results[1])
    clean = generate(tiny_loaded, batch_forward, [good[0], good[1]], MAX_BEAM)
    assert [r.beams for r in (results[0], results[2])] == [r.beams for r in clean]


def compact(loaded, max_beam_width=MAX_BEAM, **config):
    """A generator of its own on the unquantized compact forward (its own prefix cache)."""
    config = EngineConfig(forward="compact", quantize="none", **config)
    return Generator(loaded, config, max_beam_width)


def spy_prefill(generator) -> list[list[int]]:
    """Record the prompt tokens of each prefill call's chunks."""
    calls, prefill = [], generator.steps.forward.prefill

    def recorded(chunks):
        calls.append([len(chunk.tokens) for chunk in chunks])
        return prefill(chunks)

    generator.steps.forward.prefill = recorded
    return calls


def test_requests_beyond_the_room_wait_and_join_as_rows_free(tiny_loaded):
    """With room for 4 rows, the 8 rows of the mixed batch run in turns, never more than 4 at
    once; each request gets exactly what it gets alone."""
    small = compact(tiny_loaded, max_streams=4)
    decode, widest = small.steps.decode, []

    def counted():
        widest.append(len(small.steps.live()))
        return decode()

    small.steps.decode = counted
    together = small.generate(mixed_batch())
    assert max(widest) == 4
    for request, result in zip(mixed_batch(), together):
        (alone,) = compact(tiny_loaded).generate([request])
        assert result.beams == alone.beams


def test_a_beam_search_wider_than_the_room_fails_alone(tiny_loaded):
    """A request whose beams can never fit gets its own error naming the cache; the others
    are served."""
    small = compact(tiny_loaded, max_streams=2)
    wide, narrow = GenerationRequest((1, 2), 4, beam_width=3), GenerationRequest((3, 4), 4)
    failed, served = small.generate([wide, narrow])
    assert isinstance(failed, StreamingError)
    assert "beam_width 3 needs 3 rows" in str(failed) and "kv_cache_memory" in str(failed)
    assert served.beams == compact(tiny_loaded).generate([narrow])[0].beams


def test_a_repeated_prompt_is_prefilled_from_the_prefix_cache(tiny_loaded):
    """A later request with an earlier one's prompt prefills only its last token, from an ended
    request's KV or a live row's, and gets the same answer."""
    generator = compact(tiny_loaded)
    prompt = tuple(range(30, 70))
    (first,) = generator.generate([GenerationRequest(prompt, 6, beam_width=2)])
    calls = spy_prefill(generator)
    again, beside = generator.generate(
        [GenerationRequest(prompt, 6, beam_width=2), GenerationRequest(prompt, 6)]
    )
    assert calls == [[1, 1]]
    assert again.beams == first.beams
    assert beside.beams == compact(tiny_loaded).generate([GenerationRequest(prompt, 6)])[0].beams


def test_a_prompt_joining_running_rows_is_prefilled_in_chunks(tiny_loaded):
    """A request that joins while others decode is prefilled prefill_chunk_tokens at a time,
    and its tokens are those of a whole prefill."""
    generator = compact(tiny_loaded, max_streams=2, prefill_chunk_tokens=4, prefix_cache="off")
    calls = spy_prefill(generator)
    short = GenerationRequest((5, 6), 2)
    running = GenerationRequest((7, 8, 9), 12, settings=sampled(3))
    joining = GenerationRequest(tuple(range(40, 70)), 6)
    results = generator.generate([short, running, joining])
    assert calls[0] == [2, 3]  # nothing decodes yet: both prompts whole
    assert [4] in calls  # the joining prompt, beside the running row
    for request, result in zip((short, running, joining), results):
        (alone,) = compact(tiny_loaded, prefix_cache="off").generate([request])
        assert result.beams == alone.beams


@pytest.fixture(scope="module")
def long_loaded(tmp_path_factory, default_model_dir):
    """The tiny model with a context of 2048 positions."""
    path = tmp_path_factory.mktemp("tiny-2048")
    return load_model(str(save_tiny_model(path, default_model_dir, context=2048)), "float32", "cpu")


def test_slots_are_cut_to_fit_the_batch(long_loaded):
    """In a budget of 4 slots of the whole context, a batch of 8 rows gets slots of its longest
    request rounded up to 256 positions (32 of them), and a longer request then gets longer
    ones; each request's tokens are those it gets alone."""
    generator = compact(long_loaded, kv_cache_memory="5MiB", max_streams=16)
    cache = generator.steps.cache
    assert (cache.slots, cache.max_len) == (4, 2048)  # 1 MiB a slot, and the scratch slot
    together = generator.generate(mixed_batch())
    assert (generator.steps.cache.slots, generator.steps.cache.max_len) == (32, 256)
    long = GenerationRequest(tuple(range(1, 300)), 12, beam_width=2)
    (longer,) = generator.generate([long])
    assert generator.steps.cache.max_len == 512
    for request, result in zip([*mixed_batch(), long], [*together, longer]):
        (alone,) = compact(long_loaded).generate([request])
        assert result.beams == alone.beams
