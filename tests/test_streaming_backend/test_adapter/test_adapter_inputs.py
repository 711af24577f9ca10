"""Tests for streaming_backend/adapter/inputs.py: a request's tensors copied out of Triton."""

from __future__ import annotations

import fake_pb_utils as pb
import numpy as np

from streaming_backend import wire
from streaming_backend.adapter.inputs import copy_inputs


def test_copy_inputs_copies_the_named_tensors_sent():
    """Each named input the request sent comes back as its own copy; absent ones are left out,
    and inputs not named are not read."""
    ids = np.array([1, 2, 3], dtype=np.int64)
    request = pb.InferenceRequest(**{wire.INPUT_IDS: ids, "unnamed": np.array([0])})
    arrays = copy_inputs(pb, request, (wire.INPUT_IDS, wire.TEXT_INPUT))
    assert list(arrays) == [wire.INPUT_IDS]
    assert arrays[wire.INPUT_IDS].tolist() == [1, 2, 3]
    ids[0] = 9  # Triton reuses its memory once execute returns
    assert arrays[wire.INPUT_IDS].tolist() == [1, 2, 3]
