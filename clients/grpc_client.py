"""A small client library for the `chat` model over tritonclient gRPC streams (sync and asyncio).

Each generation runs on its own bidirectional gRPC stream. Triton cancels requests per *stream*
(a client cancels the stream's RPC, Triton marks every request on it cancelled), so a stream per
generation is what lets one answer be stopped while others go on. The asyncio client shares one
channel (one HTTP/2 connection) among all its streams, so the extra streams cost little.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from clients.chunk import Chunk
from streaming_backend.wire import (
    CHAT_MODEL,
    ENABLE_EMPTY_FINAL,
    EXCLUDE_INPUT_IN_OUTPUT,
    FINAL_RESPONSE,
    FINISH_REASON,
    INPUT_IDS,
    INTERNAL,
    MESSAGES,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    OUTPUT_IDS,
    RETURN_FINISH_REASON,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    RETURN_OUTPUT_IDS,
    RETURN_TIMING,
    SAMPLING_PARAMETERS,
    SERVER_LOST,
    STREAM,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TIMING,
    UNAVAILABLE,
    error_code,
)

MODEL_NAME = CHAT_MODEL
# A generation that receives nothing for this long ends with an `unavailable` error instead of
# waiting forever (a server that lost the stream without closing it). Long enough for a request
# that queues behind a full engine on a CPU; callers with tighter needs pass their own.
DEFAULT_IDLE_TIMEOUT_S = 120.0
# What gRPC says when the connection under a stream is gone (tritonserver died or restarted).
_CONNECTION_LOST = ("Socket closed", "Stream removed", "GOAWAY", "Connection reset", "Broken pipe")

# gRPC channel: Triton's limits plus a short reconnect backoff, so a client notices a restarted
# server within about two seconds instead of gRPC's default of up to two minutes.
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class GenerationError(Exception):
    """A generation failed; `code` is a category, the message is the server's own."""

    def __init__(self, message: str, code: str = INTERNAL.code) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: exactly one of prompt, messages, input_ids, plus settings and flags."""

    prompt: str | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    input_ids: Sequence[int] | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    stream: bool = True
    exclude_input_in_output: bool = True
    return_finish_reason: bool = True
    return_num_input_tokens: bool = True
    return_num_output_tokens: bool = True
    return_output_ids: bool = False
    return_timing: bool = False

    def __post_init__(self) -> None:
        given = [x is not None for x in (self.prompt, self.messages, self.input_ids)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, messages, input_ids")
        # Copies, so a caller mutating its list afterwards cannot change a sent request.
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        if self.input_ids is not None:
            object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        object.__setattr__(self, "sampling", dict(self.sampling))


def _tensor(name: str, value: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def _string(name: str, text: str) -> grpcclient.InferInput:
    return _tensor(name, np.array([text.encode("utf-8")], dtype=np.object_), "BYTES")


def _bool(name: str, flag: bool) -> grpcclient.InferInput:
    return _tensor(name, np.array([flag], dtype=np.bool_), "BOOL")


def build_inputs(request: GenerateRequest) -> list[grpcclient.InferInput]:
    """The input tensors of the `chat` model for one request."""
    if request.prompt is not None:
        inputs = [_string(TEXT_INPUT, request.prompt)]
    elif request.messages is not None:
        inputs = [_string(MESSAGES, json.dumps(list(request.messages), ensure_ascii=False))]
    else:
        ids = np.array(request.input_ids, dtype=np.int64)
        inputs = [_tensor(INPUT_IDS, ids, "INT64")]
    if request.sampling:
        inputs.append(_string(SAMPLING_PARAMETERS, json.dumps(dict(request.sampling))))
    flags = {
        STREAM: request.stream,
        EXCLUDE_INPUT_IN_OUTPUT: request.exclude_input_in_output,
        RETURN_FINISH_REASON: request.return_finish_reason,
        RETURN_NUM_INPUT_TOKENS: request.return_num_input_tokens,
        RETURN_NUM_OUTPUT_TOKENS: request.return_num_output_tokens,
        RETURN_OUTPUT_IDS: request.return_output_ids,
        RETURN_TIMING: request.return_timing,
    }
    return inputs + [_bool(name, flag) for name, flag in flags.items()]


def _first_string(result: grpcclient.InferResult, name: str) -> str | None:
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def _first_int(result: grpcclient.InferResult, name: str) -> int | None:
    value = result.as_numpy(name)
    return None if value is None or value.size == 0 else int(value.reshape(-1)[0])


def to_generation_error(error: InferenceServerException | grpc.RpcError) -> GenerationError:
    """A GenerationError carrying the server's message from a tritonclient or gRPC error."""
    if isinstance(error, InferenceServerException):
        message, status = error.message(), error.status()
    else:
        message, status = str(error.details()), str(error.code())
    if any(sign in message for sign in _CONNECTION_LOST):
        return GenerationError(f"{UNAVAILABLE.prefix}: {SERVER_LOST} ({message})", UNAVAILABLE.code)
    return GenerationError(message, error_code(message, status))


def idle_error(seconds: float) -> GenerationError:
    """The error of a generation that received nothing for `seconds`."""
    text = f"{UNAVAILABLE.prefix}: no response from the server for {seconds:g} s; gave up"
    return GenerationError(text, UNAVAILABLE.code)


def parse_result(result: grpcclient.InferResult, received_ns: int | None = None) -> Chunk:
    """One Chunk from one InferResult of the `chat` model."""
    response = result.get_response()
    timing = _first_string(result, TIMING)
    output_ids = result.as_numpy(OUTPUT_IDS)
    return Chunk(
        text=_first_string(result, TEXT_OUTPUT) or "",
        num_output_tokens=_first_int(result, NUM_OUTPUT_TOKENS),
        num_input_tokens=_first_int(result, NUM_INPUT_TOKENS),
        output_ids=None if output_ids is None else tuple(int(t) for t in output_ids.reshape(-1)),
        finish_reason=_first_string(result, FINISH_REASON),
        timing=None if timing is None else json.loads(timing),
        final=response.parameters[FINAL_RESPONSE].bool_param,
        request_id=response.id,
        received_ns=time.monotonic_ns() if received_ns is None else received_ns,
    )


def stream_generate(
    url: str,
    request: GenerateRequest,
    *,
    model: str = MODEL_NAME,
    request_id: str | None = None,
    cancel: threading.Event | None = None,
    idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
) -> Iterator[Chunk]:
    """Stream one generation synchronously; setting `cancel` or closing the iterator cancels it.

    Raises GenerationError (code `unavailable`) when nothing arrives for `idle_timeout_s`.
    """
    responses: queue.SimpleQueue = queue.SimpleQueue()

    def on_response(result=None, error=None):
        responses.put((result, error, time.monotonic_ns()))

    client = grpcclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)
    finished = False
    try:
        client.start_stream(callback=on_response)
        client.async_stream_infer(
            model,
            build_inputs(request),
            request_id=request_id or uuid.uuid4().hex,
            enable_empty_final_response=True,
        )
        while not finished:
            item = _next_response(responses, cancel, idle_timeout_s)
            if item is None:
                return
            result, error, received_ns = item
            if error is not None:
                finished = True
                raise to_generation_error(error)
            chunk = parse_result(result, received_ns)
            finished = chunk.final
            yield chunk
    finally:
        # Cancelling the stream is how Triton learns to stop this request (is_cancelled()).
        stop_stream(client, cancel=not finished)
        client.close()


def stop_stream(client: grpcclient.InferenceServerClient, cancel: bool) -> None:
    """tritonclient's stop_stream, without leaking a thread when it cancels.

    With cancel_requests=True tritonclient (2.51) never queues the end marker of its request
    iterator, so gRPC's thread that feeds requests into the stream blocks on that queue forever:
    one thread per cancelled generation. We queue the marker ourselves.
    """
    stream = getattr(client, "_stream", None)
    client.stop_stream(cancel_requests=cancel)
    feed = getattr(stream, "_request_queue", None)
    if cancel and feed is not None:
        feed.put(None)  # the iterator's end: the feeding thread returns


def _next_response(
    responses: queue.SimpleQueue, cancel: threading.Event | None, idle_timeout_s: float | None
):
    """The next (result, error, received_ns); None once `cancel` is set; GenerationError after
    `idle_timeout_s` without one."""
    deadline = None if idle_timeout_s is None else time.monotonic() + idle_timeout_s
    while cancel is None or not cancel.is_set():
        if deadline is not None and time.monotonic() >= deadline:
            raise idle_error(idle_timeout_s)
        try:
            # A short timeout keeps both the cancel event and Ctrl-C responsive.
            return responses.get(timeout=0.05)
        except queue.Empty:
            continue
    return None


class AsyncChatClient:
    """Asyncio client: many concurrent generations, one stream each, over one gRPC channel."""

    def __init__(
        self,
        url: str,
        model: str = MODEL_NAME,
        idle_timeout_s: float | None = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        """`idle_timeout_s`: a generation receiving nothing this long fails (`unavailable`)."""
        self.url = url
        self.model = model
        self.idle_timeout_s = idle_timeout_s
        self._client = grpcaio.InferenceServerClient(url, channel_args=CHANNEL_ARGS)

    async def __aenter__(self) -> AsyncChatClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; running generations fail."""
        await self._client.close()

    async def is_ready(self, timeout_s: float = 2.0) -> bool:
        """True when the server and the model answer ready."""
        try:
            return bool(
                await self._client.is_server_ready(client_timeout=timeout_s)
                and await self._client.is_model_ready(self.model, client_timeout=timeout_s)
            )
        except (InferenceServerException, grpc.RpcError):
            return False

    async def generate(
        self, request: GenerateRequest, request_id: str | None = None
    ) -> AsyncIterator[Chunk]:
        """Stream one generation; closing the iterator early (aclose) cancels it upstream."""
        request_id = request_id or uuid.uuid4().hex
        answered = asyncio.Event()

        async def requests():
            yield {
                "model_name": self.model,
                "inputs": build_inputs(request),
                "request_id": request_id,
                "parameters": {ENABLE_EMPTY_FINAL: True},
            }
            # Keep our half of the stream open until the answer is complete.
            await answered.wait()

        responses = self._client.stream_infer(requests())
        finished = False
        try:
            while not finished:
                chunk = await _next_chunk(responses, self.idle_timeout_s)
                finished = chunk.final
                yield chunk
        except GenerationError:
            finished = True
            raise
        finally:
            answered.set()
            if not finished:
                responses.cancel()


async def _next_chunk(responses, idle_timeout_s: float | None) -> Chunk:
    """The next Chunk of an aio response stream; errors (and silence) become GenerationError."""
    try:
        result, error = await asyncio.wait_for(responses.__anext__(), idle_timeout_s)
    except asyncio.TimeoutError:
        raise idle_error(idle_timeout_s) from None
    except StopAsyncIteration:
        raise GenerationError("stream ended before the final response", UNAVAILABLE.code) from None
    except grpc.RpcError as exc:
        raise to_generation_error(exc) from None
    received_ns = time.monotonic_ns()
    if error is not None:
        raise to_generation_error(error)
    return parse_result(result, received_ns)
