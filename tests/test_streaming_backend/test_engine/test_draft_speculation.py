"""Speculative decoding with a draft model keeps the answer: with a draft model that is the
model itself (every greedy draft right) or cut from it (a first layer only: drafts partly
right), every stream's events are plain decoding's, token for token, text, logprobs, counts and
finish reason: greedy and seeded, stop strings, max_tokens, a grammar, logprobs, several
streams at once; cancellation ends a drafting stream; the draft model's slots are freed when
streams end. A draft model with another vocabulary is refused at load, naming what differs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import cancel_after, save_other_vocabulary

from streaming_backend.configuration.models import SPECULATIVE_MODES, check_parameters
from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.events import FinishReason
from streaming_backend.prompts import encode_prompt
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.steps import draft_model as draft_model_module
from streaming_backend.steps import drafts
from streaming_backend.steps import slots as slots_module

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
PROMPT = [(37 * i) % 700 + 100 for i in range(60)]
OTHER = [(53 * i) % 900 + 40 for i in range(45)]
GREEDY = SamplingSettings(temperature=0, max_tokens=40, ignore_eos=True)
CASES = {
    "greedy": GREEDY,
    "seeded": SamplingSettings(temperature=1.0, seed=11, top_p=0.9, max_tokens=40),
    "seeded_top_k": SamplingSettings(temperature=0.7, seed=5, top_k=20, max_tokens=40),
    "penalty": SamplingSettings(temperature=0.9, seed=3, repetition_penalty=1.3, max_tokens=30),
    "min_tokens": SamplingSettings(temperature=1.0, seed=9, min_tokens=20, max_tokens=30),
    "logprobs": SamplingSettings(temperature=0.8, seed=2, top_logprobs=4, max_tokens=30),
    "grammar": SamplingSettings.parse(
        {"guided_regex": "[a-z]{3,20}( [a-z]{2,9}){2,5}", "max_tokens": 40, "seed": 1}
    ),
    "max_tokens_1": SamplingSettings(temperature=0, max_tokens=1),
    "max_tokens_7": SamplingSettings(temperature=0, max_tokens=7, ignore_eos=True),
}


@pytest.fixture(scope="module")
def cut_draft_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's first layer, final norm and head: scripts/make_draft_model.py's draft."""
    spec = importlib.util.spec_from_file_location(
        "make_draft_model", SCRIPTS / "make_draft_model.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.write_draft(str(tiny_model_dir), 1, tmp_path_factory.mktemp("cut-draft"))


@pytest.fixture(scope="module")
def other_vocabulary_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with one token added to its tokenizer (and a row to its embedding)."""
    return save_other_vocabulary(tiny_model_dir, tmp_path_factory.mktemp("other-vocabulary"))


def _record(events) -> list[tuple]:
    """Events as comparable values: no times, no cached_tokens (which depend on what ran
    before on the engine, not on speculation)."""
    return [
        (e.text, e.token_ids, e.num_output_tokens, e.num_input_tokens, e.logprobs,
         e.logprob_details, e.finish_reason, e.error)
        for e in events
    ]  # fmt: skip


def _answers(engine, requests) -> list[list[tuple]]:
    """Each (prompt, settings)'s events, one request after the other."""
    return [_record(engine.submit(p, s, logprobs=True)) for p, s in requests]


def _engine(loaded, draft=None, **config) -> Engine:
    mode = "draft" if draft else "off"
    return Engine(
        loaded,
        EngineConfig(
            forward="compact", speculative=mode, draft_model=draft and str(draft), **config
        ),
    )


def _with_stop(loaded) -> tuple[list[int], SamplingSettings]:
    """A chat prompt and greedy settings with a stop string met mid-answer."""
    prompt = encode_prompt(loaded.tokenizer, messages=[{"role": "user", "content": "Hi"}])
    with _engine(loaded) as engine:
        text = "".join(e.text for e in engine.submit(prompt, GREEDY))
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    return prompt, SamplingSettings(temperature=0, max_tokens=40, ignore_eos=True, stop=(stop,))


@pytest.mark.parametrize("which", ["itself", "cut"])
def test_a_draft_models_answers_are_plain_decodings(
    tiny_loaded, cut_draft_dir, tiny_model_dir, which
):
    """Every case, one request at a time, gives plain decoding's events; the drafts were
    verified, and the model as its own draft has every greedy draft accepted."""
    draft = tiny_model_dir if which == "itself" else cut_draft_dir
    requests = [(PROMPT, settings) for settings in CASES.values()] + [_with_stop(tiny_loaded)]
    with _engine(tiny_loaded) as plain:
        expected = _answers(plain, requests)
    assert expected[-1][-1][6] is FinishReason.STOP
    with _engine(tiny_loaded, draft) as engine:
        assert engine.speculative == "draft"
        counts = engine.draft_counts
        [greedy] = _answers(engine, requests[:1])
        if which == "itself":
            assert counts.accepted == counts.drafted > 0
        got = [greedy, *_answers(engine, requests[1:])]
        assert engine.speculation_report()["drafted"] == counts.drafted > 0
        assert engine._steps.draft_model.streams == 0  # every stream's draft slot was freed
    for (_, settings), want, have in zip(requests, expected, got):
        assert have == want, settings
        assert all(len(event[1]) <= 1 for event in have)  # one event a token


def test_streams_together_with_a_draft_model(tiny_loaded, cut_draft_dir):
    """A greedy stream and 3 seeded ones (as n=3 asks) in one batch, drafting with the draft
    model: each stream's events are plain decoding's."""
    requests = [(PROMPT, GREEDY)] + [
        (OTHER, SamplingSettings(temperature=1.0, seed=100 + i, max_tokens=40)) for i in range(3)
    ]
    with _engine(tiny_loaded) as plain:
        expected = _answers(plain, requests)
    with _engine(tiny_loaded, cut_draft_dir) as engine:
        handles = [engine.submit(p, s, logprobs=True) for p, s in requests]
        got = [_record(handle) for handle in handles]
        assert engine.draft_counts.drafted > 0
    assert got == expected


def test_cancel_ends_a_stream_drafting_with_a_draft_model(tiny_loaded, tiny_model_dir):
    """A stream that drafts ends with one CANCELLED event when cancelled; its draft slot is
    freed."""
    with _engine(tiny_loaded, tiny_model_dir) as engine:
        settings = SamplingSettings(temperature=0, max_tokens=150, ignore_eos=True)
        events = cancel_after(engine.submit(PROMPT, settings), 5)
        assert events[-1].finish_reason is FinishReason.CANCELLED
        assert sum(e.finish_reason is not None for e in events) == 1
        assert engine.draft_counts.drafted > 0
        engine.submit(PROMPT[:10], SamplingSettings(max_tokens=1)).text()  # a step after it
        assert engine._steps.draft_model.streams == 0


def test_a_failing_draft_model_stops_speculation_not_streams(
    tiny_loaded, tiny_model_dir, monkeypatch
):
    """A draft model that raises: the streams go on without drafts and get plain decoding's
    answer; no draft is made after it."""
    with _engine(tiny_loaded) as plain:
        [expected] = _answers(plain, [(PROMPT, GREEDY)])

    def fail(self, requests):
        raise RuntimeError("the draft model broke")

    monkeypatch.setattr(draft_model_module.DraftModel, "propose", fail)
    with _engine(tiny_loaded, tiny_model_dir) as engine:
        assert _answers(engine, [(PROMPT, GREEDY)] * 2) == [expected, expected]
        assert engine.draft_counts.drafted == 0 and engine._steps.draft_model is None


def test_a_full_batch_drafts_nothing_with_a_draft_model(tiny_loaded, tiny_model_dir, monkeypatch):
    """More decoding rows than MAX_DRAFTING_ROWS: the draft model drafts for none."""
    monkeypatch.setattr(slots_module, "MAX_DRAFTING_ROWS", 0)
    with _engine(tiny_loaded, tiny_model_dir) as engine:
        engine.submit(PROMPT, GREEDY).text()
        assert engine.draft_counts.drafted == 0


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_loaded, other_vocabulary_dir):
    """The engine does not start with a draft model whose tokenizer is not the model's; the
    message names the draft and what differs."""
    message = r"draft model \S+ has another vocabulary than the model \S+ \(49153 tokens, not 49152"
    with pytest.raises(ValueError, match=message):
        _engine(tiny_loaded, other_vocabulary_dir)


def test_draft_mode_and_draft_model_go_together():
    """speculative=draft needs a draft_model, and a draft_model needs speculative=draft: in the
    engine's config and in serve's parameters (the other's default counts)."""
    with pytest.raises(ValueError, match="needs a draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="only with speculative=draft"):
        EngineConfig(speculative="ngram", draft_model="small")
    with pytest.raises(ValueError, match="only with speculative=draft"):
        check_parameters({"draft_model": "small"})
    with pytest.raises(ValueError, match="needs a draft_model"):
        check_parameters({"speculative": "draft"})
    check_parameters({"speculative": "draft", "draft_model": "small"})
    check_parameters({"speculative": "ngram"})
    assert SPECULATIVE_MODES == drafts.MODES  # the parameter's choices are the steps' modes
