"""Triton adapter for the streaming engine: tensors in, one response per token out.

`initialize` parses the config and starts the engine and the outbox thread; `execute` copies each
request's inputs, hands it to the engine and returns None. The outbox thread makes every call
into Triton (responses, cancellation checks, metrics). Every request gets exactly one response
with the FINAL flag, whatever happens.

Control requests (wire.CONTROL, only with the admin key the launcher put in our environment) are
the supervisor's canary and drain: they are answered from the outbox thread too, so an answer
proves that thread, the engine and the stub all still work.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, replace

import numpy as np
import triton_python_backend_utils as pb_utils

from streaming_backend.adapter.request import ModelRequest, parse_request
from streaming_backend.adapter.response import ResponseBuilder
from streaming_backend.config import ModelSettings
from streaming_backend.engine import Engine, StreamHandle
from streaming_backend.errors import Cancelled, EngineStopped, InvalidRequest, StreamingError
from streaming_backend.events import FinishReason, TokenEvent
from streaming_backend.loading import instance_device, load_model
from streaming_backend.prompts import encode_prompt
from streaming_backend.wire import (
    ADMIN_KEY_VARIABLE,
    CONTROL,
    CONTROL_ACTIONS,
    CONTROL_DRAIN,
    CONTROL_END,
    DRAINING,
    INPUT_NAMES,
    RETURN_CUMULATIVE_LOGPROB,
    RETURN_LOGPROBS,
    TEXT_OUTPUT,
)

log = logging.getLogger("tokenstream.model")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0]
ITL_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5]
OUTCOMES = ("ok", "failed", "cancelled", "rejected")  # labels of tokenstream_requests_total


@dataclass
class _Live:
    """A request between execute() and its FINAL response."""

    sender: object  # the request's InferenceResponseSender
    builder: ResponseBuilder
    handle: StreamHandle | None = None
    first_emitted_ns: int = 0


class Metrics:
    """Our metric families on Triton's metrics port (names after vLLM's where one exists)."""

    def __init__(self, model_name: str, version: str):
        labels = {"model": model_name, "version": version}
        family = pb_utils.MetricFamily
        # A Metric is unusable once its MetricFamily is garbage-collected: keep the families.
        self._families = []

        def make(name, doc, kind, **kw):
            self._families.append(family(name=name, description=doc, kind=kind))
            return self._families[-1].Metric(labels=labels, **kw)

        self.ttft = make(
            "tokenstream_time_to_first_token_seconds",
            "Time from request received to first token emitted",
            family.HISTOGRAM,
            buckets=TTFT_BUCKETS,
        )
        self.tpot = make(
            "tokenstream_time_per_output_token_seconds",
            "Mean inter-token latency of each finished request",
            family.HISTOGRAM,
            buckets=ITL_BUCKETS,
        )
        self.queue = make(
            "tokenstream_request_queue_time_seconds",
            "Time from request received to its prefill start",
            family.HISTOGRAM,
            buckets=TTFT_BUCKETS,
        )
        self.tokens = make(
            "tokenstream_generation_tokens_total", "Output tokens generated", family.COUNTER
        )
        self.active = make(
            "tokenstream_active_streams", "Requests accepted and not yet finished", family.GAUGE
        )
        self.prompt_tokens = make(
            "tokenstream_prompt_tokens_total", "Prompt tokens of started requests", family.COUNTER
        )
        self.cached_tokens = make(
            "tokenstream_prefix_cache_reused_tokens_total",
            "Prompt tokens whose KV came from the prefix cache (not prefilled again)",
            family.COUNTER,
        )
        self.cache_hits = make(
            "tokenstream_prefix_cache_hits_total",
            "Started requests that reused a cached prefix",
            family.COUNTER,
        )
        self.waiting = make(
            "tokenstream_waiting_requests",
            "Requests accepted and waiting for a slot in the running batch",
            family.GAUGE,
        )
        self.rejected = make(
            "tokenstream_rejected_requests_total",
            "Requests refused (invalid or overloaded)",
            family.COUNTER,
        )
        # nv_inference_request_success counts refused and cancelled requests as successes
        requests = family(
            name="tokenstream_requests_total",
            description="Requests by outcome: ok, failed, cancelled, rejected (refused at entry)",
            kind=family.COUNTER,
        )
        self._families.append(requests)
        self.outcomes = {o: requests.Metric(labels=labels | {"outcome": o}) for o in OUTCOMES}

    def count(self, outcome: str) -> None:
        """One more request ended with `outcome` (one of OUTCOMES)."""
        self.outcomes[outcome].increment(1)


class TritonPythonModel:
    """The decoupled chat model."""

    def initialize(self, args):
        """Load the model, start the engine and the outbox thread."""
        config = json.loads(args["model_config"])
        self.settings = ModelSettings.from_config(config)
        device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])
        loaded = load_model(self.settings.model, self.settings.dtype, device)
        log.info("loaded %s on %s as %s", loaded.name, loaded.device, loaded.dtype)
        self.tokenizer = loaded.tokenizer
        self.engine = Engine(loaded, self.settings.engine).start()
        self.metrics = Metrics(args["model_name"], args["model_version"])
        # Every call into Triton after execute() (send, is_cancelled, metrics) is made from the
        # one outbox thread: calls racing from several stub threads crashed the server, and
        # is_cancelled() on a request already sent FINAL touches a released response sender.
        self.outbox: queue.Queue[TokenEvent | _Rejected | None] = queue.Queue()
        self.live: dict[str, _Live] = {}
        self.lock = threading.Lock()  # guards `live` and `counter` between execute and outbox
        self.counter = 0
        self.reported_active = 0  # the active-streams gauge's value (set by the outbox only)
        self.reported_waiting = 0  # the waiting-requests gauge's value (likewise)
        self.admin_key = os.environ.get(ADMIN_KEY_VARIABLE) or None  # None: no control requests
        self.draining = False  # set by a drain control request: new requests are refused
        self.outbox_thread = threading.Thread(target=self._outbox_loop, name="outbox", daemon=True)
        self.outbox_thread.start()

    def execute(self, requests):
        """Hand each request to the engine; responses are sent from the outbox thread."""
        for request in requests:
            self._accept(request)
        return None

    def finalize(self):
        """End in-flight streams (CANCELLED, sent by the outbox), then stop its thread."""
        self.engine.shutdown()
        self.outbox.put(None)
        self.outbox_thread.join(timeout=10)

    # ---- requests in ---------------------------------------------------------------------------

    def _accept(self, request) -> None:
        """Validate and submit one request; a bad one is queued for its error and FINAL."""
        received_ns = time.monotonic_ns()
        sender = request.get_response_sender()
        control = pb_utils.get_input_tensor_by_name(request, CONTROL)
        if control is not None:
            self.outbox.put(self._control(sender, control.as_numpy().reshape(-1)[0]))
            return
        with self.lock:
            self.counter += 1
            request_id = f"{self.counter}"
        try:
            if self.draining:
                raise EngineStopped(DRAINING)
            parsed = parse_request(_copy_inputs(request), request.parameters())
            prompt_ids = encode_prompt(
                self.tokenizer,
                text=parsed.text,
                messages=parsed.messages,
                input_ids=parsed.input_ids,
                tools=parsed.tools,
            )
            builder = ResponseBuilder(
                parsed, received_ns, prompt_text=_prompt_text(parsed, prompt_ids, self.tokenizer)
            )
            live = _Live(sender, builder)
            with self.lock:  # registered before submit: the first event may come at once
                self.live[request_id] = live
            builder.queued_ns = time.monotonic_ns()
            live.handle = self.engine.submit(
                prompt_ids,
                parsed.settings,
                request_id=request_id,
                logprobs=_wants_logprobs(parsed),
                sink=self.outbox,
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes this request's error
            with self.lock:
                self.live.pop(request_id, None)
            self.outbox.put(_Rejected(sender, exc))

    def _control(self, sender, raw: bytes) -> _Control | _Rejected:
        """A control request for the outbox, or its refusal (no or a wrong admin key)."""
        try:
            body = json.loads(raw)
            key, action = str(body["key"]), body["action"]
        except (ValueError, TypeError, KeyError):
            return _Rejected(sender, InvalidRequest(f"{CONTROL} must be JSON with key and action"))
        if self.admin_key is None or not hmac.compare_digest(key, self.admin_key):
            return _Rejected(sender, InvalidRequest(f"{CONTROL} needs the server's admin key"))
        if action not in CONTROL_ACTIONS:
            return _Rejected(sender, InvalidRequest(f"{CONTROL} action must be {CONTROL_ACTIONS}"))
        return _Control(sender, action)

    # ---- responses out: the only thread that calls Triton --------------------------------------

    def _outbox_loop(self) -> None:
        """Send responses in order; between them, poll cancellation at a bounded rate."""
        interval = self.settings.cancel_check_s
        next_check = time.monotonic() + interval
        while True:
            try:
                item = self.outbox.get(timeout=max(0.0, next_check - time.monotonic()))
            except queue.Empty:
                item = _TICK
            if item is None:
                break
            # nothing may end this thread: without it no request would ever be answered again
            try:
                self._handle(item)
                self._report_waiting()  # after every item and tick: within cancel_check_s
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + interval
                    self._poll_cancelled()
            except Exception:  # noqa: BLE001 - logged; the loop goes on
                log.exception("the outbox thread caught an error and goes on")

    def _handle(self, item) -> None:
        """One outbox item: a refusal, a control request or a token event."""
        if isinstance(item, _Rejected):
            # counted before the answer: a client that sees its refusal sees it counted
            self._count("rejected")
            self._quietly(self.metrics.rejected.increment, 1)
            _send_error(item.sender, item.error)
        elif isinstance(item, _Control):
            self._answer_control(item)
        elif isinstance(item, TokenEvent):
            self._deliver(item)

    def _answer_control(self, control: _Control) -> None:
        """Act on a control request, then answer it with the model's health (one FINAL)."""
        if control.action in (CONTROL_DRAIN, CONTROL_END):
            self.draining = True
        if control.action == CONTROL_END:
            log.warning("ending every open stream: the drain deadline passed")
            self.engine.shutdown()  # each stream's final error event comes back through us
        text = json.dumps(self._health())
        output = pb_utils.Tensor(TEXT_OUTPUT, _string_array(text))
        control.sender.send(pb_utils.InferenceResponse(output_tensors=[output]), flags=FINAL)

    def _health(self) -> dict:
        """The model's health (wire.HEALTH_KEYS) as the supervisor's canary reads it."""
        healthy, reason = self.engine.health()
        with self.lock:
            active = len(self.live)
        return {
            "healthy": healthy,
            "reason": reason,
            "draining": self.draining,
            "active": active,
            "waiting": self.engine.waiting_streams,
        }

    def _count(self, outcome: str) -> None:
        self._quietly(self.metrics.count, outcome)

    @staticmethod
    def _quietly(call, *args) -> None:
        """A metrics call whose failure is logged, never raised: metrics must not end a stream."""
        try:
            call(*args)
        except Exception:  # noqa: BLE001
            log.exception("a metrics call failed")

    def _deliver(self, event: TokenEvent) -> None:
        """Send one event's response; after a FINAL the request is forgotten."""
        with self.lock:
            live = self.live.get(event.request_id)
        if live is None:
            return
        self._report_active()  # before the response: a client that sees a token sees it counted
        try:
            self._send(live, event)
        except Exception as exc:  # noqa: BLE001 - a send failure ends that stream only
            log.exception("sending a response of request %s failed", event.request_id)
            if live.handle is not None:
                live.handle.cancel()
            if event.final:
                _send_error(live.sender, exc)
                event = _as_failed(event)
        if event.final:
            with self.lock:
                self.live.pop(event.request_id, None)
            self._count(_outcome(event))
            self._report_active()

    def _report_active(self) -> None:
        """Set the active-streams gauge when the number of live requests changed."""
        with self.lock:
            active = len(self.live)
        if active != self.reported_active:
            self._quietly(self.metrics.active.set, active)
            self.reported_active = active

    def _report_waiting(self) -> None:
        """Set the waiting-requests gauge when the engine's queue length changed."""
        waiting = self.engine.waiting_streams
        if waiting != self.reported_waiting:
            self._quietly(self.metrics.waiting.set, waiting)
            self.reported_waiting = waiting

    def _poll_cancelled(self) -> None:
        """Ask Triton (a round trip each) whether live requests were cancelled by their client."""
        with self.lock:
            entries = list(self.live.values())
        for entry in entries:  # none of these has had its FINAL: only this thread sends them
            if entry.handle is not None and not entry.handle.cancelled:
                try:
                    cancelled = entry.sender.is_cancelled()
                except Exception:  # noqa: BLE001 - one broken sender must not stop the polling
                    log.exception("is_cancelled() failed; cancelling that request")
                    cancelled = True
                if cancelled:
                    entry.handle.cancel()
        self._report_active()

    def _send(self, live: _Live, event: TokenEvent) -> None:
        self._quietly(self._observe, live, event)
        if event.error is not None or event.finish_reason is FinishReason.CANCELLED:
            _send_error(live.sender, event.error or Cancelled())
            return
        outputs = live.builder.outputs(event)
        if outputs is None:
            return
        tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
        live.sender.send(
            pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if event.final else 0
        )

    def _observe(self, live: _Live, event: TokenEvent) -> None:
        """Metrics: TTFT and queue time at the first token, mean ITL at the end."""
        if not event.token_ids:
            return
        self.metrics.tokens.increment(len(event.token_ids))
        if event.num_output_tokens == 1:
            self.metrics.prompt_tokens.increment(event.num_input_tokens)
            if event.cached_tokens:
                self.metrics.cache_hits.increment(1)
                self.metrics.cached_tokens.increment(event.cached_tokens)
            received = live.builder.received_ns
            self.metrics.ttft.observe((event.emitted_ns - received) / 1e9)
            self.metrics.queue.observe((event.scheduled_ns - received) / 1e9)
            live.first_emitted_ns = event.emitted_ns
        elif event.final:
            first = live.first_emitted_ns
            self.metrics.tpot.observe(
                (event.emitted_ns - first) / 1e9 / (event.num_output_tokens - 1)
            )


@dataclass(frozen=True)
class _Rejected:
    """A request refused in execute(): its error response waits in the outbox."""

    sender: object
    error: Exception


@dataclass(frozen=True)
class _Control:
    """An accepted control request (wire.CONTROL_ACTIONS), answered by the outbox."""

    sender: object
    action: str


_TICK = object()  # the outbox's "no item, time to poll cancellation"


def _string_array(text: str) -> np.ndarray:
    """A STRING tensor's [1] array holding `text`."""
    return np.array([text.encode()], dtype=np.object_)


def _outcome(event: TokenEvent) -> str:
    """How a finished stream counts in tokenstream_requests_total."""
    if event.finish_reason is FinishReason.CANCELLED:
        return "cancelled"
    return "failed" if event.error is not None else "ok"


def _as_failed(event: TokenEvent) -> TokenEvent:
    """The final event as it counts once its response could not be sent."""
    return replace(event, finish_reason=FinishReason.ERROR, error=StreamingError("send failed"))


def _copy_inputs(request) -> dict:
    """Copy every input out of Triton's memory (released when execute returns)."""
    arrays = {}
    for name in INPUT_NAMES:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            arrays[name] = tensor.as_numpy().copy()
    return arrays


def _prompt_text(parsed: ModelRequest, prompt_ids, tokenizer) -> str:
    """The prompt as text, prepended to a non-streamed answer (as the vLLM backend does)."""
    if parsed.stream or parsed.exclude_input:
        return ""
    return parsed.text if parsed.text is not None else tokenizer.decode(prompt_ids)


def _wants_logprobs(parsed: ModelRequest) -> bool:
    return parsed.wants(RETURN_LOGPROBS) or parsed.wants(RETURN_CUMULATIVE_LOGPROB)


def _error_code(exc: Exception):
    """The Triton error code of an exception (wire.ErrorKind names it)."""
    kind = exc.kind.triton_code if isinstance(exc, StreamingError) else "INTERNAL"
    return getattr(pb_utils.TritonError, kind)


def _send_error(sender, exc: Exception) -> None:
    """The request's only remaining response: its error, with FINAL."""
    message = str(exc) if isinstance(exc, StreamingError) else f"internal error: {exc!r}"
    error = pb_utils.TritonError(message, _error_code(exc))
    try:
        sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
    except Exception:  # noqa: BLE001 - the client may be gone; nothing else to do
        log.exception("could not send the error response")
