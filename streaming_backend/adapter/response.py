"""Token events -> wire tensors: the output arrays of one request's responses (one per event when
streaming, one in all otherwise). No Triton import: sender.py wraps the arrays in pb_utils tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from streaming_backend.adapter.request import ModelRequest
from streaming_backend.events import LogprobDetail, TokenEvent
from streaming_backend.sampling.request_keys import (
    TOP_LOGPROBS,  # it names the entries' alternatives too
)
from streaming_backend.wire import (
    CUMULATIVE_LOGPROB,
    FINISH_REASON,
    LOGPROBS,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    OUTPUT_IDS,
    RETURN_CUMULATIVE_LOGPROB,
    RETURN_FINISH_REASON,
    RETURN_LOGPROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    RETURN_OUTPUT_IDS,
    RETURN_SYSTEM_FINGERPRINT,
    RETURN_TIMING,
    SYSTEM_FINGERPRINT,
    TEXT_OUTPUT,
    TIMING,
    ServerTiming,
)


@dataclass
class ResponseBuilder:
    """Turns one request's token events into output arrays (one per event when streaming)."""

    request: ModelRequest
    received_ns: int
    queued_ns: int = 0
    prompt_text: str = ""  # prepended to a non-streamed answer unless exclude_input_in_output
    fingerprint: str = ""  # the engine's numerics.fingerprint (return_system_fingerprint)
    _texts: list[str] = field(default_factory=list)
    _ids: list[int] = field(default_factory=list)
    _logprobs: list[float] = field(default_factory=list)
    _details: list[LogprobDetail] = field(default_factory=list)
    _cumulative: float = 0.0

    def outputs(self, event: TokenEvent) -> dict[str, np.ndarray] | None:
        """Output arrays to send for this event; None while a non-streamed answer accumulates."""
        if event.logprobs:
            self._cumulative += sum(event.logprobs)
        if self.request.stream:
            details = event.logprob_details or ()
            return self._build(event, event.text, event.token_ids, event.logprobs or (), details)
        self._texts.append(event.text)
        self._ids.extend(event.token_ids)
        self._logprobs.extend(event.logprobs or ())
        self._details.extend(event.logprob_details or ())
        if not event.final:
            return None
        text = "".join(self._texts)
        if not self.request.exclude_input:
            text = self.prompt_text + text
        return self._build(
            event, text, tuple(self._ids), tuple(self._logprobs), tuple(self._details)
        )

    def _build(self, event, text, ids, logprobs, details=()) -> dict[str, np.ndarray]:
        out = {TEXT_OUTPUT: np.array([text.encode("utf-8")], dtype=np.object_)}
        want = self.request.wants
        if want(RETURN_FINISH_REASON) and event.final:
            out[FINISH_REASON] = np.array([event.finish_reason.value.encode()], dtype=np.object_)
        if want(RETURN_NUM_INPUT_TOKENS):
            out[NUM_INPUT_TOKENS] = np.array([event.num_input_tokens], dtype=np.uint32)
        if want(RETURN_NUM_OUTPUT_TOKENS):
            out[NUM_OUTPUT_TOKENS] = np.array([len(ids)], dtype=np.uint32)
        if want(RETURN_OUTPUT_IDS):
            out[OUTPUT_IDS] = np.array(ids, dtype=np.int64)
        if want(RETURN_LOGPROBS):
            entries = [{"token_id": t, "logprob": p} for t, p in zip(ids, logprobs)]
            for entry, detail in zip(entries, details):
                entry.update(_detail(detail))
            out[LOGPROBS] = np.array([json.dumps(entries).encode()], dtype=np.object_)
        if want(RETURN_CUMULATIVE_LOGPROB):
            out[CUMULATIVE_LOGPROB] = np.array([self._cumulative], dtype=np.float32)
        if want(RETURN_TIMING):
            out[TIMING] = np.array([self._timing(event).encode()], dtype=np.object_)
        if want(RETURN_SYSTEM_FINGERPRINT):
            out[SYSTEM_FINGERPRINT] = np.array([self.fingerprint.encode()], dtype=np.object_)
        return out

    def _timing(self, event: TokenEvent) -> str:
        return ServerTiming(
            received_ns=self.received_ns,
            queued_ns=self.queued_ns or event.submitted_ns,
            prefill_start_ns=event.scheduled_ns,
            emitted_ns=event.emitted_ns,
            wall_minus_monotonic_ns=ServerTiming.wall_offset_ns(),
            cached_tokens=event.cached_tokens,
        ).to_json()


def _detail(detail: LogprobDetail) -> dict:
    """A LOGPROBS entry's token text and, when asked, its top_logprobs alternatives."""
    top = [{"token_id": t.token_id, "token": t.token, "logprob": t.logprob} for t in detail.top]
    return {"token": detail.chosen.token} | ({TOP_LOGPROBS: top} if top else {})
