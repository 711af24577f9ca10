"""Tests of clients/library/grpc_client.py: request tensors, response parsing, errors, live
streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time

import numpy as np
import pytest
from bridge_support import active_streams, tokens_generated
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
)

from clients.library import grpc_client as gc
from streaming_backend import wire
from streaming_backend.wire import ServerTiming


def _inputs_by_name(request: gc.GenerateRequest) -> dict[str, np.ndarray]:
    """Decode the InferInput list of a request back into numpy arrays by tensor name."""
    decoded = {}
    for tensor in gc.build_inputs(request):
        proto, raw = tensor._get_tensor(), tensor._get_content()
        if proto.datatype == "BYTES":
            value = deserialize_bytes_tensor(raw)
        elif proto.datatype == "BOOL":
            value = np.frombuffer(raw, dtype=np.bool_)
        else:
            value = np.frombuffer(raw, dtype=np.int64)
        assert list(proto.shape) == [value.size]
        decoded[proto.name] = value
    return decoded


def _result(outputs: dict[str, np.ndarray], final: bool = False, rid: str = "r1") -> InferResult:
    """An InferResult as the gRPC stream would deliver it."""
    response = service_pb2.ModelInferResponse(id=rid, model_name="chat")
    types = {np.dtype(np.uint32): "UINT32", np.dtype(np.int64): "INT64"}
    for name, value in outputs.items():
        out = response.outputs.add(name=name, shape=list(value.shape))
        if value.dtype == np.object_:
            out.datatype = "BYTES"
            response.raw_output_contents.append(serialize_byte_tensor(value).item())
        else:
            out.datatype = types[value.dtype]
            response.raw_output_contents.append(value.tobytes())
    response.parameters[wire.FINAL_RESPONSE].bool_param = final
    return InferResult(response)


def test_prompt_request_builds_text_input_and_flags():
    """A prompt request sends text_input, stream=true and the return flags."""
    req = gc.GenerateRequest(prompt="héllo 你好 🙂", sampling={"max_tokens": 8}, return_timing=True)
    tensors = _inputs_by_name(req)
    assert tensors[wire.TEXT_INPUT][0].decode() == "héllo 你好 🙂"
    assert json.loads(tensors[wire.SAMPLING_PARAMETERS][0]) == {"max_tokens": 8}
    assert tensors[wire.STREAM][0] and tensors[wire.RETURN_TIMING][0]
    assert not tensors[wire.RETURN_OUTPUT_IDS][0] and not tensors[wire.RETURN_SYSTEM_FINGERPRINT][0]
    assert wire.MESSAGES not in tensors and wire.INPUT_IDS not in tensors


def test_messages_request_sends_json_messages():
    """A messages request sends the list as JSON in `messages` and no text_input."""
    messages = [{"role": "user", "content": "数一数 🐍"}]
    tensors = _inputs_by_name(gc.GenerateRequest(messages=messages))
    assert json.loads(tensors[wire.MESSAGES][0].decode()) == messages
    assert wire.TEXT_INPUT not in tensors
    assert wire.SAMPLING_PARAMETERS not in tensors  # empty settings are not sent


def test_input_ids_request_sends_int64_tensor():
    """An input_ids request sends an INT64 tensor of shape [n]."""
    tensors = _inputs_by_name(gc.GenerateRequest(input_ids=[1, 2, 3]))
    assert tensors[wire.INPUT_IDS].tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    "kwargs", [{}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}]
)
def test_request_needs_exactly_one_prompt_source(kwargs):
    """Zero or two prompt sources are refused when the request is built."""
    with pytest.raises(ValueError, match="exactly one"):
        gc.GenerateRequest(**kwargs)


def test_request_copies_its_inputs():
    """Mutating the caller's list or dict afterwards does not change the request."""
    messages = [{"role": "user", "content": "hi"}]
    sampling = {"seed": 1}
    req = gc.GenerateRequest(messages=messages, sampling=sampling)
    messages[0]["content"] = "changed"
    sampling["seed"] = 2
    assert req.messages[0]["content"] == "hi" and req.sampling == {"seed": 1}


def test_parse_result_reads_every_output():
    """parse_result maps each output tensor and the final flag onto a Chunk."""
    timing = {"clock": "monotonic", "received_ns": 1, "queued_ns": 2, "prefill_start_ns": 3}
    timing["emitted_ns"] = 5
    result = _result(
        {
            wire.TEXT_OUTPUT: np.array(["好🙂".encode()], dtype=np.object_),
            wire.NUM_OUTPUT_TOKENS: np.array([2], dtype=np.uint32),
            wire.NUM_INPUT_TOKENS: np.array([7], dtype=np.uint32),
            wire.OUTPUT_IDS: np.array([11, 12], dtype=np.int64),
            wire.FINISH_REASON: np.array([b"length"], dtype=np.object_),
            wire.TIMING: np.array([json.dumps(timing).encode()], dtype=np.object_),
            wire.SYSTEM_FINGERPRINT: np.array([b"fp_0123456789ab"], dtype=np.object_),
        },
        final=True,
    )
    chunk = gc.parse_result(result, received_ns=42)
    assert chunk == gc.Chunk(
        text="好🙂",
        num_output_tokens=2,
        num_input_tokens=7,
        output_ids=(11, 12),
        finish_reason="length",
        timing=ServerTiming(1, 2, 3, 5),
        final=True,
        request_id="r1",
        received_ns=42,
        system_fingerprint="fp_0123456789ab",
    )


def test_parse_result_missing_outputs_are_none():
    """Outputs the request did not ask for come back as None, text as ''."""
    chunk = gc.parse_result(_result({}))
    assert chunk.text == "" and not chunk.final
    assert chunk.num_output_tokens is None and chunk.output_ids is None and chunk.timing is None
    assert chunk.system_fingerprint is None
    assert chunk.received_ns > 0


@pytest.mark.parametrize(
    ("message", "status", "code"),
    [
        ("invalid request: top_p must be in (0, 1]", None, "invalid_request"),
        ("overloaded: queue is full", None, "overloaded"),
        ("cancelled", None, "cancelled"),
        ("internal error: boom", None, "internal"),
        ("failed to connect to all addresses", "StatusCode.UNAVAILABLE", "unavailable"),
        ("Locally cancelled by application!", "StatusCode.CANCELLED", "cancelled"),
        ("something else", None, "internal"),
    ],
)
def test_error_codes(message, status, code):
    """Server messages and gRPC statuses map to error categories; the message is kept."""
    err = gc.to_generation_error(InferenceServerException(msg=message, status=status))
    assert (err.code, err.message, str(err)) == (code, message, message)


# ---------------------------------------------------------------- against the real tritonserver


LONG = {"max_tokens": 220, "ignore_eos": True}


@pytest.mark.server
def test_stream_generate_sync(triton_server):
    """The sync stream yields text deltas and counts; only the last chunk is final."""
    request = gc.GenerateRequest(
        messages=[{"role": "user", "content": "Hi 你好"}],
        sampling={"max_tokens": "8", "seed": 5, "ignore_eos": True},
        return_output_ids=True,
        return_timing=True,
        return_system_fingerprint=True,
    )
    chunks = list(gc.stream_generate(triton_server.grpc_url, request))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert sum(c.num_output_tokens for c in chunks) == 8
    assert sum(len(c.output_ids) for c in chunks) == 8
    assert chunks[-1].finish_reason == "length" and chunks[0].num_input_tokens > 0
    t = chunks[0].timing
    assert t.received_ns <= t.queued_ns <= t.prefill_start_ns <= t.emitted_ns
    assert t.emitted_ns <= chunks[0].received_ns  # one clock on one machine
    assert len({c.system_fingerprint for c in chunks}) == 1  # every response names the numerics
    assert re.fullmatch(r"fp_[0-9a-f]{12}", chunks[0].system_fingerprint)


@pytest.mark.server
def test_stream_generate_error_carries_servers_message(triton_server):
    """A refused request raises GenerationError with the server's own message."""
    request = gc.GenerateRequest(prompt="x", sampling={"top_p": 2})
    with pytest.raises(gc.GenerationError) as info:
        list(gc.stream_generate(triton_server.grpc_url, request))
    assert info.value.code == "invalid_request"
    assert info.value.message.startswith("invalid request:") and "top_p" in info.value.message


@pytest.mark.server
def test_stream_generate_cancel_event(paced_server):
    """Setting the cancel event ends the iteration and the server stops the request (paced: the
    220 tokens take at least 4.4 s, so only a cancel that never arrived lets them all out; on the
    unpaced tiny model they took about half a second, which a loaded machine's cancel missed)."""
    cancel = threading.Event()
    before = tokens_generated(paced_server)
    seen = 0
    request = gc.GenerateRequest(prompt="Story", sampling=LONG)
    for _ in gc.stream_generate(paced_server.grpc_url, request, cancel=cancel):
        seen += 1
        if seen == 3:
            cancel.set()
    assert seen == 3
    _wait_for(lambda: active_streams(paced_server) == 0)
    assert tokens_generated(paced_server) - before < 220


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.server
async def test_async_cancel_stops_exactly_one_generation(paced_server):
    """Of several generations on one channel, aclose() cancels exactly that one upstream (paced,
    so the stopped one cannot finish its 220 tokens before its cancel lands)."""
    async with gc.AsyncChatClient(paced_server.grpc_url) as client:
        assert await client.is_ready()

        async def run(stop_after: int | None) -> list[gc.Chunk]:
            chunks = []
            stream = client.generate(gc.GenerateRequest(prompt="Go", sampling=LONG))
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    chunks.append(chunk)
                    if len(chunks) == stop_after:
                        break
            return chunks

        before = await asyncio.to_thread(tokens_generated, paced_server)
        keep = [asyncio.create_task(run(None)) for _ in range(2)]
        stopped = await run(stop_after=2)
        finished = await asyncio.gather(*keep)
    assert len(stopped) == 2
    for chunks in finished:
        assert chunks[-1].final and chunks[-1].finish_reason == "length"
        assert sum(c.num_output_tokens for c in chunks) == 220
    generated = await asyncio.to_thread(tokens_generated, paced_server)
    assert 2 * 220 <= generated - before < 3 * 220  # the third stopped early
    # a stream leaves the gauge only after its FINAL went out (a drain waits for that), so a
    # client that just saw both FINALs may still read one counted (CI read 1 here once)
    await asyncio.to_thread(_wait_for, lambda: active_streams(paced_server) == 0)


@pytest.mark.server
async def test_async_task_cancel_cancels_upstream(paced_server):
    """Cancelling the asyncio task that consumes a generation stops it on the server: the server
    counts far fewer tokens than the request asked for, and no stream stays active."""
    async with gc.AsyncChatClient(paced_server.grpc_url) as client:
        first = asyncio.Event()

        async def consume():
            async for _ in client.generate(gc.GenerateRequest(prompt="Go", sampling=LONG)):
                first.set()

        before = await asyncio.to_thread(tokens_generated, paced_server)
        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.to_thread(_wait_for, lambda: active_streams(paced_server) == 0)
    generated = await asyncio.to_thread(tokens_generated, paced_server) - before
    # Finishing would count all 220 tokens (2.2 s of paced steps); a cancel that reaches the
    # engine within a second leaves over half of them unmade, even on a loaded machine.
    assert 1 <= generated < LONG["max_tokens"] / 2, generated


async def test_async_unreachable_server_is_unavailable():
    """A generation against a closed port fails with code 'unavailable'."""
    async with gc.AsyncChatClient("127.0.0.1:9") as client:
        assert not await client.is_ready(timeout_s=1.0)
        with pytest.raises(gc.GenerationError) as info:
            async for _ in client.generate(gc.GenerateRequest(prompt="x")):
                pass
    assert info.value.code == "unavailable"
