"""The outbox: the one thread that calls Triton after execute() returns.

Every call into Triton after execute() (a response, a cancellation check, a metric) is made
from this thread: calls racing from several stub threads crashed the server, and is_cancelled()
on a request already sent FINAL touches a released response sender. The engine puts each
stream's token events in `queue`; execute() puts refusals and control requests there too. Between
items the thread polls cancellation at a bounded rate (each check is a round trip). Every request
gets exactly one response with the FINAL flag, whatever happens.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, replace

from streaming_backend.adapter.control import Control
from streaming_backend.adapter.metrics import Metrics, outcome
from streaming_backend.adapter.response import ResponseBuilder
from streaming_backend.adapter.sender import Sender
from streaming_backend.engine import StreamHandle
from streaming_backend.errors import Cancelled, StreamingError
from streaming_backend.events import FinishReason, TokenEvent

log = logging.getLogger("tokenstream.model")


@dataclass
class Live:
    """A request between execute() and its FINAL response."""

    sender: object  # the request's InferenceResponseSender
    builder: ResponseBuilder
    handle: StreamHandle | None = None  # set once the engine took it
    first_emitted_ns: int = 0


@dataclass(frozen=True)
class Rejected:
    """A request refused in execute(): its error response waits in the outbox."""

    sender: object
    error: Exception


@dataclass(frozen=True)
class ControlRequest:
    """An accepted control request (wire.CONTROL_ACTIONS), answered by the outbox."""

    sender: object
    action: str


_TICK = object()  # "no item came: time to poll cancellation"
_STOP = None  # ends the thread


class Outbox:
    """The live requests and the thread that answers them."""

    def __init__(
        self, engine, send: Sender, metrics: Metrics, control: Control, cancel_check_s: float
    ):
        self.engine = engine
        self.send = send
        self.metrics = metrics
        self.control = control
        self.cancel_check_s = cancel_check_s
        self.queue: queue.Queue[TokenEvent | Rejected | ControlRequest | None] = queue.Queue()
        self._live: dict[str, Live] = {}
        self._lock = threading.Lock()  # guards _live and _counter between execute and the thread
        self._counter = 0
        self._thread = threading.Thread(target=self._loop, name="outbox", daemon=True)

    # ---- called from execute() and finalize() ---------------------------------------------------

    def start(self) -> Outbox:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread once the items queued before this call are answered."""
        self.queue.put(_STOP)
        self._thread.join(timeout=timeout)

    def new_id(self) -> str:
        """The next request id."""
        with self._lock:
            self._counter += 1
            return f"{self._counter}"

    def register(self, request_id: str, sender, builder: ResponseBuilder) -> Live:
        """A request about to be submitted (registered first: its first event may come at once)."""
        live = Live(sender, builder)
        with self._lock:
            self._live[request_id] = live
        return live

    def reject(self, request_id: str | None, sender, error: Exception) -> None:
        """Refuse a request: forget it, and queue its error response."""
        with self._lock:
            self._live.pop(request_id, None)
        self.queue.put(Rejected(sender, error))

    def control_request(self, sender, raw: bytes) -> None:
        """Queue a control request's answer, or its refusal (a bad request or admin key)."""
        try:
            self.queue.put(ControlRequest(sender, self.control.action(raw)))
        except StreamingError as error:
            self.queue.put(Rejected(sender, error))

    @property
    def active(self) -> int:
        """Requests accepted and not yet sent their FINAL."""
        with self._lock:
            return len(self._live)

    # ---- the thread: the only one that calls Triton ---------------------------------------------

    def _loop(self) -> None:
        """Send responses in order; between them, poll cancellation at a bounded rate."""
        interval = self.cancel_check_s
        next_check = time.monotonic() + interval
        while True:
            try:
                item = self.queue.get(timeout=max(0.0, next_check - time.monotonic()))
            except queue.Empty:
                item = _TICK
            if item is _STOP:
                self.metrics.flush_tokens()
                break
            # nothing may end this thread: without it no request would ever be answered again
            try:
                self._handle(item)
                self.metrics.set_waiting(self.engine.waiting_streams)  # within cancel_check_s
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + interval
                    self._poll_cancelled()
                    self.metrics.set_steps(self.engine.step_report())
                    counts = self.engine.draft_counts
                    self.metrics.set_drafts(counts.drafted, counts.accepted)
                    self.metrics.flush_tokens()
            except Exception:  # noqa: BLE001 - logged; the loop goes on
                log.exception("the outbox thread caught an error and goes on")

    def _handle(self, item) -> None:
        """One item: a refusal, a control request or a token event."""
        if isinstance(item, Rejected):
            # counted before the answer: a client that sees its refusal sees it counted
            self.metrics.count_rejected()
            self.send.send_error(item.sender, item.error)
        elif isinstance(item, ControlRequest):
            self.send.send_text(item.sender, self.control.act(item.action, self.active))
        elif isinstance(item, TokenEvent):
            self._deliver(item)

    def _deliver(self, event: TokenEvent) -> None:
        """Send one event's response; after a FINAL the request is forgotten."""
        with self._lock:
            live = self._live.get(event.request_id)
        if live is None:
            return
        self.metrics.set_active(self.active)  # before: a client that sees a token sees it counted
        try:
            self._respond(live, event)
        except Exception as exc:  # noqa: BLE001 - a send failure ends that stream only
            log.exception("sending a response of request %s failed", event.request_id)
            if live.handle is not None:
                live.handle.cancel()
            if event.final:
                self.send.send_error(live.sender, exc)
                event = _as_failed(event)
        if event.final:
            with self._lock:
                self._live.pop(event.request_id, None)
            self.metrics.count(outcome(event))
            self.metrics.set_active(self.active)

    def _respond(self, live: Live, event: TokenEvent) -> None:
        """The event's response: its error, its outputs, or nothing (an answer accumulating)."""
        if event.token_ids and event.num_output_tokens == 1:
            live.first_emitted_ns = event.emitted_ns
        # each metrics call is a round trip to Triton's process: a token goes out before its
        # bookkeeping, the FINAL after it (a client that sees the end sees the stream counted)
        if event.final:
            self.metrics.observe(event, live.builder.received_ns, live.first_emitted_ns)
        try:
            if event.error is not None or event.finish_reason is FinishReason.CANCELLED:
                self.send.send_error(live.sender, event.error or Cancelled())
                return
            outputs = live.builder.outputs(event)
            if outputs is not None:
                self.send.send(live.sender, outputs, final=event.final)
        finally:
            if not event.final:
                self.metrics.observe(event, live.builder.received_ns, live.first_emitted_ns)

    def _poll_cancelled(self) -> None:
        """Ask Triton (a round trip each) whether live requests were cancelled by their client."""
        with self._lock:
            entries = list(self._live.values())
        for entry in entries:  # none of these has had its FINAL: only this thread sends them
            if entry.handle is not None and not entry.handle.cancelled:
                try:
                    cancelled = self.send.is_cancelled(entry.sender)
                except Exception:  # noqa: BLE001 - one broken sender must not stop the polling
                    log.exception("is_cancelled() failed; cancelling that request")
                    cancelled = True
                if cancelled:
                    entry.handle.cancel()
        self.metrics.set_active(self.active)


def _as_failed(event: TokenEvent) -> TokenEvent:
    """The final event as it counts once its response could not be sent."""
    return replace(event, finish_reason=FinishReason.ERROR, error=StreamingError("send failed"))
