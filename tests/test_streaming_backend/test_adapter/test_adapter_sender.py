"""Tests for streaming_backend/adapter/sender.py: error responses built for both models."""

from __future__ import annotations

import fake_pb_utils as pb

from streaming_backend.adapter.sender import Sender, error_response
from streaming_backend.errors import InvalidRequest


def test_error_response_carries_the_message_and_the_kinds_triton_code():
    """A StreamingError goes out with its own message and code; anything else as INTERNAL."""
    invalid = error_response(pb, InvalidRequest("max_tokens must be >= 1"))
    assert invalid.error.message == "invalid request: max_tokens must be >= 1"
    assert invalid.error.code == pb.TritonError.INVALID_ARG
    internal = error_response(pb, ValueError("boom"))
    assert internal.error.message == "internal error: ValueError('boom')"
    assert internal.error.code == pb.TritonError.INTERNAL


def test_send_error_sends_that_response_with_final():
    """send_error sends error_response's error as the request's FINAL response."""
    sender = pb.ResponseSender()
    Sender(pb).send_error(sender, InvalidRequest("no prompt"))
    [(response, flags)] = sender.sent
    assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert (response.error.message, response.error.code) == (
        "invalid request: no prompt",
        "INVALID_ARG",
    )
