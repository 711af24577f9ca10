"""A stream's events: each chosen token -> its TokenEvent, and the final event of a stream that
ends without one.

A token's event carries the text that is now safe to show (detokenised incrementally, held back
while it could begin a stop string), its logprobs when asked, and a finish reason once the stream
is done (a stop string, EOS, the grammar complete, max_tokens or the context). The engine calls
`StreamEvents.advance` once per stream per step and `finish` when it ends a stream itself
(cancel, error, shutdown); which streams run, and what a failure ends, stays in the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from streaming_backend.engine.detokenize import IncrementalDetokenizer
from streaming_backend.errors import NonFiniteLogits, StreamingError
from streaming_backend.events import FinishReason, LogprobDetail, TokenEvent, TokenLogprob
from streaming_backend.model.loading import LoadedModel
from streaming_backend.sampling.grammar import GrammarMatcher
from streaming_backend.sampling.logits import Choice, TopLogprobs
from streaming_backend.sampling.settings import SamplingSettings
from streaming_backend.sampling.stopping import StopStringMatcher, check_stop

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Where a stream's events go: anything with `put`, such as a queue.Queue."""

    def put(self, event: TokenEvent) -> None: ...


class Handle(Protocol):
    """The caller's side of a stream: its id and where its events go."""

    request_id: str
    sink: EventSink


class EventStream(Protocol):
    """What building events reads and advances of a stream (the engine's `_Stream`)."""

    handle: Handle
    prompt_ids: list[int]
    output_ids: list[int]
    settings: SamplingSettings  # max_tokens resolved
    logprobs: bool
    submitted_ns: int
    scheduled_ns: int
    cached_tokens: int
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    grammar: GrammarMatcher | None
    ended: bool  # its final event went out: it must never get a second one


class StreamEvents:
    """Builds and sends the events of one model's streams."""

    def __init__(self, loaded: LoadedModel):
        self._decode = loaded.tokenizer.decode
        self._eos_ids = loaded.eos_ids
        self._context_length = loaded.context_length

    def advance(self, stream: EventStream, choice: Choice, row: int, emitted_ns: int) -> bool:
        """Add row `row` of a step's choice to its stream and send its event; True when the
        stream is done. Raises what ends this stream alone: NaN logits, a failed grammar mask,
        a token the grammar rejects."""
        if not choice.finite[row]:
            raise NonFiniteLogits(
                "the model produced NaN or infinite logits (float16 overflow? try bfloat16)"
            )
        if row in choice.failed:
            raise choice.failed[row]
        token = choice.ids[row]
        logprobs = None
        if choice.logprobs is not None and stream.logprobs:
            logprobs = self._logprob_detail(stream, token, *choice.logprobs[row])
        grammar_done = _grammar_accept(stream, token)
        stream.output_ids.append(token)
        text = stream.matcher.feed(stream.detokenizer.add([token]))
        done, reason = check_stop(
            token,
            len(stream.output_ids),
            len(stream.prompt_ids) + len(stream.output_ids),
            max_tokens=stream.settings.max_tokens,
            context_length=self._context_length,
            eos_ids=self._eos_ids,
            ignore_eos=stream.settings.ignore_eos,
            stop_matched=stream.matcher.matched or grammar_done,
        )
        if done:
            _release(stream)
        if done and not stream.matcher.matched:
            text += stream.matcher.feed(stream.detokenizer.flush())
            text += "" if stream.matcher.matched else stream.matcher.flush()
        stream.ended = done
        stream.handle.sink.put(
            _event(stream, text, (token,), emitted_ns, logprobs, reason if done else None)
        )
        return done

    def finish(
        self, stream: EventStream, reason: FinishReason, error: StreamingError | None = None
    ) -> None:
        """Send a stream's final event that carries no new token (cancel, error, shutdown).

        Text held back because it might begin a stop string is dropped, not flushed: the stream
        did not end normally, and a CANCELLED or ERROR final reaches the client as an error.
        """
        _release(stream)
        if stream.ended:
            return
        stream.ended = True
        event = _event(stream, "", (), time.monotonic_ns(), None, reason, error)
        try:
            stream.handle.sink.put(event)
        except Exception:
            log.exception("could not deliver the final event of %s", stream.handle.request_id)

    def _logprob_detail(
        self, stream: EventStream, token: int, logprob: float, top: TopLogprobs
    ) -> LogprobDetail:
        """A token's logprob with its text and its top_logprobs alternatives (finite ones)."""
        alternatives = tuple(
            TokenLogprob(i, self._decode([i]), p)
            for i, p in top[: stream.settings.top_logprobs]
            if p > float("-inf")
        )
        return LogprobDetail(TokenLogprob(token, self._decode([token]), logprob), alternatives)


def _event(
    stream: EventStream,
    text: str,
    token_ids: tuple[int, ...],
    emitted_ns: int,
    logprobs: LogprobDetail | None = None,
    reason: FinishReason | None = None,
    error: StreamingError | None = None,
) -> TokenEvent:
    """The stream's event for this step, its counts and timings as they stand now."""
    return TokenEvent(
        request_id=stream.handle.request_id,
        text=text,
        token_ids=token_ids,
        num_output_tokens=len(stream.output_ids),
        num_input_tokens=len(stream.prompt_ids),
        submitted_ns=stream.submitted_ns,
        scheduled_ns=stream.scheduled_ns,
        emitted_ns=emitted_ns,
        cached_tokens=stream.cached_tokens,
        logprobs=None if logprobs is None else (logprobs.chosen.logprob,),
        logprob_details=None if logprobs is None else (logprobs,),
        finish_reason=reason,
        error=error,
    )


def _grammar_accept(stream: EventStream, token: int) -> bool:
    """grammar: advance a constrained stream's matcher; True once its grammar is complete."""
    if stream.grammar is None:
        return False
    if not stream.grammar.accept(token):
        raise StreamingError(f"the grammar rejected token {token}: {stream.grammar.error()}")
    return stream.grammar.done


def _release(stream: EventStream) -> None:
    """grammar: free a stream's matcher once the stream ends."""
    if stream.grammar is not None:
        stream.grammar.release()
