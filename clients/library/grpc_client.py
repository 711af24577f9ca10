"""A small client library for the `chat` model over tritonclient gRPC streams (sync and asyncio).

Each generation runs on its own bidirectional gRPC stream. Triton cancels requests per *stream*
(a client cancels the stream's RPC, Triton marks every request on it cancelled), so a stream per
generation is what lets one answer be stopped while others go on. The asyncio client shares one
channel (one HTTP/2 connection) among all its streams, so the extra streams cost little.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from clients.library.chunk import (
    DEFAULT_IDLE_TIMEOUT_S,
    Chunk,
    GenerationError,
    idle_error,
    parse_logprobs,
    parse_timing,
    within_idle_timeout,
)
from clients.library.failover import failover, failover_sync
from clients.library.request import GenerateRequest, request_inputs
from clients.library.targets import channel_args
from streaming_backend.wire import (
    CHAT_MODEL,
    ENABLE_EMPTY_FINAL,
    FINAL_RESPONSE,
    FINISH_REASON,
    LOGPROBS,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    OUTPUT_IDS,
    SERVER_LOST,
    SYSTEM_FINGERPRINT,
    TEXT_OUTPUT,
    TIMING,
    UNAVAILABLE,
    error_code,
)

__all__ = [  # the request and chunk types are re-exported for the chat CLI and the bridge
    "AsyncChatClient",
    "Chunk",
    "GenerateRequest",
    "GenerationError",
    "build_inputs",
    "parse_result",
    "stream_generate",
]

MODEL_NAME = CHAT_MODEL
# A readiness probe that ended in one of these got no answer from the server (vs a "not ready").
_NO_ANSWER = (str(grpc.StatusCode.DEADLINE_EXCEEDED), str(grpc.StatusCode.UNAVAILABLE))
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
# What every channel gets: the above plus round_robin over the replicas a target names (targets.py)
BALANCED_CHANNEL_ARGS = channel_args(CHANNEL_ARGS)


def _tensor(name: str, value: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


def _string(name: str, text: str) -> grpcclient.InferInput:
    return _tensor(name, np.array([text.encode("utf-8")], dtype=np.object_), "BYTES")


def _bool(name: str, flag: bool) -> grpcclient.InferInput:
    return _tensor(name, np.array([flag], dtype=np.bool_), "BOOL")


def _input(name: str, value: str | bool | tuple[int, ...]) -> grpcclient.InferInput:
    """One input tensor: str -> BYTES [1], bool -> BOOL [1], token ids -> INT64 [n]."""
    if isinstance(value, bool):
        return _bool(name, value)
    if isinstance(value, str):
        return _string(name, value)
    return _tensor(name, np.array(value, dtype=np.int64), "INT64")


def build_inputs(request: GenerateRequest) -> list[grpcclient.InferInput]:
    """The input tensors of the `chat` model for one request."""
    return [_input(name, value) for name, value in request_inputs(request).items()]


def _first_string(result: grpcclient.InferResult, name: str) -> str | None:
    value = result.as_numpy(name)
    if value is None or value.size == 0:
        return None
    item = value.reshape(-1)[0]
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def _first_int(result: grpcclient.InferResult, name: str) -> int | None:
    value = result.as_numpy(name)
    return None if value is None or value.size == 0 else int(value.reshape(-1)[0])


def _cancelled_by_server(message: str, status: str) -> bool:
    """A CANCELLED status this client did not cause: the server's gRPC endpoint shut down under
    the stream (seen on streams opened as tritonserver stops). A cancel of our own never reaches
    here as an error (the async stream raises CancelledError) or says "Locally cancelled"."""
    return status == str(grpc.StatusCode.CANCELLED) and "locally cancelled" not in message.lower()


def to_generation_error(error: InferenceServerException | grpc.RpcError) -> GenerationError:
    """A GenerationError carrying the server's message from a tritonclient or gRPC error."""
    if isinstance(error, InferenceServerException):
        message, status = error.message(), error.status()
    else:
        message, status = str(error.details()), str(error.code())
    if any(sign in message for sign in _CONNECTION_LOST) or _cancelled_by_server(message, status):
        return GenerationError(f"{UNAVAILABLE.prefix}: {SERVER_LOST} ({message})", UNAVAILABLE.code)
    return GenerationError(message, error_code(message, status))


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
        timing=parse_timing(timing),
        final=response.parameters[FINAL_RESPONSE].bool_param,
        request_id=response.id,
        received_ns=time.monotonic_ns() if received_ns is None else received_ns,
        logprobs=parse_logprobs(_first_string(result, LOGPROBS)),
        system_fingerprint=_first_string(result, SYSTEM_FINGERPRINT),
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

    `url` is any target of targets.py; a stream that fails as unavailable before its first
    response is retried on another replica (failover.py). Raises GenerationError (code
    `unavailable`) when nothing arrives for `idle_timeout_s`.
    """
    request_id = request_id or uuid.uuid4().hex
    return failover_sync(
        lambda: _stream_once(url, request, model, request_id, cancel, idle_timeout_s)
    )


def _stream_once(
    url: str,
    request: GenerateRequest,
    model: str,
    request_id: str,
    cancel: threading.Event | None,
    idle_timeout_s: float | None,
) -> Iterator[Chunk]:
    """One attempt of stream_generate: one channel, one stream."""
    responses: queue.SimpleQueue = queue.SimpleQueue()

    def on_response(result=None, error=None):
        responses.put((result, error, time.monotonic_ns()))

    client = grpcclient.InferenceServerClient(url, channel_args=BALANCED_CHANNEL_ARGS)
    finished = False
    try:
        client.start_stream(callback=on_response)
        client.async_stream_infer(
            model,
            build_inputs(request),
            request_id=request_id,
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
    """Asyncio client: many concurrent generations, one stream each, over one gRPC channel.

    `url` is any target of targets.py (one replica, `dns:///name:port`, `ipv4:a:p,b:p`):
    round_robin sends each generation's stream to the next replica.
    """

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
        self._client = grpcaio.InferenceServerClient(url, channel_args=BALANCED_CHANNEL_ARGS)

    async def __aenter__(self) -> AsyncChatClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; running generations fail."""
        await self._client.close()

    async def is_ready(self, timeout_s: float = 2.0) -> bool:
        """True when the server and the model answer ready."""
        return await self.readiness(timeout_s) is True

    async def readiness(self, timeout_s: float = 2.0) -> bool | None:
        """True when the server and the model answer ready, False when the server answers that
        they are not, None when no answer came (a timeout, or nothing listening)."""
        try:
            return bool(
                await self._client.is_server_ready(client_timeout=timeout_s)
                and await self._client.is_model_ready(self.model, client_timeout=timeout_s)
            )
        except InferenceServerException as exc:
            return None if str(exc.status()) in _NO_ANSWER else False
        except grpc.RpcError as exc:
            return None if str(exc.code()) in _NO_ANSWER else False

    def generate(
        self, request: GenerateRequest, request_id: str | None = None
    ) -> AsyncIterator[Chunk]:
        """Stream one generation; closing the iterator early (aclose) cancels it upstream.

        A stream that fails as unavailable before its first response is retried on another
        replica (failover.py); after that, errors are raised as they come.
        """
        request_id = request_id or uuid.uuid4().hex
        return failover(lambda: self._generate_once(request, request_id))

    async def _generate_once(
        self, request: GenerateRequest, request_id: str
    ) -> AsyncIterator[Chunk]:
        """One attempt of generate(): one gRPC stream."""
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
        result, error = await within_idle_timeout(responses.__anext__(), idle_timeout_s)
    except StopAsyncIteration:
        raise GenerationError("stream ended before the final response", UNAVAILABLE.code) from None
    except grpc.RpcError as exc:
        raise to_generation_error(exc) from None
    received_ns = time.monotonic_ns()
    if error is not None:
        raise to_generation_error(error)
    return parse_result(result, received_ns)
