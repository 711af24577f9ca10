"""Triton adapter for the dialogue model: a batch of requests in, one response per request out.

`initialize` loads the model; `execute` copies each request's inputs (adapter/inputs.py), parses
them (a bad request gets its own error response, built by adapter/sender.py), generates for all
valid requests together on the chat model's steps (streaming_backend.dialogue.generation) and
returns their responses in request order.
"""

from __future__ import annotations

import json
import logging

import torch
import triton_python_backend_utils as pb_utils

from streaming_backend.adapter.inputs import copy_inputs
from streaming_backend.adapter.metrics import DialogueMetrics
from streaming_backend.adapter.sender import error_response
from streaming_backend.configuration.models import DialogueSettings
from streaming_backend.dialogue.convert import (
    DialogueRequest,
    dialogue_outputs,
    parse_dialogue_request,
)
from streaming_backend.dialogue.generation import Generator
from streaming_backend.errors import StreamingError
from streaming_backend.heap import freeze_loaded_objects
from streaming_backend.launcher.startup import announce_initialized
from streaming_backend.model.loading import instance_device, load_model
from streaming_backend.wire import DIALOGUE_INPUT_NAMES

log = logging.getLogger("tokenstream.dialogue_model")


class TritonPythonModel:
    """The batched, non-streaming token-ids model."""

    def initialize(self, args):
        """Load the model and create its metrics."""
        self.settings = DialogueSettings.from_config(json.loads(args["model_config"]))
        device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])
        # weights=False: the compact forward maps its weight file (model/weight_cache.py), the
        # pages the chat model and the other instances map too
        self.loaded = load_model(self.settings.model, self.settings.dtype, device, weights=False)
        if self.loaded.device.type == "cpu":
            torch.set_num_threads(self.settings.cpu_threads)
        self.generator = Generator(self.loaded, self.settings.engine, self.settings.max_beam_width)
        log.info(
            "loaded %s on %s as %s, %s forward",
            self.loaded.name,
            self.loaded.device,
            self.loaded.dtype,
            self.generator.name,
        )
        self.metrics = DialogueMetrics(
            pb_utils.MetricFamily, args["model_name"], args["model_version"]
        )
        freeze_loaded_objects()  # the load's objects out of every later full collection (heap.py)
        announce_initialized(args)  # last: a start that hangs after this is told from a slow one

    def execute(self, requests):
        """Generate for every valid request together; one response per request, in order."""
        self.metrics.observe_batch(len(requests))
        parsed = [self._parse(request) for request in requests]
        valid = [p for p in parsed if isinstance(p, DialogueRequest)]
        results = iter(self.generator.generate([p.generation for p in valid]))
        responses = [
            self._response(p, p if isinstance(p, Exception) else next(results)) for p in parsed
        ]
        counts = self.generator.draft_counts  # counted before the responses go out
        self.metrics.set_drafts(counts.drafted, counts.accepted)
        return responses

    def finalize(self):
        """Nothing runs between calls: nothing to stop."""

    def _parse(self, request) -> DialogueRequest | Exception:
        try:
            return parse_dialogue_request(
                copy_inputs(pb_utils, request, DIALOGUE_INPUT_NAMES),
                self.settings.default_output_len,
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes this request's error
            return exc

    def _response(self, parsed, outcome):
        """The response of one request: its outputs, or its error."""
        if isinstance(outcome, Exception):
            return _error_response(outcome)
        pad = parsed.pad_id
        if pad is None:  # the end id pads, as in TensorRT-LLM
            pad = min(parsed.generation.end_ids or self.loaded.eos_ids, default=0)
        try:
            arrays = dialogue_outputs(outcome, parsed.generation.max_new_tokens, pad)
        except Exception as exc:  # noqa: BLE001 - e.g. a pad_id out of INT32's range
            return _error_response(exc)
        tensors = [pb_utils.Tensor(name, array) for name, array in arrays.items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)


def _error_response(exc: Exception):
    """The request's error response (adapter/sender.py); an unexpected error is logged first."""
    if not isinstance(exc, StreamingError):
        log.error("dialogue request failed: %r", exc)
    return error_response(pb_utils, exc)
