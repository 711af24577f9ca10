"""The client layer and the bridge when the server lets them down: a model that never answers
(idle timeout), a lost connection (a clear message), readiness beyond Triton's own, and cancels
that must not leak threads."""

from __future__ import annotations

import threading
import time

import pytest
from bridge_support import bridge_to, frame, http_get, next_frame, ws_url
from conftest import wait_for
from websockets.asyncio.client import connect

from clients.library.failover import retryable
from clients.library.grpc_client import (
    AsyncChatClient,
    GenerateRequest,
    GenerationError,
    stream_generate,
    to_generation_error,
)
from streaming_backend.launcher import ServerConfig, TritonServer, free_port
from streaming_backend.wire import (
    BOOL_INPUTS,
    CANCELLED,
    CHAT_MODEL,
    INPUT_IDS,
    SERVER_LOST,
    STRING_INPUTS,
    TEXT_OUTPUT,
    UNAVAILABLE,
)


# A decoupled model that takes every request and never answers: what a client sees of a stream
# whose model process died under it.
def silent_config() -> str:
    """The config of a `chat` model that takes the real model's inputs (all optional)."""
    types = {name: "TYPE_BOOL" for name in BOOL_INPUTS}
    types |= {name: "TYPE_STRING" for name in STRING_INPUTS} | {INPUT_IDS: "TYPE_INT64"}
    inputs = ", ".join(
        f'{{ name: "{name}" data_type: {kind} dims: [ -1 ] optional: true }}'
        for name, kind in types.items()
    )
    return (
        f'name: "{CHAT_MODEL}"\nbackend: "python"\nmax_batch_size: 0\n'
        "model_transaction_policy { decoupled: true }\n"
        f"input [ {inputs} ]\n"
        f'output [ {{ name: "{TEXT_OUTPUT}" data_type: TYPE_STRING dims: [ -1 ] }} ]\n'
        "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
    )


SILENT_MODEL = """\
class TritonPythonModel:
    def execute(self, requests):
        self.kept = getattr(self, "kept", []) + list(requests)  # held, never answered
        return None
"""


@pytest.fixture(scope="module")
def silent_server(tmp_path_factory):
    """A real tritonserver whose `chat` model never answers."""
    repository = tmp_path_factory.mktemp("silent") / "repository"
    (repository / "chat" / "1").mkdir(parents=True)
    (repository / "chat" / "config.pbtxt").write_text(silent_config())
    (repository / "chat" / "1" / "model.py").write_text(SILENT_MODEL)
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    server = TritonServer(ServerConfig(repository=repository, **ports), on_log=None)
    server.start()
    try:
        server.wait_ready(timeout=120)
        yield server
    finally:
        server.stop(graceful=False)  # nothing to drain


def test_a_lost_connection_reads_as_the_server_gone_away() -> None:
    """gRPC's "Socket closed" becomes an `unavailable` error that says what happened."""
    import grpc

    class Lost(grpc.RpcError):
        def details(self):
            return "Stream removed (Socket closed)"

        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    error = to_generation_error(Lost())
    assert error.code == UNAVAILABLE.code
    assert SERVER_LOST in error.message and "Socket closed" in error.message


def test_a_stream_cancelled_by_the_server_is_retried_elsewhere() -> None:
    """A stream opened as tritonserver stops can end CANCELLED with nothing received (its gRPC
    endpoint shut down under it; seen about once in 400 streams): that is the server gone, an
    `unavailable` error that failover retries on another replica, not a cancel the client made."""
    import grpc
    from tritonclient.utils import InferenceServerException

    class ShutDown(grpc.RpcError):
        def details(self):
            return "CANCELLED"

        def code(self):
            return grpc.StatusCode.CANCELLED

    error = to_generation_error(ShutDown())
    assert (error.code, error.retryable) == (UNAVAILABLE.code, True)
    assert SERVER_LOST in error.message and retryable(error, responses=0)
    ours = InferenceServerException("Locally cancelled by application!", "StatusCode.CANCELLED")
    assert to_generation_error(ours).code == CANCELLED.code


@pytest.mark.server
def test_sync_generation_gives_up_after_the_idle_timeout(silent_server) -> None:
    """stream_generate raises `unavailable` once nothing arrived for idle_timeout_s."""
    started = time.monotonic()
    request = GenerateRequest(prompt="hello")
    with pytest.raises(GenerationError) as failed:
        list(stream_generate(silent_server.grpc_url, request, idle_timeout_s=1.0))
    took = time.monotonic() - started
    assert failed.value.code == UNAVAILABLE.code and "no response" in failed.value.message
    assert 1.0 <= took < 10.0


@pytest.mark.server
async def test_async_generation_gives_up_after_the_idle_timeout(silent_server) -> None:
    """AsyncChatClient.generate raises `unavailable` once nothing arrived for idle_timeout_s."""
    async with AsyncChatClient(silent_server.grpc_url, idle_timeout_s=1.0) as client:
        started = time.monotonic()
        with pytest.raises(GenerationError) as failed:
            async for _ in client.generate(GenerateRequest(prompt="hello")):
                pass
    assert failed.value.code == UNAVAILABLE.code
    assert 1.0 <= time.monotonic() - started < 10.0


@pytest.mark.server
def test_cancelled_generations_leave_no_thread_behind(paced_server) -> None:
    """Twelve generations cancelled mid-answer: the thread count comes back to where it was
    (tritonclient alone leaves gRPC's request-feeding thread blocked per cancelled stream)."""
    request = GenerateRequest(prompt="hello", sampling={"max_tokens": 100, "ignore_eos": True})
    list(stream_generate(paced_server.grpc_url, GenerateRequest(prompt="warm up")))
    before = threading.active_count()
    for _ in range(12):
        cancel = threading.Event()
        chunks = stream_generate(paced_server.grpc_url, request, cancel=cancel)
        next(chunks)  # the answer runs
        cancel.set()
        assert list(chunks) == []
    wait_for(lambda: threading.active_count() <= before, timeout=10)


@pytest.mark.server
async def test_bridge_generation_gives_up_after_the_upstream_idle_timeout(silent_server) -> None:
    """A bridge generation that hears nothing from Triton ends with one `unavailable` error."""
    async with bridge_to(silent_server, upstream_idle_timeout_s=1.0) as bridge:
        async with connect(ws_url(bridge)) as ws:
            await ws.send(frame(type="generate", id="g", prompt="hello"))
            got = await next_frame(ws, timeout=15)
    assert got["type"] == "error" and got["id"] == "g", got
    assert got["code"] == UNAVAILABLE.code and "no response" in got["message"]


@pytest.mark.server
async def test_bridge_readiness_also_asks_the_supervisor(silent_server) -> None:
    """With also_ready false (serve: Triton draining or recovering) /healthz says 503 and a new
    generation gets `unavailable`, although Triton itself is ready."""
    async with bridge_to(silent_server, also_ready=lambda: False) as bridge:
        status, _, body = await http_get(bridge, "/healthz")
        async with connect(ws_url(bridge)) as ws:
            await ws.send(frame(type="generate", id="g", prompt="hello"))
            got = await next_frame(ws, timeout=15)
    assert status == 503 and b'"ready": false' in body
    assert got["type"] == "error" and got["code"] == UNAVAILABLE.code
