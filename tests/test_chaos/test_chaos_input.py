"""Chaos: bad and hostile input on every transport (gRPC, HTTP generate_stream, websocket). Each
gets one clear error and nothing else; afterwards the server serves a normal request."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import bridge_thread, ws_generation
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from streaming_backend import wire

pytestmark = [pytest.mark.chaos, pytest.mark.server]

DEEP_JSON = "[" * 100_000 + "]" * 100_000
HUGE_PROMPT = "word " * 40_000  # 200,000 characters


def _bytes(value: bytes | str) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _sampling(text: str) -> grpcclient.InferInput:
    return _input(wire.SAMPLING_PARAMETERS, _bytes(text), "BYTES")


def _prompt(text: bytes | str = "Hello") -> grpcclient.InferInput:
    return _input(wire.TEXT_INPUT, _bytes(text), "BYTES")


STREAM_ON = (wire.STREAM, np.array([True]), "BOOL")

GRPC_CASES = {
    "text_input as INT32": [_input(wire.TEXT_INPUT, np.array([1], dtype=np.int32), "INT32")],
    "text_input of shape [2]": [
        _input(wire.TEXT_INPUT, np.array([b"a", b"b"], np.object_), "BYTES")
    ],
    "no prompt at all": [_input(*STREAM_ON)],
    "empty prompt": [_prompt("")],
    "200,000-character prompt": [_prompt(HUGE_PROMPT)],
    "ids outside the vocabulary": [
        _input(wire.INPUT_IDS, np.array([10**9, -5], dtype=np.int64), "INT64")
    ],
    "input_ids as FP32": [_input(wire.INPUT_IDS, np.array([1.5], dtype=np.float32), "FP32")],
    "invalid UTF-8 prompt": [_prompt(b"\xff\xfe\xfd")],
    "sampling_parameters not JSON": [_prompt(), _sampling("{max_tokens: 4")],
    "sampling_parameters a list": [_prompt(), _sampling("[1, 2]")],
    "sampling_parameters nested 100,000 deep": [_prompt(), _sampling(DEEP_JSON)],
    "max_tokens 1e308": [_prompt(), _sampling('{"max_tokens": 1e308}')],
    "temperature NaN": [_prompt(), _sampling('{"temperature": NaN}')],
    "seed 2**80": [_prompt(), _sampling(json.dumps({"seed": 2**80}))],
    "top_k -1 and unknown keys": [_prompt(), _sampling('{"top_k": -1, "__class__": 1}')],
    "stop of 1 MB": [_prompt(), _sampling(json.dumps({"stop": ["x" * 1_000_000]}))],
}


def grpc_answer(url: str, inputs: list) -> tuple[str, float]:
    """One stream_infer request: ("ok" or the error message, seconds)."""
    client = grpcclient.InferenceServerClient(url)
    done, outcome = threading.Event(), []

    def callback(result, error):
        if error is not None:
            outcome.append(str(error))
            done.set()
        elif result.get_response().parameters[wire.FINAL_RESPONSE].bool_param:
            outcome.append("ok")
            done.set()

    started = time.monotonic()
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(wire.CHAT_MODEL, inputs, enable_empty_final_response=True)
        assert done.wait(60), "no answer"
    finally:
        client.stop_stream()
        client.close()
    return outcome[0], time.monotonic() - started


def test_bad_grpc_requests_each_get_an_error(triton_server) -> None:
    """Every bad gRPC request ends with one error, fast; then a normal one is served."""
    url = triton_server.grpc_url
    results = {name: grpc_answer(url, inputs) for name, inputs in GRPC_CASES.items()}
    for name, (answer, seconds) in results.items():
        print(f"\ngRPC {name}: {seconds * 1e3:.0f} ms: {answer[:160]}")
    assert [name for name, (answer, _) in results.items() if answer == "ok"] == []
    # the client's mistakes are never reported as the server's own failure
    assert [name for name, (answer, _) in results.items() if "internal error" in answer] == []
    assert max(seconds for _, seconds in results.values()) < 10
    normal = [_prompt(), _sampling('{"max_tokens": 4}'), _input(*STREAM_ON)]
    assert grpc_answer(triton_server.grpc_url, normal)[0] == "ok"


HTTP_CASES = {
    "body not JSON": b"{text_input: ",
    "body invalid UTF-8": b'{"text_input": "\xff\xfe", "stream": true}',
    "text_input a number": json.dumps({"text_input": 5, "stream": True}).encode(),
    "no prompt": json.dumps({"stream": True}).encode(),
    "200,000-character prompt": json.dumps({"text_input": HUGE_PROMPT, "stream": True}).encode(),
    "hostile sampling_parameters": json.dumps(
        {"text_input": "hi", "stream": True, "sampling_parameters": DEEP_JSON}
    ).encode(),
    "unknown input": json.dumps({"text_input": "hi", "not_an_input": 1}).encode(),
}


def http_answer(url: str, body: bytes) -> tuple[int, str]:
    """POST generate_stream: (status, body text)."""
    request = urllib.request.Request(
        f"{url}/v2/models/{wire.CHAT_MODEL}/generate_stream",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode("utf-8", "replace")


def test_bad_http_requests_each_get_an_error(triton_server) -> None:
    """Every bad generate_stream request gets an error (status 400 or an SSE error event)."""
    results = {name: http_answer(triton_server.http_url, body) for name, body in HTTP_CASES.items()}
    for name, (status, text) in results.items():
        print(f"\nHTTP {name}: {status} {text.strip()[:160]}")
        assert status >= 400 or '"error"' in text, (name, status, text)
        assert "internal error" not in text, (name, text)
    body = {"text_input": "Hello", "stream": True, "sampling_parameters": '{"max_tokens": 4}'}
    status, text = http_answer(triton_server.http_url, json.dumps(body).encode())
    assert status == 200 and '"error"' not in text


def ws_frame_answer(port: int, message: str | bytes) -> str:
    """Send one frame; the bridge's answer: the error frame's code, or the close code."""
    with connect(f"ws://127.0.0.1:{port}/ws", max_size=None) as ws:
        try:
            ws.send(message)
            got = json.loads(ws.recv(timeout=30))
        except ConnectionClosed as closed:
            return f"closed {closed.rcvd.code if closed.rcvd else None}"
        except ConnectionResetError:  # the bridge closed (1009) while the frame was still going out
            return "closed 1009 (reset while sending)"
        return f"{got['type']} {got.get('code')}: {got.get('message', '')[:120]}"


def test_bad_websocket_frames_each_get_an_error(triton_server) -> None:
    """Binary, oversized, malformed and hostile frames, and 500 connections at once: each gets
    an error frame or a close with a code; the bridge still serves a normal generation."""
    generate = {"type": "generate", "id": "g", "prompt": "hi"}
    cases = {
        "5 MB frame": json.dumps(generate | {"prompt": "x" * 5_000_000}),
        "binary frame": b"\x00\x01binary",
        "not JSON": "{type: generate",
        "lone surrogate": '{"type": "generate", "id": "g", "prompt": "\\ud800"}',
        "empty prompt": json.dumps(generate | {"prompt": ""}),
        "200,000-character prompt": json.dumps(generate | {"prompt": HUGE_PROMPT}),
        "hostile params": json.dumps(generate | {"params": {"max_tokens": "1e308"}}),
        "deep JSON": "[" * 100_000 + "]" * 100_000,
        "unknown type": json.dumps({"type": "rm -rf", "id": "g"}),
    }
    with bridge_thread(triton_server.grpc_url) as port:
        answers = {name: ws_frame_answer(port, frame) for name, frame in cases.items()}
        for name, answer in answers.items():
            print(f"\nwebsocket {name}: {answer}")
        # an error frame, or the bridge closing the socket on a frame over the size limit
        assert all(a.startswith(("error ", "closed")) for a in answers.values()), answers
        assert answers["5 MB frame"].startswith("closed")
        assert not any("internal" in a for a in answers.values()), answers
        refused = crowd(port, 500)
        print(f"\n500 websocket connections at once: {refused} refused (503)")
        result: dict = {}
        ws_generation(port, 4, result)
        assert result["last"]["type"] == "done" and result["tokens"] >= 1


def crowd(port: int, count: int) -> int:
    """Open `count` websockets at once and hold them; how many the bridge refused with 503."""
    refused = 0
    with contextlib.ExitStack() as opened:  # every socket held until all are tried, then closed
        for _ in range(count):
            try:
                opened.enter_context(connect(f"ws://127.0.0.1:{port}/ws", open_timeout=30))
            except InvalidStatus as error:
                assert error.response.status_code == 503
                refused += 1
    return refused
