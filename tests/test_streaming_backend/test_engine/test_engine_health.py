"""The engine's health flag: a poisoned device or repeated failed steps make it unhealthy (the
model then reports it to the supervisor, which restarts Triton); one failure does not."""

from __future__ import annotations

import queue
import threading

import faults
import pytest
from conftest import wait_for

from streaming_backend.engine import MAX_FAILED_STEPS, Engine, EngineConfig
from streaming_backend.errors import EngineStopped
from streaming_backend.events import FinishReason
from streaming_backend.prompts import encode_prompt
from streaming_backend.sampling.settings import SamplingSettings

LONG = SamplingSettings(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingSettings(temperature=0, max_tokens=4, ignore_eos=True)


class FaultyEngine(Engine):
    """Its forward passes raise `error` while `failing` is set, as a broken device would."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failing = threading.Event()
        self.error: Exception = RuntimeError("boom")
        self.prefill_fails = True  # False: only decode steps fail
        faults.on_prefill(self, self._prefill_pass)

    def _decode_step(self):
        if self.failing.is_set():
            raise self.error
        super()._decode_step()

    def _prefill_pass(self, request_ids):
        if self.failing.is_set() and self.prefill_fails:
            raise self.error


def _final(handle, timeout: float = 30.0):
    """A stream's final event."""
    while True:
        event = handle.sink.get(timeout=timeout)
        if event.final:
            return event


def _submit(engine, loaded, settings=LONG):
    prompt = encode_prompt(loaded.tokenizer, text="hello there")
    return engine.submit(prompt, settings, sink=queue.Queue())


def test_a_healthy_engine_says_so(tiny_loaded):
    """A running engine is healthy; one failed step (a bug in one batch) keeps it healthy."""
    with FaultyEngine(tiny_loaded, EngineConfig(max_streams=4)) as engine:
        assert engine.health() == (True, "")
        handle = _submit(engine, tiny_loaded)
        handle.sink.get(timeout=30)
        engine.failing.set()
        assert _final(handle).finish_reason is FinishReason.ERROR
        engine.failing.clear()
        assert _final(_submit(engine, tiny_loaded, SHORT)).finish_reason is FinishReason.LENGTH
        assert engine.health() == (True, "")


@pytest.mark.parametrize(
    "message",
    ["CUDA error: device-side assert triggered", "CUDA out of memory. Tried to allocate 2 GiB"],
)
def test_a_poisoned_device_makes_the_engine_unhealthy_at_once(tiny_loaded, message):
    """A device failure fails the step's streams, flags the engine unhealthy, and new requests
    are refused with `unavailable` (the supervisor restarts Triton)."""
    with FaultyEngine(tiny_loaded, EngineConfig(max_streams=4)) as engine:
        handle = _submit(engine, tiny_loaded)
        handle.sink.get(timeout=30)
        engine.error = RuntimeError(message)
        engine.failing.set()
        assert _final(handle).finish_reason is FinishReason.ERROR
        wait_for(lambda: not engine.health()[0])
        healthy, reason = engine.health()
        assert "device failed" in reason and message in reason
        with pytest.raises(EngineStopped, match="awaits a restart"):
            _submit(engine, tiny_loaded)


def test_repeated_failed_steps_make_the_engine_unhealthy(tiny_loaded):
    """MAX_FAILED_STEPS failed decode steps in a row, whatever the error: unhealthy. (A failing
    prefill fails only its own request: a bad prompt must not take the server down.)"""
    with FaultyEngine(tiny_loaded, EngineConfig(max_streams=4)) as engine:
        engine.prefill_fails = False
        engine.failing.set()
        for _ in range(MAX_FAILED_STEPS):
            assert engine.health()[0] is True
            assert _final(_submit(engine, tiny_loaded)).finish_reason is FinishReason.ERROR
        wait_for(lambda: not engine.health()[0])
        assert f"{MAX_FAILED_STEPS} steps in a row failed" in engine.health()[1]


def test_a_failed_admission_ends_the_streams_it_took(tiny_loaded):
    """Streams taken from the queue when admitting them fails (a bug in the steps) end with an
    error instead of waiting forever; the next request is served."""
    with Engine(tiny_loaded, EngineConfig(max_streams=4)) as engine:
        admit, calls = engine._steps.admit, []

        def failing_once(streams):
            calls.append(len(streams))
            if len(calls) == 1:
                raise RuntimeError("admission bug")
            admit(streams)

        engine._steps.admit = failing_once
        final = _final(_submit(engine, tiny_loaded, SHORT))
        assert final.finish_reason == FinishReason.ERROR and "admission bug" in str(final.error)
        assert _final(_submit(engine, tiny_loaded, SHORT)).finish_reason == FinishReason.LENGTH
