"""Tests of clients/grpc_client.py: request tensors, response parsing, errors, live streams."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import (
    InferenceServerException,
    deserialize_bytes_tensor,
    serialize_byte_tensor,
)

from clients import grpc_client as gc


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
    response.parameters[gc.FINAL_RESPONSE].bool_param = final
    return InferResult(response)


def test_prompt_request_builds_text_input_and_flags():
    """A prompt request sends text_input, stream=true and the return flags."""
    req = gc.GenerateRequest(prompt="héllo 你好 🙂", sampling={"max_tokens": 8}, return_timing=True)
    tensors = _inputs_by_name(req)
    assert tensors[gc.TEXT_INPUT][0].decode() == "héllo 你好 🙂"
    assert json.loads(tensors[gc.SAMPLING_PARAMETERS][0]) == {"max_tokens": 8}
    assert tensors[gc.STREAM][0] and tensors[gc.RETURN_TIMING][0]
    assert not tensors[gc.RETURN_OUTPUT_IDS][0]
    assert gc.MESSAGES not in tensors and gc.INPUT_IDS not in tensors


def test_messages_request_sends_json_messages():
    """A messages request sends the list as JSON in `messages` and no text_input."""
    messages = [{"role": "user", "content": "数一数 🐍"}]
    tensors = _inputs_by_name(gc.GenerateRequest(messages=messages))
    assert json.loads(tensors[gc.MESSAGES][0].decode()) == messages
    assert gc.TEXT_INPUT not in tensors
    assert gc.SAMPLING_PARAMETERS not in tensors  # empty settings are not sent


def test_input_ids_request_sends_int64_tensor():
    """An input_ids request sends an INT64 tensor of shape [n]."""
    tensors = _inputs_by_name(gc.GenerateRequest(input_ids=[1, 2, 3]))
    assert tensors[gc.INPUT_IDS].tolist() == [1, 2, 3]


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
    timing = {"clock": "monotonic", "received_ns": 1, "emitted_ns": 5}
    result = _result(
        {
            gc.TEXT_OUTPUT: np.array(["好🙂".encode()], dtype=np.object_),
            gc.NUM_OUTPUT_TOKENS: np.array([2], dtype=np.uint32),
            gc.NUM_INPUT_TOKENS: np.array([7], dtype=np.uint32),
            gc.OUTPUT_IDS: np.array([11, 12], dtype=np.int64),
            gc.FINISH_REASON: np.array([b"length"], dtype=np.object_),
            gc.TIMING: np.array([json.dumps(timing).encode()], dtype=np.object_),
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
        timing=timing,
        final=True,
        request_id="r1",
        received_ns=42,
    )


def test_parse_result_missing_outputs_are_none():
    """Outputs the request did not ask for come back as None, text as ''."""
    chunk = gc.parse_result(_result({}))
    assert chunk.text == "" and not chunk.final
    assert chunk.num_output_tokens is None and chunk.output_ids is None and chunk.timing is None
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
        ("something else", None, "error"),
    ],
)
def test_error_codes(message, status, code):
    """Server messages and gRPC statuses map to error categories; the message is kept."""
    err = gc.to_generation_error(InferenceServerException(msg=message, status=status))
    assert (err.code, err.message, str(err)) == (code, message, message)
