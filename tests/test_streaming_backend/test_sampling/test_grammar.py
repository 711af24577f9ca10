"""Constrained decoding on the tiny random model: per-row masks, isolation, errors, release."""

from __future__ import annotations

import gc
import json
import re
import threading

import pytest
import torch
from conftest import wait_for

from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.errors import InvalidRequest, Overloaded
from streaming_backend.events import FinishReason
from streaming_backend.prompts import encode_prompt
from streaming_backend.sampling.grammar import GrammarCompiler, GrammarMatcher, apply_grammar_masks
from streaming_backend.sampling.settings import SamplingSettings

COLOURS = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["colour", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(params=("compact", "hf"))
def engine(tiny_loaded, request):
    # unquantized whatever `quantize auto` picks here: logprobs compare with the model's own
    config = EngineConfig(max_streams=8, queue_limit=8, forward=request.param, quantize="none")
    with Engine(tiny_loaded, config) as eng:
        yield eng


def _prompt(loaded, text: str = "Answer:") -> list[int]:
    return encode_prompt(loaded.tokenizer, text=text)


def _sampled(**keys) -> SamplingSettings:
    return SamplingSettings.parse({"temperature": 1.0, "seed": 7, "max_tokens": 60, **keys})


def test_every_kind_of_grammar_shapes_the_output(engine, tiny_loaded):
    """A random model's sampled output still matches each grammar, and ends with STOP."""
    cases = {
        "json": (_sampled(guided_json=COLOURS), lambda t: set(json.loads(t)) == {"colour", "ok"}),
        "object": (_sampled(guided_json_object=True), None),
        "regex": (_sampled(guided_regex=r"(yes|no), [0-9]{2}"), None),
        "choice": (_sampled(guided_choice=["alpha", 'be"ta']), lambda t: t in ("alpha", 'be"ta')),
        "lark": (_sampled(guided_grammar='start: "x" ("y" | "z")~2'), None),
    }
    handles = {n: engine.submit(_prompt(tiny_loaded), s) for n, (s, _) in cases.items()}
    for name, handle in handles.items():
        events = list(handle)
        text = "".join(e.text for e in events)
        check = cases[name][1]
        if name == "object":  # unbounded: a random model may still be inside it at max_tokens
            assert text.startswith("{"), text
            if events[-1].finish_reason is FinishReason.STOP:
                assert isinstance(json.loads(text), dict), text
            continue
        assert events[-1].finish_reason is FinishReason.STOP, (name, text)
        if name == "regex":
            assert re.fullmatch(r"(yes|no), [0-9]{2}", text), text
        elif name == "lark":
            assert re.fullmatch(r"x[yz]{2}", text), text
        else:
            assert check(text), (name, text)


def test_rows_with_and_without_a_grammar_share_a_batch(engine, tiny_loaded):
    """An unconstrained greedy row gives the same tokens beside constrained rows as alone."""
    free = SamplingSettings(temperature=0, max_tokens=16, ignore_eos=True)
    alone = list(engine.submit(_prompt(tiny_loaded, "Hello"), free))
    constrained = [engine.submit(_prompt(tiny_loaded), _sampled(guided_json=COLOURS))]
    beside = engine.submit(_prompt(tiny_loaded, "Hello"), free)
    constrained.append(engine.submit(_prompt(tiny_loaded), _sampled(guided_regex="[ab]{30}")))
    assert [e.token_ids for e in beside] == [e.token_ids for e in alone]
    texts = ["".join(e.text for e in h) for h in constrained]
    assert set(json.loads(texts[0])) == {"colour", "ok"}
    assert re.fullmatch("[ab]{30}", texts[1])


def test_a_bad_grammar_fails_its_request_alone(engine, tiny_loaded):
    """A schema, regex or grammar that does not compile is an InvalidRequest naming the key."""
    bad = {
        "guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
        "guided_regex": "(unclosed",
        "guided_grammar": "start: (",
    }
    for key, value in bad.items():
        with pytest.raises(InvalidRequest, match=f"sampling_parameters.{key}"):
            engine.submit(_prompt(tiny_loaded), _sampled(**{key: value}))
    assert engine.submit(_prompt(tiny_loaded), _sampled(guided_choice=["ok"])).text() == "ok"


def test_cancelling_a_constrained_stream_frees_its_slot_and_matcher(engine, tiny_loaded):
    """A cancelled constrained stream ends CANCELLED and its matcher is released."""
    before = GrammarMatcher.live
    settings = SamplingSettings.parse({"guided_regex": "[a-z ]{200}", "max_tokens": 200})
    handle = engine.submit(_prompt(tiny_loaded), settings)
    events = iter(handle)
    next(events)
    assert GrammarMatcher.live == before + 1
    handle.cancel()
    assert list(events)[-1].finish_reason is FinishReason.CANCELLED
    wait_for(lambda: engine.live_streams == 0)
    assert GrammarMatcher.live == before


def test_eos_is_masked_until_the_grammar_accepts(tiny_loaded):
    """Logits that favour EOS above all: the mask forbids it until the grammar is complete, and
    allows it (and only it) once nothing else may follow."""
    tokenizer, eos = tiny_loaded.tokenizer, min(tiny_loaded.eos_ids)
    vocab = int(tiny_loaded.model.get_input_embeddings().weight.shape[0])
    compiler = GrammarCompiler(tokenizer, vocab, tiny_loaded.eos_ids)
    matcher = compiler.matcher(SamplingSettings.parse({"guided_regex": "ab(cd)?"}))
    text = [tokenizer.convert_tokens_to_ids(c) for c in "abcd"]  # one token per letter
    chosen = []
    for step in range(len(text) + 1):
        logits = torch.zeros(1, vocab)
        logits[0, eos] = 100.0  # the model would rather stop here, at every step
        assert apply_grammar_masks(logits, [matcher]) == {}
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        if step < 2:  # "", "a": not a match yet
            assert eos not in allowed, step
        elif step == 2:  # "ab" matches, and "abcd" would too: EOS or more
            assert eos in allowed and text[step] in allowed
        if step == len(text):  # "abcd": complete, only EOS may follow
            assert allowed == [eos]
            break
        assert text[step] in allowed
        assert matcher.accept(text[step])
        chosen.append(text[step])
    assert tokenizer.decode(chosen) == "abcd"
    assert matcher.accept(eos) and matcher.done
    matcher.release()


def test_masks_cost_nothing_without_grammars():
    """All-None matchers leave the logits untouched (the same tensor, same values)."""
    logits = torch.randn(3, 10)
    copy = logits.clone()
    assert apply_grammar_masks(logits, [None, None, None]) == {}
    assert torch.equal(logits, copy)


def test_a_failing_mask_ends_its_stream_alone(tiny_loaded, monkeypatch):
    """A grammar mask that cannot be made (llguidance failing mid-stream) ends that stream with
    the error; a constrained and a free row in the same batch go on to their ends."""
    from streaming_backend.sampling import grammar

    real, poisoned = grammar.allowed_tokens, set()

    def failing(matchers, vocab_size):
        if any(id(m) in poisoned for m in matchers):
            raise RuntimeError("llguidance broke")
        return real(matchers, vocab_size)

    monkeypatch.setattr(grammar, "allowed_tokens", failing)
    config = EngineConfig(max_streams=8, queue_limit=8, test_token_delay_s=0.02)  # they overlap
    constrained = SamplingSettings.parse({"guided_regex": "[a-z]{40}", "max_tokens": 40})
    free = SamplingSettings(max_tokens=40, ignore_eos=True)
    with Engine(tiny_loaded, config) as engine:
        victim = engine.submit(_prompt(tiny_loaded), constrained)
        other = engine.submit(_prompt(tiny_loaded), constrained)
        unconstrained = engine.submit(_prompt(tiny_loaded, "Hello"), free)
        wait_for(lambda: engine.live_streams == 3)
        (stream,) = [s for s in engine._steps.live() if s.handle is victim]
        # admitted is not yet decoding: poisoned before its first token, it would end with none
        wait_for(lambda: len(stream.output_ids) >= 1)
        poisoned.add(id(stream.grammar))
        events = list(victim)
        assert events[-1].finish_reason is FinishReason.ERROR
        assert 0 < events[-1].num_output_tokens < 40
        assert "token mask failed: llguidance broke" in str(events[-1].error)
        assert re.fullmatch("[a-z]{40}", other.text())
        assert [e.finish_reason for e in unconstrained][-1] is FinishReason.LENGTH
        wait_for(lambda: engine.live_streams == 0)


@pytest.mark.parametrize("forward", ("compact", "hf"))
def test_masks_filled_ahead_give_the_same_streams(tiny_loaded, monkeypatch, forward):
    """With the next masks filled on the worker while the forward runs, seeded constrained and
    free rows in one batch produce exactly what they produce with masks filled after it; and
    the masks were filled on the worker."""
    from streaming_backend.sampling import grammar

    real, threads = grammar.allowed_tokens, []

    def recording(matchers, vocab_size):
        threads.append(threading.current_thread().name)
        return real(matchers, vocab_size)

    monkeypatch.setattr(grammar, "allowed_tokens", recording)
    requests = [
        (_prompt(tiny_loaded), _sampled(guided_json=COLOURS)),
        (_prompt(tiny_loaded), _sampled(guided_regex="[ab]{20}", seed=2)),
        (_prompt(tiny_loaded, "Hello"), _sampled(max_tokens=20, seed=3)),
    ]
    outputs = {}
    for ahead in (False, True):
        config = EngineConfig(max_streams=8, queue_limit=8, forward=forward)
        with Engine(tiny_loaded, config) as engine:
            engine.mask_ahead = ahead
            handles = [engine.submit(prompt, settings) for prompt, settings in requests]
            outputs[ahead] = [[e.token_ids for e in h] for h in handles]
    assert outputs[True] == outputs[False]
    assert any(name.startswith("grammar-masks") for name in threads)


def test_top_logprobs_are_sorted_and_the_models_log_softmax(engine, tiny_loaded):
    """top_logprobs: k alternatives, best first, equal to the model's log-softmax."""
    prompt = _prompt(tiny_loaded, "Hello there")
    settings = SamplingSettings(temperature=0, max_tokens=3, ignore_eos=True, top_logprobs=5)
    events = list(engine.submit(prompt, settings, logprobs=True))
    ids = list(prompt)
    model = tiny_loaded.model
    for event in events:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        expected = torch.log_softmax(logits, -1)
        (detail,) = event.logprob_details
        top = detail.top
        assert len(top) == 5
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        for t in top:
            assert t.logprob == pytest.approx(expected[t.token_id].item(), abs=1e-3)
            assert t.token == tiny_loaded.tokenizer.decode([t.token_id])
        assert top[0].token_id == event.token_ids[0]  # greedy: the chosen one is the best
        assert detail.chosen.logprob == pytest.approx(expected.max().item(), abs=1e-3)
        ids.append(event.token_ids[0])


def test_settings_take_one_grammar_and_bounded_top_logprobs():
    """Two guided keys, top_logprobs over 20, a non-schema: clear InvalidRequest messages."""
    with pytest.raises(InvalidRequest, match="at most one of"):
        SamplingSettings.parse({"guided_regex": "a", "guided_choice": ["a"]})
    with pytest.raises(InvalidRequest, match="top_logprobs must be in"):
        SamplingSettings.parse({"top_logprobs": 50})
    with pytest.raises(InvalidRequest, match="guided_json must be a JSON schema"):
        SamplingSettings.parse({"guided_json": "[1, 2]"})
    with pytest.raises(InvalidRequest, match="guided_choice"):
        SamplingSettings.parse({"guided_choice": []})
    parsed = SamplingSettings.parse({"guided_json": '{"type": "object"}'})
    assert (
        parsed.guided_json
        == SamplingSettings.parse({"guided_json": {"type": "object"}}).guided_json
    )
    assert parsed.constrained and not SamplingSettings().constrained


def test_properties_come_in_the_schemas_order(engine, tiny_loaded):
    """The schema's key order is the answer's (settings keep it; nothing sorts the keys)."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"enum": [1, 2]}, "alpha": {"enum": ["x", "y"]}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    text = engine.submit(_prompt(tiny_loaded), _sampled(guided_json=schema)).text()
    assert list(json.loads(text)) == ["zeta", "alpha"]


def test_a_refused_constrained_request_keeps_no_matcher(tiny_loaded):
    """A request refused at submit (queue full) leaves no live matcher behind."""
    before = GrammarMatcher.live
    config = EngineConfig(max_streams=1, queue_limit=0)  # every submit is refused
    with Engine(tiny_loaded, config) as engine:
        with pytest.raises(Overloaded) as refused:
            engine.submit(_prompt(tiny_loaded), _sampled(guided_choice=["a"]))
        del refused  # its traceback holds the refused stream
        gc.collect()
    assert GrammarMatcher.live == before
