"""A stream's events from chosen tokens, without a model: one character per token id."""

import queue
from types import SimpleNamespace

import pytest

from streaming_backend.engine import StreamHandle, _Stream
from streaming_backend.engine.detokenize import IncrementalDetokenizer
from streaming_backend.engine.stream_events import StreamEvents
from streaming_backend.errors import MaskFailed, NonFiniteLogits, StreamingError
from streaming_backend.events import FinishReason
from streaming_backend.sampling.logits import Choice
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.sampling.stopping import StopStringMatcher

EOS = 0


class CharTokenizer:
    """Token id i is the character chr(i); EOS decodes to nothing."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i != EOS)


EVENTS = StreamEvents(SimpleNamespace(tokenizer=CharTokenizer(), eos_ids={EOS}, context_length=64))


class Grammar:
    """A grammar that takes only the characters of `allowed` and is done after `length`."""

    def __init__(self, allowed: str, length: int):
        self.allowed, self.length, self.taken, self.released = allowed, length, 0, 0
        self.done = False

    def accept(self, token: int) -> bool:
        self.taken += 1
        self.done = self.taken >= self.length
        return chr(token) in self.allowed

    def error(self) -> str:
        return "not allowed here"

    def release(self) -> None:
        self.released += 1


def _stream(sink=None, grammar=None, **settings) -> _Stream:
    settings = SamplingSettings(**{"max_tokens": 10, **settings})
    stream = _Stream(
        handle=StreamHandle("r", sink or queue.Queue()),
        prompt_ids=[ord("p")],
        settings=settings,
        logprobs=False,
        submitted_ns=0,
        generator=None,
        detokenizer=IncrementalDetokenizer(CharTokenizer()),
        matcher=StopStringMatcher(settings.stop),
    )
    stream.grammar = grammar
    return stream


def _feed(stream, text: str) -> list[bool]:
    return [EVENTS.advance(stream, Choice([ord(c)], [True], None), 0, 1) for c in text]


def _events(stream) -> list:
    return list(stream.handle.sink.queue)


@pytest.mark.parametrize(
    "text, settings, shown, reason",
    [
        ("abcd", {"max_tokens": 4}, "abcd", FinishReason.LENGTH),
        ("xy\0", {}, "xy", FinishReason.STOP),  # EOS
        ("a END", {"stop": ("END",)}, "a ", FinishReason.STOP),
        ("a EN", {"stop": ("END",), "max_tokens": 4}, "a EN", FinishReason.LENGTH),  # released
    ],
)
def test_each_token_sends_one_event_the_last_with_the_reason(text, settings, shown, reason):
    """Text held back for a stop string is cut at a match and released at any other end."""
    stream = _stream(**settings)
    done = _feed(stream, text)
    events = _events(stream)
    assert done[-1] and not any(done[:-1])
    assert "".join(e.text for e in events) == shown
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + [reason]
    assert [e.num_output_tokens for e in events] == list(range(1, len(events) + 1))


def test_finish_drops_held_text_and_sends_one_final_only():
    """A cancelled stream's final carries no held-back text; a second finish sends nothing."""
    stream = _stream(stop=("END",))
    _feed(stream, "a EN")
    EVENTS.finish(stream, FinishReason.CANCELLED)
    EVENTS.finish(stream, FinishReason.ERROR, StreamingError("late"))
    events = _events(stream)
    assert "".join(e.text for e in events) == "a "
    assert [e.finish_reason for e in events][-2:] == [None, FinishReason.CANCELLED]


def test_a_final_event_the_sink_refuses_is_logged_not_raised(caplog):
    """Ending a stream whose sink fails does not raise: the engine must end its other streams."""

    class Broken:
        def put(self, event):
            raise RuntimeError("sink closed")

    stream = _stream(sink=Broken())
    EVENTS.finish(stream, FinishReason.ERROR, StreamingError("boom"))
    assert stream.ended
    assert "could not deliver the final event of r" in caplog.text


def test_the_grammar_ends_the_stream_and_is_released_once_done():
    """A complete grammar stops the stream; its matcher is freed when the stream ends."""
    grammar = Grammar("ab", length=2)
    stream = _stream(grammar=grammar)
    assert _feed(stream, "ab") == [False, True]
    assert _events(stream)[-1].finish_reason is FinishReason.STOP
    assert grammar.released == 1


@pytest.mark.parametrize(
    "choice, error, message",
    [
        (Choice([ord("a")], [False], None), NonFiniteLogits, "NaN or infinite logits"),
        (Choice([ord("a")], [True], None, {0: MaskFailed("mask")}), MaskFailed, "mask"),
        (Choice([ord("z")], [True], None), StreamingError, "the grammar rejected token 122"),
    ],
)
def test_what_ends_one_stream_is_raised_before_its_event(choice, error, message):
    """NaN logits, a failed mask or a token the grammar rejects raise; no event is sent."""
    stream = _stream(grammar=Grammar("ab", length=5))
    with pytest.raises(error, match=message):
        EVENTS.advance(stream, choice, 0, 1)
    assert _events(stream) == [] and stream.output_ids == []
