"""The engine on a tiny random model: continuous batching, isolation, cancellation, limits."""

from __future__ import annotations

import statistics
import threading

import pytest
import torch
from conftest import wait_for

from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.errors import EngineStopped, InvalidRequest, Overloaded
from streaming_backend.events import FinishReason
from streaming_backend.prompts import encode_prompt
from streaming_backend.settings import SamplingSettings

GREEDY = SamplingSettings(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def engine(tiny_loaded):
    with Engine(tiny_loaded, EngineConfig(max_streams=8, queue_limit=8)) as eng:
        yield eng


def _prompt(loaded, text: str) -> list[int]:
    return encode_prompt(loaded.tokenizer, text=text)


def _first_event(handle):
    """Wait for a stream's first event (it is running) and return the iterator."""
    it = iter(handle)
    return next(it), it


def test_stream_emits_one_event_per_token(engine, tiny_loaded):
    """Each token is an event with its id, running count and timestamps; the last has a reason."""
    events = list(engine.submit(_prompt(tiny_loaded, "Hello there"), GREEDY))
    assert len(events) == 12
    assert [e.num_output_tokens for e in events] == list(range(1, 13))
    assert all(len(e.token_ids) == 1 for e in events)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert not any(e.final for e in events[:-1])
    first = events[0]
    assert first.submitted_ns <= first.scheduled_ns <= first.emitted_ns
    assert all(a.emitted_ns <= b.emitted_ns for a, b in zip(events, events[1:]))
    ids = [e.token_ids[0] for e in events]
    assert "".join(e.text for e in events) == tiny_loaded.tokenizer.decode(
        ids, skip_special_tokens=True
    )


def test_greedy_matches_hugging_face_generate(engine, tiny_loaded):
    """Our greedy loop picks the same tokens as transformers' own generate."""
    prompt = _prompt(tiny_loaded, "The quick brown fox")
    ours = [e.token_ids[0] for e in engine.submit(prompt, GREEDY)]
    with torch.inference_mode():
        out = tiny_loaded.model.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12
        )
    assert ours == out[0, len(prompt) :].tolist()


def test_logprobs_are_reported_when_asked(engine, tiny_loaded):
    """Each event carries the log-probability of its token, <= 0."""
    events = list(engine.submit(_prompt(tiny_loaded, "Hi"), GREEDY, logprobs=True))
    assert all(e.logprobs is not None and e.logprobs[0] <= 0 for e in events)


class RecordingEngine(Engine):
    """Records each stream's raw logits per step (test-only peek at the batch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.batch_sizes: list[int] = []

    def _process_logits(self, streams, logits):
        self.batch_sizes.append(len(streams))
        for row, stream in enumerate(streams):
            self.logits.setdefault(stream.handle.request_id, []).append(logits[row].clone())
        return super()._process_logits(streams, logits)


def test_logits_in_a_mixed_batch_match_the_stream_alone(tiny_loaded):
    """A stream joined by others of different lengths mid-flight computes the same logits."""
    prompt = _prompt(tiny_loaded, "A short one")
    settings = SamplingSettings(temperature=0, max_tokens=20, ignore_eos=True)
    with RecordingEngine(tiny_loaded) as alone:
        list(alone.submit(prompt, settings, request_id="a"))
    with RecordingEngine(tiny_loaded) as mixed:
        a = mixed.submit(prompt, settings, request_id="a")
        _, rest = _first_event(a)
        long_prompt = _prompt(tiny_loaded, "a much longer prompt " * 6)
        others = [
            mixed.submit(
                long_prompt, SamplingSettings(max_tokens=5 + i, seed=i), request_id=f"o{i}"
            )
            for i in range(3)
        ]
        list(rest)
        for other in others:
            list(other)
    assert max(mixed.batch_sizes) >= 3, "the streams never shared a batch"
    for step, (x, y) in enumerate(zip(alone.logits["a"], mixed.logits["a"], strict=True)):
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4), f"step {step} differs"


def test_a_new_request_starts_before_running_ones_finish(engine, tiny_loaded):
    """Continuous batching: a late short request finishes while a long one is still running."""
    long = engine.submit(
        _prompt(tiny_loaded, "long"), SamplingSettings(max_tokens=150, ignore_eos=True)
    )
    _, long_rest = _first_event(long)
    short = list(engine.submit(_prompt(tiny_loaded, "short"), GREEDY))
    long_events = list(long_rest)
    assert short[-1].finish_reason is FinishReason.LENGTH
    assert short[0].scheduled_ns < long_events[-1].emitted_ns
    assert short[-1].emitted_ns < long_events[-1].emitted_ns


def test_seed_reproduces_tokens_whatever_shares_the_batch(engine, tiny_loaded):
    """The same seed and settings give the same tokens, alone or beside other streams."""
    prompt = _prompt(tiny_loaded, "Tell me a story")
    settings = SamplingSettings(
        temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True
    )
    alone = [e.token_ids for e in engine.submit(prompt, settings)]
    again = [e.token_ids for e in engine.submit(prompt, settings)]
    neighbours = [
        engine.submit(
            _prompt(tiny_loaded, f"noise {i} " * (i + 1)), SamplingSettings(max_tokens=30, seed=i)
        )
        for i in range(4)
    ]
    crowded = [e.token_ids for e in engine.submit(prompt, settings)]
    for n in neighbours:
        list(n)
    other_seed = [
        e.token_ids
        for e in engine.submit(
            prompt,
            SamplingSettings(temperature=1.0, top_p=0.95, max_tokens=16, seed=99, ignore_eos=True),
        )
    ]
    assert alone == again == crowded
    assert other_seed != alone


def test_cancel_frees_the_slot(tiny_loaded):
    """A cancelled stream ends with CANCELLED within a step and its slot serves the next one."""
    with Engine(tiny_loaded, EngineConfig(max_streams=1, queue_limit=4)) as engine:
        running = engine.submit(
            _prompt(tiny_loaded, "x"), SamplingSettings(max_tokens=200, ignore_eos=True)
        )
        _, rest = _first_event(running)
        waiting = engine.submit(_prompt(tiny_loaded, "y"), GREEDY)
        running.cancel()
        tail = list(rest)
        assert tail[-1].finish_reason is FinishReason.CANCELLED
        assert tail[-1].num_output_tokens < 200
        assert list(waiting)[-1].finish_reason is FinishReason.LENGTH
        wait_for(lambda: engine.live_streams == 0 and engine._batch is None)


def test_cancel_while_waiting(tiny_loaded):
    """A request cancelled before it got a slot ends CANCELLED with no tokens."""
    with Engine(tiny_loaded, EngineConfig(max_streams=1)) as engine:
        running = engine.submit(
            _prompt(tiny_loaded, "x"), SamplingSettings(max_tokens=100, ignore_eos=True)
        )
        _first_event(running)
        waiting = engine.submit(_prompt(tiny_loaded, "y"), GREEDY)
        waiting.cancel()
        events = list(waiting)
        running.cancel()
        assert [e.finish_reason for e in events] == [FinishReason.CANCELLED]
        assert events[0].num_output_tokens == 0


def test_overload_is_reported_at_once(tiny_loaded):
    """Beyond the queue limit a submit raises Overloaded; the accepted ones still finish."""
    with Engine(tiny_loaded, EngineConfig(max_streams=1, queue_limit=1)) as engine:
        running = engine.submit(
            _prompt(tiny_loaded, "x"), SamplingSettings(max_tokens=60, ignore_eos=True)
        )
        _, rest = _first_event(running)
        queued = engine.submit(_prompt(tiny_loaded, "y"), GREEDY)
        with pytest.raises(Overloaded, match="overloaded: 1 requests are already waiting"):
            engine.submit(_prompt(tiny_loaded, "z"), GREEDY)
        assert list(rest)[-1].finish_reason is FinishReason.LENGTH
        assert list(queued)[-1].finish_reason is FinishReason.LENGTH


class FailingEngine(Engine):
    """Fails the stream named 'bad' at its third token and the prefill of 'bad-prefill'."""

    def _advance(self, stream, token, logprobs, emitted_ns):
        if stream.handle.request_id == "bad" and len(stream.output_ids) == 2:
            raise RuntimeError("boom")
        return super()._advance(stream, token, logprobs, emitted_ns)

    def _prefill(self, streams):
        if any(s.handle.request_id == "bad-prefill" for s in streams):
            raise RuntimeError("prefill boom")
        return super()._prefill(streams)


def test_one_failing_request_does_not_stop_the_others(tiny_loaded):
    """A failure in one stream (decode or prefill) ends it with an error; the rest complete."""
    with FailingEngine(tiny_loaded) as engine:
        prompt = _prompt(tiny_loaded, "hello")
        gate = threading.Event()
        handles = {
            rid: engine.submit(prompt, GREEDY, request_id=rid)
            for rid in ("ok1", "bad", "bad-prefill", "ok2")
        }
        gate.set()
        results = {rid: list(h) for rid, h in handles.items()}
        assert results["bad"][-1].finish_reason is FinishReason.ERROR
        assert "RuntimeError: boom" in str(results["bad"][-1].error)
        assert results["bad-prefill"][-1].finish_reason is FinishReason.ERROR
        assert "prefill boom" in str(results["bad-prefill"][-1].error)
        for rid in ("ok1", "ok2"):
            assert results[rid][-1].finish_reason is FinishReason.LENGTH
            assert len(results[rid]) == 12
        # and the engine still serves
        assert list(engine.submit(prompt, GREEDY))[-1].finish_reason is FinishReason.LENGTH


def test_stop_string_ends_the_stream_and_is_not_emitted(engine, tiny_loaded):
    """A stop string taken from the greedy output cuts the text right before it."""
    prompt = _prompt(tiny_loaded, "Once upon a time")
    free = list(
        engine.submit(prompt, SamplingSettings(temperature=0, max_tokens=30, ignore_eos=True))
    )
    text = "".join(e.text for e in free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip(), "greedy output too short for this test"
    events = list(
        engine.submit(
            prompt, SamplingSettings(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
        )
    )
    assert events[-1].finish_reason is FinishReason.STOP
    assert "".join(e.text for e in events) == text[: text.index(stop)]


def test_min_tokens_suppresses_eos(engine, tiny_loaded):
    """EOS cannot end a stream before min_tokens."""
    eos = next(iter(tiny_loaded.eos_ids))
    events = list(
        engine.submit(
            _prompt(tiny_loaded, "hi"), SamplingSettings(max_tokens=20, min_tokens=20, seed=3)
        )
    )
    assert len(events) == 20
    assert all(e.token_ids[0] != eos for e in events)


@pytest.mark.parametrize(
    "prompt_ids, settings, message",
    [
        ([], SamplingSettings(), "the prompt is empty"),
        ([1] * 300, SamplingSettings(), "the prompt has 300 tokens; the model's context is 256"),
        ([1] * 200, SamplingSettings(max_tokens=100), "together they exceed the model's context"),
        ([10**9], SamplingSettings(), "input_ids must be in [0, 49152)"),
    ],
)
def test_invalid_prompts_are_rejected_at_submit(engine, prompt_ids, settings, message):
    """Empty, out-of-vocabulary and over-context prompts fail with a clear message."""
    with pytest.raises(InvalidRequest) as info:
        engine.submit(prompt_ids, settings)
    assert message in str(info.value)


def test_default_max_tokens_is_bounded_by_the_context(engine, tiny_loaded):
    """Without max_tokens a long prompt still fits: generation stops at the context."""
    events = list(engine.submit([5] * 250, SamplingSettings(ignore_eos=True)))
    assert len(events) == 6 and events[-1].finish_reason is FinishReason.LENGTH


def test_shutdown_ends_streams_with_cancelled(tiny_loaded):
    """On shutdown, running and waiting streams end with CANCELLED and a shutdown error."""
    engine = Engine(tiny_loaded, EngineConfig(max_streams=1)).start()
    running = engine.submit([5, 6], SamplingSettings(max_tokens=200, ignore_eos=True))
    _, rest = _first_event(running)
    waiting = engine.submit([5, 6], GREEDY)
    engine.shutdown()
    for events in (list(rest), list(waiting)):
        assert events[-1].finish_reason is FinishReason.CANCELLED
        assert "shutting down" in str(events[-1].error)
    with pytest.raises(EngineStopped):
        engine.submit([5], GREEDY)


def test_chat_messages_use_the_chat_template(tiny_loaded):
    """Messages are rendered with the model's chat template, ready for the answer."""
    ids = encode_prompt(tiny_loaded.tokenizer, messages=[{"role": "user", "content": "hi"}])
    text = tiny_loaded.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "hi" in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "give exactly one of text_input, messages or input_ids"),
        ({"text": "a", "input_ids": [1]}, "(got text_input, input_ids)"),
        ({"text": "  "}, "text_input is empty"),
        ({"messages": "[{"}, "messages is not valid JSON"),
        ({"messages": []}, "messages must be a non-empty JSON list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
    ],
)
def test_bad_prompts_are_rejected(tiny_loaded, kwargs, message):
    """Each malformed prompt names what was wrong."""
    with pytest.raises(InvalidRequest) as info:
        encode_prompt(tiny_loaded.tokenizer, **kwargs)
    assert message in str(info.value)


def test_test_delays_pace_tokens(tiny_loaded):
    """The calibration delays put the first token at prefill + d1 and the next ones d2 apart."""
    config = EngineConfig(test_first_token_delay_s=0.2, test_token_delay_s=0.05)
    with Engine(tiny_loaded, config) as engine:
        events = list(engine.submit([5, 6, 7], SamplingSettings(max_tokens=6, ignore_eos=True)))
    first = (events[0].emitted_ns - events[0].scheduled_ns) / 1e9
    gaps = [(b.emitted_ns - a.emitted_ns) / 1e9 for a, b in zip(events, events[1:])]
    # A sleep never ends early, so the lower bounds are exact. A loaded machine stretches every
    # step (0.7 s for this first token seen with both cores busy), so the upper bounds only
    # guard against gross errors (a unit off by 1000, the delay repeated per step).
    assert 0.2 <= first < 2.0, first
    assert min(gaps) >= 0.05 and statistics.median(gaps) < 0.5, gaps


@pytest.mark.parametrize(
    "lengths, groups",
    [
        ([], []),
        ([10], [[10]]),
        ([10, 10, 10], [[10, 10, 10]]),
        ([40, 10, 11, 42, 12], [[10, 11, 12], [40, 42]]),
        ([10, 20], [[10], [20]]),  # padding 10 on 30 real tokens: over 25 %
        ([30, 31, 32, 33, 80], [[30, 31, 32, 33], [80]]),
    ],
)
def test_length_groups_bound_padding(tiny_loaded, lengths, groups):
    """Prompts are prefilled shortest first, in groups that waste little compute on padding."""
    from streaming_backend.engine import _Stream, length_groups

    streams = [
        _Stream(None, [1] * n, SamplingSettings(), False, 0, None, None, None) for n in lengths
    ]
    assert [[len(s.prompt_ids) for s in g] for g in length_groups(streams, 0.25)] == groups
