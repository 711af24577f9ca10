"""The engine on a tiny random model: continuous batching, isolation, cancellation, limits."""

from __future__ import annotations

import copy
import queue
import statistics
import threading
import time
from dataclasses import replace

import faults
import pytest
import torch
from conftest import wait_for

from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.errors import EngineStopped, InvalidRequest, Overloaded
from streaming_backend.events import FinishReason
from streaming_backend.prompts import encode_prompt
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.steps.hf import length_groups

GREEDY = SamplingSettings(temperature=0, max_tokens=12, ignore_eos=True)


FORWARDS = ("compact", "hf")


@pytest.fixture(params=FORWARDS)
def engine(tiny_loaded, request):
    """An engine on each forward: every test using it runs on both. Unquantized whatever this
    CPU's `quantize auto` picks: its logprobs compare with the model's own."""
    config = EngineConfig(max_streams=8, queue_limit=8, forward=request.param, quantize="none")
    with Engine(tiny_loaded, config) as eng:
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


def _model_logprobs(loaded, prompt: list[int], output: list[int]) -> list[float]:
    """Log-softmax of one full forward pass (no cache, no batch) at each output token."""
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [N, V]
    chosen = torch.tensor(output)[:, None]
    return torch.log_softmax(logits, -1).gather(-1, chosen).squeeze(-1).tolist()


def test_logprobs_are_the_models_log_softmax(engine, tiny_loaded):
    """Each event carries its token's log-probability under the model's raw distribution."""
    prompt = _prompt(tiny_loaded, "Hi")
    settings = SamplingSettings(temperature=1.5, max_tokens=12, seed=5, ignore_eos=True)
    events = list(engine.submit(prompt, settings, logprobs=True))
    output = [e.token_ids[0] for e in events]
    expected = _model_logprobs(tiny_loaded, prompt, output)
    assert [e.logprobs[0] for e in events] == pytest.approx(expected, abs=1e-4)
    assert min(expected) < -1  # sampled at T=1.5: not all near-certain argmax tokens


class RecordingEngine(Engine):
    """Records each stream's raw logits and the rows of each step (test-only peek)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.batch_sizes: list[int] = []
        self.steps: list[list[str]] = []  # request ids sampled together, per step

    def _emit(self, streams, logits, chooser):
        self.batch_sizes.append(len(streams))
        self.steps.append([s.handle.request_id for s in streams])
        for row, stream in enumerate(streams):
            self.logits.setdefault(stream.handle.request_id, []).append(logits[row].clone())
        return super()._emit(streams, logits, chooser)


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


def test_seed_reproduces_tokens_whatever_shares_the_batch(tiny_loaded):
    """The same seed and settings give the same tokens, alone or beside other streams."""
    engine = RecordingEngine(tiny_loaded, EngineConfig(max_streams=8)).start()
    prompt = _prompt(tiny_loaded, "Tell me a story")
    settings = SamplingSettings(
        temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True
    )
    alone = [e.token_ids for e in engine.submit(prompt, settings)]
    again = [e.token_ids for e in engine.submit(prompt, settings)]
    neighbours = [
        engine.submit(
            _prompt(tiny_loaded, f"noise {i} " * (i + 1)),
            SamplingSettings(max_tokens=200, seed=i, ignore_eos=True),
            request_id=f"n{i}",
        )
        for i in range(4)
    ]
    for n in neighbours:
        _first_event(n)  # all running before the crowded one joins
    crowded = [e.token_ids for e in engine.submit(prompt, settings, request_id="crowded")]
    for n in neighbours:
        n.cancel()
        list(n)
    other_seed = [
        e.token_ids
        for e in engine.submit(
            prompt,
            SamplingSettings(temperature=1.0, top_p=0.95, max_tokens=16, seed=99, ignore_eos=True),
        )
    ]
    engine.shutdown()
    assert alone == again == crowded
    assert other_seed != alone
    shared = [step for step in engine.steps if "crowded" in step]
    assert len(shared) == 16 and all(len(step) == 5 for step in shared[1:]), shared


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
        wait_for(lambda: engine.live_streams == 0)


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
    """Fails the stream named 'bad' at its third token and the prefill of 'bad-prefill'.

    It admits nothing until `gate` is set, so requests submitted before arrive together.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.prefills: list[list[str]] = []  # request ids of each prefill attempt
        faults.on_prefill(self, self._prefill_pass)
        self._advance = self._events.advance
        self._events.advance = self._failing_advance

    def _admit(self):
        self.gate.wait()
        return super()._admit()

    def _failing_advance(self, stream, choice, row, emitted_ns):
        if stream.handle.request_id == "bad" and len(stream.output_ids) == 2:
            raise RuntimeError("boom")
        return self._advance(stream, choice, row, emitted_ns)

    def _prefill_pass(self, request_ids):
        self.prefills.append(request_ids)
        if "bad-prefill" in request_ids:
            raise RuntimeError("prefill boom")


@pytest.mark.parametrize("forward", FORWARDS)
def test_one_failing_request_does_not_stop_the_others(tiny_loaded, forward):
    """A failure in one stream (decode or prefill) ends it with an error; the rest complete.

    The four arrive together: their joint prefill fails, and each is retried alone.
    """
    with FailingEngine(tiny_loaded, EngineConfig(forward=forward)) as engine:
        prompt = _prompt(tiny_loaded, "hello")
        handles = {
            rid: engine.submit(prompt, GREEDY, request_id=rid)
            for rid in ("ok1", "bad", "bad-prefill", "ok2")
        }
        engine.gate.set()
        results = {rid: list(h) for rid, h in handles.items()}
        assert sorted(engine.prefills[0]) == sorted(handles)  # one group of four failed
        assert sorted(engine.prefills[1:]) == [[rid] for rid in sorted(handles)]  # split
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


@pytest.fixture
def eos_loving(tiny_loaded):
    """The tiny model with EOS's logit raised by 50: it would answer EOS at once, every time."""
    model = copy.deepcopy(tiny_loaded.model)
    eos = min(tiny_loaded.eos_ids)

    def favour_eos(module, args, logits):
        logits[..., eos] += 50.0  # logits: [B, L, V]
        return logits

    model.lm_head.register_forward_hook(favour_eos)
    return replace(tiny_loaded, model=model)


def test_min_tokens_suppresses_eos(eos_loving):
    """EOS cannot end a stream before min_tokens; right after, it can."""
    with Engine(eos_loving) as engine:
        prompt = _prompt(eos_loving, "hi")
        plain = list(engine.submit(prompt, SamplingSettings(max_tokens=20, seed=3)))
        held = list(engine.submit(prompt, SamplingSettings(max_tokens=20, min_tokens=5, seed=3)))
    eos_ids = eos_loving.eos_ids
    assert len(plain) == 1 and plain[0].token_ids[0] in eos_ids  # the model wants EOS
    assert all(e.token_ids[0] not in eos_ids for e in held[:5])
    assert len(held) == 6 and held[-1].token_ids[0] in eos_ids
    assert held[-1].finish_reason is FinishReason.STOP


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
    from streaming_backend.engine import _Stream

    streams = [
        _Stream(None, [1] * n, SamplingSettings(), False, 0, None, None, None) for n in lengths
    ]
    assert [[len(s.prompt_ids) for s in g] for g in length_groups(streams, 0.25)] == groups


def _events(handle, timeout: float = 30.0):
    """A stream's events up to its final one, failing (not hanging) if the engine stalls."""
    events, sink = [], handle.sink
    while not events or not events[-1].final:
        try:
            events.append(sink.get(timeout=timeout))
        except queue.Empty:
            raise AssertionError(f"{handle.request_id} did not end; got {events}") from None
    return events


def _holding_stop(engine, loaded, prompt: list[int]) -> str:
    """A stop string that holds back the whole greedy answer: its text plus a character that
    never comes, so every token's text stays pending until the stream ends."""
    settings = SamplingSettings(temperature=0, max_tokens=30, ignore_eos=True)
    text = "".join(e.text for e in engine.submit(prompt, settings))
    assert 0 < len(text) < 250
    return text + "\x07"


def _held_stream(engine, prompt, stop, request_id):
    """Start a greedy stream whose text is all held back; return it after its third token."""
    settings = SamplingSettings(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    handle = engine.submit(prompt, settings, request_id=request_id, sink=queue.Queue())
    first = [handle.sink.get(timeout=30) for _ in range(3)]
    assert [e.text for e in first] == ["", "", ""] and all(e.token_ids for e in first)
    return handle, first


def test_held_back_text_is_dropped_on_cancel(engine, tiny_loaded):
    """Text pending for a stop string is not sent when the stream is cancelled; one final."""
    prompt = _prompt(tiny_loaded, "Once upon a time")
    stop = _holding_stop(engine, tiny_loaded, prompt)
    handle, first = _held_stream(engine, prompt, stop, "held")
    handle.cancel()
    rest = _events(handle)
    assert [e.final for e in rest] == [False] * (len(rest) - 1) + [True]
    assert rest[-1].finish_reason is FinishReason.CANCELLED and rest[-1].text == ""
    assert "".join(e.text for e in first + rest) == ""
    assert handle.sink.empty()


def test_held_back_text_is_dropped_on_error(tiny_loaded):
    """A stream that fails while text is pending ends with one error event and no text."""
    with FailingEngine(tiny_loaded) as engine:
        engine.gate.set()
        prompt = _prompt(tiny_loaded, "Once upon a time")
        stop = _holding_stop(engine, tiny_loaded, prompt)
        settings = SamplingSettings(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
        handle = engine.submit(prompt, settings, request_id="bad", sink=queue.Queue())
        events = _events(handle)
        assert [e.finish_reason for e in events] == [None, None, FinishReason.ERROR]
        assert [e.text for e in events] == ["", "", ""] and events[0].token_ids
        assert handle.sink.empty()
        # The same stream ending normally releases the pending text at its end.
        assert "".join(e.text for e in engine.submit(prompt, settings)) == stop[:-1]


def test_held_back_text_is_dropped_on_shutdown(tiny_loaded):
    """On shutdown a stream with pending text ends once, CANCELLED, without that text."""
    engine = Engine(tiny_loaded).start()
    try:
        prompt = _prompt(tiny_loaded, "Once upon a time")
        stop = _holding_stop(engine, tiny_loaded, prompt)
        slow = SamplingSettings(temperature=0, max_tokens=200, stop=[stop + "x"], ignore_eos=True)
        handle = engine.submit(prompt, slow, sink=queue.Queue())
        first = handle.sink.get(timeout=30)
        assert first.text == "" and first.token_ids
    finally:
        engine.shutdown()
    rest = _events(handle)
    assert rest[-1].finish_reason is FinishReason.CANCELLED and "shutting down" in str(
        rest[-1].error
    )
    assert "".join(e.text for e in rest) == "" and sum(e.final for e in rest) == 1
    assert handle.sink.empty()


def _greedy_with_penalty(loaded, prompt: list[int], penalty: float, n: int) -> list[int]:
    """Reference: greedy decoding with full forward passes and the CTRL penalty, no engine."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = loaded.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            seen = torch.tensor(sorted(set(ids)))
            scores = logits[seen]
            logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_repetition_penalty_through_the_engine(engine, tiny_loaded):
    """The engine penalises the prompt's and the answer's tokens, as a plain reference loop."""
    prompt = _prompt(tiny_loaded, "the the the the the the")
    settings = SamplingSettings(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [e.token_ids[0] for e in engine.submit(prompt, settings)]
    penalised = [
        e.token_ids[0] for e in engine.submit(prompt, replace(settings, repetition_penalty=3.0))
    ]
    assert penalised == _greedy_with_penalty(tiny_loaded, prompt, 3.0, 16)
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))


class BrokenStepEngine(Engine):
    """Its decode step raises once `broken` is set, as a bug or a device failure would."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.broken = threading.Event()

    def _decode_step(self):
        if self.broken.is_set():
            self.broken.clear()
            raise RuntimeError("decode step exploded")
        super()._decode_step()


def test_a_failing_decode_step_fails_the_batch_and_the_engine_serves_on(tiny_loaded):
    """Every live stream ends with one error event; the next requests are served normally."""
    with BrokenStepEngine(tiny_loaded, EngineConfig(max_streams=4)) as engine:
        long = SamplingSettings(max_tokens=200, ignore_eos=True)
        handles = [
            engine.submit(_prompt(tiny_loaded, f"row {i}"), long, sink=queue.Queue())
            for i in range(3)
        ]
        for handle in handles:
            handle.sink.get(timeout=30)  # all three are live
        engine.broken.set()
        for handle in handles:
            events = _events(handle)
            assert events[-1].finish_reason is FinishReason.ERROR
            assert "RuntimeError: decode step exploded" in str(events[-1].error)
            assert events[-1].num_output_tokens < 200 and handle.sink.empty()
        wait_for(lambda: engine.live_streams == 0)
        after = [engine.submit(_prompt(tiny_loaded, f"after {i}"), GREEDY) for i in range(2)]
        for handle in after:
            events = _events(handle)
            assert len(events) == 12 and events[-1].finish_reason is FinishReason.LENGTH


def test_nan_logits_fail_the_stream_with_a_clear_error(tiny_loaded):
    """Rows whose logits hold NaN end with an error naming it; the engine then serves on."""
    model = copy.deepcopy(tiny_loaded.model)
    poisoned = threading.Event()

    def nan_logits(module, args, logits):
        if poisoned.is_set():
            logits[..., 0] = float("nan")  # logits: [B, L, V]
        return logits

    model.lm_head.register_forward_hook(nan_logits)
    loaded = replace(tiny_loaded, model=model)
    with Engine(loaded) as engine:  # the hook keeps it on the Hugging Face forward
        assert engine.forward == "hf"
        poisoned.set()
        events = list(engine.submit(_prompt(loaded, "hi"), GREEDY))
        assert events[-1].finish_reason is FinishReason.ERROR
        assert "NaN or infinite logits" in str(events[-1].error)
        poisoned.clear()
        assert list(engine.submit(_prompt(loaded, "hi"), GREEDY))[-1].finish_reason is (
            FinishReason.LENGTH
        )


def test_the_model_loads_and_the_forward_builds_on_the_engine_thread(tiny_loaded, monkeypatch):
    """All of the engine's torch work runs on its one thread: a loader given instead of a model
    runs there, and so does the forward's build (with its calibration) and the reading of its
    numerics, since torch's threads form one team per calling thread and a second team slowed
    every decode step."""
    import streaming_backend.engine as engine_module

    threads = {}
    build, describe = engine_module.build_steps, engine_module.describe

    def recording_build(*args):
        threads["build"] = threading.current_thread()
        return build(*args)

    def recording_describe(*args):
        threads["describe"] = threading.current_thread()
        return describe(*args)

    def loader():
        threads["load"] = threading.current_thread()
        return tiny_loaded

    monkeypatch.setattr(engine_module, "build_steps", recording_build)
    monkeypatch.setattr(engine_module, "describe", recording_describe)
    with Engine(loader, EngineConfig(max_streams=2)) as eng:
        assert eng.loaded is tiny_loaded
        events = list(eng.submit(_prompt(tiny_loaded, "Hello"), GREEDY))
    assert events[-1].finish_reason is not None
    assert threads["load"] is threads["build"] is threads["describe"] is eng._thread
    assert threads["load"] is not threading.main_thread()


def test_a_loader_that_fails_fails_the_constructor_and_leaves_no_thread():
    """The load's error is raised by Engine(...) itself; the engine thread has ended."""
    before = {t for t in threading.enumerate() if t.name == "streaming-engine"}

    def loader():
        raise FileNotFoundError("no model here")

    with pytest.raises(FileNotFoundError, match="no model here"):
        Engine(loader)
    assert {t for t in threading.enumerate() if t.name == "streaming-engine"} == before


def test_submit_before_start_is_refused_and_shutdown_ends_the_thread(tiny_loaded):
    """An engine built but not started takes no request; shutdown() ends its waiting thread."""
    eng = Engine(tiny_loaded, EngineConfig(max_streams=1))
    with pytest.raises(EngineStopped):
        eng.submit(_prompt(tiny_loaded, "Hello"), GREEDY)
    eng.shutdown()
    assert not eng._thread.is_alive()


@pytest.mark.parametrize(
    ("forward", "quantize"), [("compact", "none"), ("compact", "int8"), ("hf", "int8")]
)
def test_the_engine_names_the_numerics_its_forward_runs(tiny_loaded, forward, quantize):
    """engine.numerics names the forward the streams run on and the weight format it actually
    uses (the Hugging Face forward quantizes nothing, whatever the setting)."""
    config = EngineConfig(max_streams=2, forward=forward, quantize=quantize)
    with Engine(tiny_loaded, config) as eng:
        numerics = eng.numerics
    assert numerics.forward == eng.forward == forward
    assert numerics.quantize == (quantize if forward == "compact" else "none")
    assert numerics.decode == "eager" and numerics.model == tiny_loaded.name


def test_the_step_threads_read_the_machine_while_the_engine_waits(tiny_loaded, monkeypatch):
    """An idle engine wakes every LOOK_S to let its step threads read the machine (the first
    step's start count comes from those readings), and still answers at once after."""
    import streaming_backend.engine as engine_module
    from streaming_backend.sampling.settings import SamplingSettings

    monkeypatch.setattr(engine_module, "LOOK_S", 0.05)
    with Engine(tiny_loaded) as engine:
        deadline = time.monotonic() + 10
        while len(engine._threads._waited) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(engine._threads._waited) >= 2
        assert all(others is not None and others >= 0 for others in engine._threads._waited)
        settings = SamplingSettings(temperature=0, max_tokens=4, ignore_eos=True)
        assert sum(len(e.token_ids) for e in engine.submit([1, 2, 3], settings)) == 4


def test_a_failed_reading_while_waiting_does_not_stop_the_engine(tiny_loaded, monkeypatch):
    """A reading of the machine that raises (in the idle wait, outside the loop's step guard,
    or in a step) is logged and counts as no reading: requests are still answered."""
    import streaming_backend.engine as engine_module
    from streaming_backend.sampling.settings import SamplingSettings

    calls = []

    def broken(**_):
        calls.append(1)
        if len(calls) > 1:  # the reading at construction succeeds, the wait's fail
            raise RuntimeError("no /proc today")
        return 0.0

    monkeypatch.setattr(engine_module, "LOOK_S", 0.05)
    monkeypatch.setattr(engine_module, "other_processes_seconds", broken)
    with Engine(tiny_loaded) as engine:
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(calls) >= 3  # the wait went on reading after a failure
        settings = SamplingSettings(temperature=0, max_tokens=4, ignore_eos=True)
        assert sum(len(e.token_ids) for e in engine.submit([1, 2, 3], settings)) == 4


def test_beside_a_core_taken_all_along_the_first_prefill_starts_on_fewer_threads(
    tiny_loaded, monkeypatch
):
    """Other processes that used a core through every look of the wait (here a reading that
    says so) start the engine's first step, its first prefill, on the count that leaves them
    their core, and the decode steps go on from there; not a switch."""
    import os

    import streaming_backend.engine as engine_module
    from streaming_backend.engine.step_threads import START_LOOKS, count_beside
    from streaming_backend.sampling.settings import SamplingSettings

    monkeypatch.setattr(engine_module, "LOOK_S", 0.05)
    a_core = lambda **_: time.monotonic()  # noqa: E731  (one core's worth a second)
    monkeypatch.setattr(engine_module, "other_processes_seconds", a_core)
    most = torch.get_num_threads()
    expected = count_beside(1.0, len(os.sched_getaffinity(0)), most)
    with Engine(tiny_loaded) as engine:
        deadline = time.monotonic() + 10
        while len(engine._threads._waited) < START_LOOKS and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = []
        prefill = engine._steps.forward.prefill
        engine._steps.forward.prefill = lambda c: (
            counts.append(torch.get_num_threads()) or prefill(c)
        )
        settings = SamplingSettings(temperature=0, max_tokens=4, ignore_eos=True)
        assert sum(len(e.token_ids) for e in engine.submit([1, 2, 3], settings)) == 4
        report = engine.step_report()
    assert counts and counts[0] == expected
    assert report.threads == expected and report.switches == 0


@pytest.mark.parametrize("adaptive", [True, False])
def test_the_decode_steps_report_their_threads_when_adaptive(tiny_loaded, adaptive):
    """With adaptive_threads (the default) the engine times its decode steps and reports their
    thread count and pace; without, there is no report and torch's count stays as it was."""
    from streaming_backend.engine.step_threads import context_band
    from streaming_backend.sampling.settings import SamplingSettings

    threads = torch.get_num_threads()
    # one token a decode step: with speculation (auto: ngram on a CPU) a verify step emits
    # several tokens, and the last step can begin at an earlier position than the last token's
    config = EngineConfig(adaptive_threads=adaptive, speculative="off")
    with Engine(tiny_loaded, config) as engine:
        settings = SamplingSettings(temperature=0, max_tokens=8, ignore_eos=True)
        assert sum(len(e.token_ids) for e in engine.submit([1, 2, 3], settings)) == 8
        report = engine.step_report()
    if not adaptive:
        assert report is None
        return
    assert report.most == threads and 1 <= report.threads <= threads
    assert report.best_step_s > 0 and report.slowdown >= 1.0 - 1e-9  # a mean over its best
    # the last decode step's longest row: 3 prompt tokens and the 7 tokens before its own
    assert engine._threads._last_band == context_band(3 + 7)
