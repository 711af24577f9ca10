"""Speculative decoding keeps the answer: whatever the drafts (all right, partly right, random or
the context's own n-grams), every stream's events are those of plain decoding, token for token,
text, logprobs, counts and finish reason, greedy and seeded, with stop strings, EOS, max_tokens,
min_tokens, a repetition penalty, a grammar and several streams at once; cancellation still ends
a stream that speculates, and the steps keep no KV of a rejected draft."""

from __future__ import annotations

import dataclasses
import random

import pytest
from conftest import cancel_after

from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.events import FinishReason
from streaming_backend.prompts import encode_prompt
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.steps import drafts as drafts_module
from streaming_backend.steps import slots as slots_module
from streaming_backend.steps.drafts import Drafter

PROMPT = [(37 * i) % 700 + 100 for i in range(60)]
OTHER = [(53 * i) % 900 + 40 for i in range(45)]
GREEDY = SamplingSettings(temperature=0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingSettings(temperature=1.0, seed=11, top_p=0.9, max_tokens=40, ignore_eos=True)
CASES = {
    "greedy": GREEDY,
    "seeded": SEEDED,
    "seeded_top_k": SamplingSettings(temperature=0.7, seed=5, top_k=20, max_tokens=40),
    "penalty": SamplingSettings(temperature=0.9, seed=3, repetition_penalty=1.3, max_tokens=30),
    "min_tokens": SamplingSettings(temperature=1.0, seed=9, min_tokens=20, max_tokens=30),
    "logprobs": SamplingSettings(temperature=0.8, seed=2, top_logprobs=4, max_tokens=30),
    "grammar": SamplingSettings.parse(
        {"guided_regex": "[a-z]{3,20}( [a-z]{2,9}){2,5}", "max_tokens": 40, "seed": 1}
    ),
    "max_tokens_1": SamplingSettings(temperature=0, max_tokens=1),
}


def _events(engine, prompt, settings):
    """A request's events without their times (which differ run to run)."""
    return [
        (e.text, e.token_ids, e.num_output_tokens, e.num_input_tokens, e.cached_tokens,
         e.logprobs, e.logprob_details, e.finish_reason, e.error)
        for e in engine.submit(prompt, settings, logprobs=True)
    ]  # fmt: skip


def _engine(loaded, speculative="ngram", **config):
    return Engine(loaded, EngineConfig(forward="compact", speculative=speculative, **config))


def _plain(loaded, requests):
    """Each (prompt, settings)'s events without speculation, each alone on a fresh engine."""
    plain = []
    for prompt, settings in requests:
        with _engine(loaded, "off") as engine:
            plain.append(_events(engine, prompt, settings))
    return plain


def _uncached(events):
    """Events without cached_tokens (which depends on what ran before, not on speculation)."""
    return [(*event[:4], *event[5:]) for event in events]


class ScriptedDrafter(Drafter):
    """Drafts from a known answer: all right, partly right (one wrong token), or random ids."""

    answers: dict[tuple[int, ...], list[int]] = {}
    kind = "right"

    def propose(self, prompt, output, room):
        self.observe(prompt, output)
        rng = random.Random(len(output))
        answer = self.answers[tuple(prompt)]
        draft = answer[len(output) : len(output) + min(room, 6)]
        if self.kind == "random":
            draft = [rng.randrange(50, 40000) for _ in draft]
        elif self.kind == "partly" and draft:
            at = rng.randrange(len(draft))
            draft[at] = (draft[at] + 1) % 40000
        self._last, self._seen = draft, len(output)
        return draft


def _tokens(events) -> list[int]:
    return [t for event in events for t in event[1]]


@pytest.mark.parametrize("kind", ["right", "partly", "random"])
def test_scripted_drafts_give_plain_decodings_events(tiny_loaded, monkeypatch, kind):
    """Drafts all right, partly right or random: every case's events are plain decoding's, and
    all-right drafts are accepted (the steps verified them, so the run really speculated)."""
    requests = [(PROMPT, settings) for settings in CASES.values()]
    plain = _plain(tiny_loaded, requests)
    answers = {tuple(PROMPT): None}
    monkeypatch.setattr(slots_module, "Drafter", ScriptedDrafter)
    monkeypatch.setattr(ScriptedDrafter, "kind", kind)
    for (prompt, settings), expected in zip(requests, plain):
        answers = {tuple(prompt): _tokens(expected)}
        monkeypatch.setattr(ScriptedDrafter, "answers", answers)
        with _engine(tiny_loaded) as engine:
            got = _events(engine, prompt, settings)
            counts = engine.draft_counts
        assert got == expected, settings
        assert all(len(event[1]) == 1 for event in got)  # one event a token
        if kind == "right" and settings.max_tokens > 1:
            assert counts.accepted == counts.drafted > 0
        if kind == "random" and settings.max_tokens > 1:
            assert counts.drafted > 0


def test_context_drafts_give_the_same_events_for_streams_together(tiny_loaded):
    """n-gram drafts from the context, 3 seeded streams (as n=3 asks) and a greedy one in one
    batch, one prompt repeating itself so that drafts are found: plain decoding's events."""
    looping = PROMPT[:20] * 4
    requests = [(looping, GREEDY)] + [
        (OTHER, SamplingSettings(temperature=1.0, seed=100 + i, max_tokens=40)) for i in range(3)
    ]
    plain = _plain(tiny_loaded, requests)
    with _engine(tiny_loaded) as engine:
        handles = [engine.submit(p, s, logprobs=True) for p, s in requests]
        got = [
            [(e.text, e.token_ids, e.num_output_tokens, e.num_input_tokens, e.cached_tokens,
              e.logprobs, e.logprob_details, e.finish_reason, e.error) for e in h]
            for h in handles
        ]  # fmt: skip
        assert engine.draft_counts.drafted > 0
    assert [_uncached(g) for g in got] == [_uncached(p) for p in plain]


def test_a_stop_string_inside_an_accepted_draft_ends_the_stream_there(tiny_loaded, monkeypatch):
    """A stop string met within a run of accepted drafts ends the stream at the same token, with
    the same text held back, as plain decoding."""
    prompt = encode_prompt(tiny_loaded.tokenizer, messages=[{"role": "user", "content": "Hi"}])
    settings = SamplingSettings(temperature=0, max_tokens=40, ignore_eos=True)
    [reference] = _plain(tiny_loaded, [(prompt, settings)])
    text = "".join(event[0] for event in reference)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = SamplingSettings(temperature=0, max_tokens=40, ignore_eos=True, stop=(stop,))
    [expected] = _plain(tiny_loaded, [(prompt, stopped)])
    assert expected[-1][7] is FinishReason.STOP
    monkeypatch.setattr(slots_module, "Drafter", ScriptedDrafter)
    monkeypatch.setattr(ScriptedDrafter, "answers", {tuple(prompt): _tokens(reference)})
    with _engine(tiny_loaded) as engine:
        assert _events(engine, prompt, stopped) == expected
        assert engine.draft_counts.accepted > 0


def test_eos_inside_an_accepted_draft_ends_the_stream_there(tiny_loaded, monkeypatch):
    """An EOS met within a run of accepted drafts ends the stream with STOP at that token, as
    plain decoding: a seeded answer's token new to it after its 3rd is made the model's EOS,
    and the drafts run past it."""
    [reference] = _plain(tiny_loaded, [(PROMPT, SEEDED)])
    answer = _tokens(reference)
    at = next(i for i in range(3, len(answer)) if answer[i] not in answer[:i])
    loaded = dataclasses.replace(tiny_loaded, eos_ids=frozenset({answer[at]}))
    settings = dataclasses.replace(SEEDED, ignore_eos=False)
    [expected] = _plain(loaded, [(PROMPT, settings)])
    assert expected[-1][7] is FinishReason.STOP and len(expected) == at + 1
    monkeypatch.setattr(slots_module, "Drafter", ScriptedDrafter)
    monkeypatch.setattr(ScriptedDrafter, "answers", {tuple(PROMPT): answer})
    with _engine(loaded) as engine:
        assert _events(engine, PROMPT, settings) == expected
        assert engine.draft_counts.accepted > 0


def test_a_request_can_turn_speculation_off(tiny_loaded, monkeypatch):
    """speculate=false: the steps draft nothing for that request."""
    monkeypatch.setattr(slots_module, "Drafter", ScriptedDrafter)
    [reference] = _plain(tiny_loaded, [(PROMPT, GREEDY)])
    monkeypatch.setattr(ScriptedDrafter, "answers", {tuple(PROMPT): _tokens(reference)})
    off = SamplingSettings.parse({"temperature": 0, "max_tokens": 40, "speculate": "false"})
    with _engine(tiny_loaded) as engine:
        assert _tokens(_events(engine, PROMPT, off)) == _tokens(reference)
        assert engine.draft_counts.drafted == 0


def test_speculative_off_drafts_nothing(tiny_loaded):
    """--speculative off: no drafter runs, the steps are today's decode steps."""
    with _engine(tiny_loaded, "off") as engine:
        _events(engine, PROMPT[:20] * 4, GREEDY)
        assert engine.speculative == "off" and engine.draft_counts.drafted == 0


def test_a_full_batch_drafts_nothing(tiny_loaded, monkeypatch):
    """More decoding rows than MAX_DRAFTING_ROWS: no row drafts (speculation backs off)."""
    monkeypatch.setattr(slots_module, "MAX_DRAFTING_ROWS", 0)
    with _engine(tiny_loaded) as engine:
        _events(engine, PROMPT[:20] * 4, GREEDY)
        assert engine.draft_counts.drafted == 0


def test_rejected_drafts_leave_no_kv(tiny_loaded, monkeypatch):
    """After every step the slot holds the context but the newest token, as plain decoding
    leaves it: a follow-up turn reusing the slot gets plain decoding's answer."""
    monkeypatch.setattr(slots_module, "Drafter", ScriptedDrafter)
    monkeypatch.setattr(ScriptedDrafter, "kind", "partly")
    [reference] = _plain(tiny_loaded, [(PROMPT, GREEDY)])
    monkeypatch.setattr(ScriptedDrafter, "answers", {tuple(PROMPT): _tokens(reference)})
    follow_up = PROMPT + _tokens(reference) + [1100, 1101]
    [expected] = _plain(tiny_loaded, [(follow_up, GREEDY)])
    with _engine(tiny_loaded) as engine:
        _events(engine, PROMPT, GREEDY)
        got = _events(engine, follow_up, dataclasses.replace(GREEDY, speculate=False))
    assert got[0][4] == len(follow_up) - 3  # the first turn's KV, its last token's excepted
    assert [e[:4] for e in got] == [e[:4] for e in expected]


def test_cancel_ends_a_speculating_stream(tiny_loaded):
    """A stream that drafts still ends with one CANCELLED event when cancelled mid-answer."""
    with _engine(tiny_loaded) as engine:
        settings = SamplingSettings(temperature=0, max_tokens=150, ignore_eos=True)
        events = cancel_after(engine.submit(PROMPT[:20] * 4, settings), 5)
        assert events[-1].finish_reason is FinishReason.CANCELLED
        assert sum(e.finish_reason is not None for e in events) == 1
        assert engine.draft_counts.drafted > 0


def test_modes_are_checked():
    """An unknown --speculative value is refused, naming the choices."""
    with pytest.raises(ValueError, match="auto, off, ngram"):
        drafts_module.resolve_mode("eagle", "cpu")
    assert drafts_module.resolve_mode("off", "cpu") == "off"
    assert drafts_module.resolve_mode("ngram", "cuda") == "ngram"


def test_the_fingerprint_does_not_change_with_speculation(tiny_loaded):
    """system_fingerprint names the numerics, which speculation does not change."""
    with _engine(tiny_loaded, "off") as plain, _engine(tiny_loaded, "ngram") as speculating:
        assert speculating.speculative == "ngram"
        assert plain.numerics.fingerprint == speculating.numerics.fingerprint


def test_auto_speculates_on_a_cpu_but_not_under_test_delays(tiny_loaded):
    """auto is ngram on a CPU (measured: docs/configuration.md); test pacing delays, which
    promise one token a step, turn it off."""
    with _engine(tiny_loaded, "auto") as engine:
        assert engine.speculative == "ngram"
    with _engine(tiny_loaded, "auto", test_token_delay_s=0.001) as engine:
        assert engine.speculative == "off"
        _events(engine, PROMPT[:20] * 4, GREEDY)
        assert engine.draft_counts.drafted == 0
