"""The dialogue model speculates for sampled and greedy requests and keeps their answers: with
drafts from the context (n-grams) or from a draft model (the tiny model itself, whose greedy
drafts are all right), every request's beams (tokens, cumulative log-probs, scores) are those of
speculative=off, alone and in a mixed batch; beam search of width 2 and more drafts nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import save_tiny_model

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.dialogue.generation import GenerationRequest, Generator
from streaming_backend.model.loading import load_model
from streaming_backend.sampling.settings import SamplingSettings

LOOPING = tuple([(37 * i) % 700 + 100 for i in range(15)] * 4)  # its own n-grams draft
OTHER = tuple((53 * i) % 900 + 40 for i in range(30))


def _sampled(seed, **kw) -> SamplingSettings:
    return SamplingSettings(temperature=0.9, top_p=0.95, seed=seed, **kw)


REQUESTS = {
    "greedy": GenerationRequest(LOOPING, 30),
    "greedy_other": GenerationRequest(OTHER, 24),
    "sampled": GenerationRequest(LOOPING, 30, settings=_sampled(5)),
    "penalty": GenerationRequest(OTHER, 20, settings=_sampled(6, repetition_penalty=1.3)),
    "min_tokens": GenerationRequest(LOOPING, 20, settings=_sampled(7, min_tokens=15)),
    "length_penalty": GenerationRequest(LOOPING, 16, length_penalty=0.5),
    "beams": GenerationRequest(LOOPING, 12, beam_width=3),
    "one_token": GenerationRequest(OTHER, 1),
}


def _beams(result):
    return [(b.tokens, b.cum_log_prob, b.score) for b in result.beams]


def _generator(loaded, speculative="off", draft=None) -> Generator:
    config = EngineConfig(
        forward="compact",
        quantize="none",
        max_streams=32,
        speculative=speculative,
        draft_model=draft and str(draft),
    )
    return Generator(loaded, config, max_beam_width=4)


@pytest.fixture(scope="module")
def plain(tiny_loaded):
    """Each request's beams without speculation, alone."""
    generator = _generator(tiny_loaded)
    return {name: _beams(generator.generate([r])[0]) for name, r in REQUESTS.items()}


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_each_request_alone_gets_plain_decodings_beams(tiny_loaded, tiny_model_dir, plain, mode):
    """One request at a time: the same beams as without speculation; drafts were verified (with
    the model as its own draft, a greedy request's drafts are all accepted)."""
    generator = _generator(tiny_loaded, mode, tiny_model_dir if mode == "draft" else None)
    assert generator.speculative == mode
    counts = generator.draft_counts
    for name, request in REQUESTS.items():
        before = (counts.drafted, counts.accepted)
        assert _beams(generator.generate([request])[0]) == plain[name], name
        drafted, accepted = counts.drafted - before[0], counts.accepted - before[1]
        if name == "beams" or name == "one_token":
            assert drafted == 0, name
        elif mode == "draft" and name.startswith("greedy"):
            assert accepted == drafted > 0, name
    assert counts.drafted > 0


def test_a_mixed_batch_speculating_gets_plain_decodings_beams(tiny_loaded, tiny_model_dir, plain):
    """Every request in one call (more rows than draft, at first): each gets its alone beams."""
    generator = _generator(tiny_loaded, "draft", tiny_model_dir)
    results = generator.generate(list(REQUESTS.values()))
    assert {name: _beams(r) for name, r in zip(REQUESTS, results)} == plain
    assert generator.draft_counts.drafted > 0


def test_an_end_id_met_while_speculating_ends_there(tiny_loaded, tiny_model_dir, plain):
    """An end id a sampled answer meets past its first tokens ends the sequence at that token,
    as without speculation, while its steps verify drafts."""
    tokens = plain["sampled"][0][0]
    end = next(t for i, t in enumerate(tokens) if i >= 4 and t not in tokens[:i])
    request = replace(REQUESTS["sampled"], end_ids=frozenset({end}))
    expected = _beams(_generator(tiny_loaded).generate([request])[0])
    assert expected[0][0][-1] == end and len(expected[0][0]) < len(tokens)
    generator = _generator(tiny_loaded, "draft", tiny_model_dir)
    assert _beams(generator.generate([request])[0]) == expected
    assert generator.draft_counts.drafted > 0


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory, default_model_dir):
    """The tiny model with a context of 2048 positions (its slots get cut to fit batches)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-2048"), default_model_dir, context=2048)


def test_a_rebuild_for_longer_slots_keeps_the_draft_model(long_dir):
    """When a batch makes the steps cut their slots, and a longer request then lengthens them,
    the draft model keeps its weights (not loaded again) and gets slots as long as the
    model's; the answers stay plain decoding's."""
    loaded = load_model(str(long_dir), "float32", "cpu")
    config = dict(forward="compact", quantize="none", kv_cache_memory="5MiB", max_streams=16)
    drafting = Generator(
        loaded, EngineConfig(speculative="draft", draft_model=str(long_dir), **config), 4
    )
    plain = Generator(loaded, EngineConfig(speculative="off", **config), 4)
    short = GenerationRequest(LOOPING, 20)
    long = GenerationRequest(tuple(range(1, 300)), 12)
    batch = [replace(short, max_new_tokens=20 + i) for i in range(8)]  # more rows than slots
    assert [_beams(r) for r in drafting.generate(batch)] == [
        _beams(r) for r in plain.generate(batch)
    ]
    draft = drafting.steps.draft_model
    assert draft.cache.max_len == drafting.steps.cache.max_len == 256
    assert _beams(drafting.generate([long])[0]) == _beams(plain.generate([long])[0])
    rebuilt = drafting.steps.draft_model
    assert rebuilt is not draft and rebuilt.forward.model is draft.forward.model
    assert rebuilt.cache.max_len == drafting.steps.cache.max_len == 512
    assert drafting.draft_counts.drafted > 0
