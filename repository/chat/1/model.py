"""Triton adapter for the streaming engine: tensors in, one response per token out.

A table of contents; each job lives in its own module of streaming_backend/adapter/:
- requests in (here): `execute` copies each request's inputs (adapter/inputs.py), parses them
  (adapter/request.py), hands the request to the engine and returns None;
- responses out: adapter/outbox.py, the one thread that calls Triton after execute() (responses,
  cancellation checks, metrics), through adapter/sender.py; events become arrays in
  adapter/response.py;
- control and drain: adapter/control.py (the supervisor's canary and drain, wire.CONTROL);
- metrics: adapter/metrics.py.
Every request gets exactly one response with the FINAL flag, whatever happens.
"""

from __future__ import annotations

import json
import logging
import os
import time

import triton_python_backend_utils as pb_utils

from streaming_backend.adapter.control import Control
from streaming_backend.adapter.inputs import copy_inputs
from streaming_backend.adapter.metrics import Metrics
from streaming_backend.adapter.outbox import Outbox
from streaming_backend.adapter.request import ModelRequest, parse_request
from streaming_backend.adapter.response import ResponseBuilder
from streaming_backend.adapter.sender import Sender
from streaming_backend.configuration.models import ModelSettings
from streaming_backend.engine import Engine
from streaming_backend.heap import freeze_loaded_objects
from streaming_backend.launcher.startup import announce_initialized
from streaming_backend.model.loading import instance_device, load_model, progress
from streaming_backend.prompts import encode_prompt
from streaming_backend.wire import (
    ADMIN_KEY_VARIABLE,
    CONTROL,
    INPUT_NAMES,
    RETURN_CUMULATIVE_LOGPROB,
    RETURN_LOGPROBS,
)

log = logging.getLogger("tokenstream.model")


class TritonPythonModel:
    """The decoupled chat model."""

    def initialize(self, args):
        """Load the model, start the engine and the outbox thread."""
        self.settings = ModelSettings.from_config(json.loads(args["model_config"]))
        device = instance_device(args["model_instance_kind"], args["model_instance_device_id"])
        # loaded on the engine's own thread, where all its torch work runs (engine/); the
        # compact forward maps its weights from their file (model/weight_cache.py), the Hugging
        # Face one loads the model's own
        settings = self.settings
        self.engine = Engine(
            lambda: load_model(settings.model, settings.dtype, device, weights=False),
            settings.engine,
        ).start()
        loaded = self.engine.loaded
        log.info("loaded %s on %s as %s", loaded.name, loaded.device, loaded.dtype)
        self.tokenizer = loaded.tokenizer
        self.fingerprint = self.engine.numerics.fingerprint  # every response's, when asked
        facts = ", ".join(f"{k} {v}" for k, v in self.engine.numerics.as_dict().items())
        progress(f"numerics {self.fingerprint}: {facts}")  # seen in Triton's log
        # None: no admin key in our environment, so every control request is refused
        self.control = Control(self.engine, os.environ.get(ADMIN_KEY_VARIABLE) or None)
        metrics = Metrics(pb_utils.MetricFamily, args["model_name"], args["model_version"])
        self.outbox = Outbox(
            self.engine, Sender(pb_utils), metrics, self.control, self.settings.cancel_check_s
        ).start()
        freeze_loaded_objects()  # the load's objects out of every later full collection (heap.py)
        announce_initialized(args)  # last: a start that hangs after this is told from a slow one

    def execute(self, requests):
        """Hand each request to the engine; responses are sent from the outbox thread."""
        for request in requests:
            self._accept(request)
        return None

    def finalize(self):
        """End in-flight streams (CANCELLED, sent by the outbox), then stop its thread."""
        self.engine.shutdown()
        self.outbox.stop()

    def _accept(self, request) -> None:
        """Validate and submit one request; a bad one is queued for its error and FINAL."""
        received_ns = time.monotonic_ns()
        sender = request.get_response_sender()
        control = pb_utils.get_input_tensor_by_name(request, CONTROL)
        if control is not None:
            self.outbox.control_request(sender, control.as_numpy().reshape(-1)[0])
            return
        request_id = self.outbox.new_id()
        try:
            self.control.admit()
            parsed = parse_request(
                copy_inputs(pb_utils, request, INPUT_NAMES), request.parameters()
            )
            prompt_ids = encode_prompt(
                self.tokenizer,
                text=parsed.text,
                messages=parsed.messages,
                input_ids=parsed.input_ids,
                tools=parsed.tools,
            )
            prompt_text = _prompt_text(parsed, prompt_ids, self.tokenizer)
            builder = ResponseBuilder(
                parsed, received_ns, prompt_text=prompt_text, fingerprint=self.fingerprint
            )
            live = self.outbox.register(request_id, sender, builder)
            builder.queued_ns = time.monotonic_ns()
            live.handle = self.engine.submit(
                prompt_ids,
                parsed.settings,
                request_id=request_id,
                logprobs=_wants_logprobs(parsed),
                sink=self.outbox.queue,
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes this request's error
            self.outbox.reject(request_id, sender, exc)


def _prompt_text(parsed: ModelRequest, prompt_ids, tokenizer) -> str:
    """The prompt as text, prepended to a non-streamed answer (as the vLLM backend does)."""
    if parsed.stream or parsed.exclude_input:
        return ""
    return parsed.text if parsed.text is not None else tokenizer.decode(prompt_ids)


def _wants_logprobs(parsed: ModelRequest) -> bool:
    return parsed.wants(RETURN_LOGPROBS) or parsed.wants(RETURN_CUMULATIVE_LOGPROB)
