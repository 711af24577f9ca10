"""The chat model's outbox, control requests, metrics and sender (streaming_backend/adapter/),
without a server: a real engine on the tiny model, and a fake of the few pb_utils calls."""

from __future__ import annotations

import json
import threading

import fake_pb_utils as pb
import faults
import numpy as np
import pytest
import torch
from conftest import wait_for

from streaming_backend import wire
from streaming_backend.adapter.control import Control
from streaming_backend.adapter.metrics import DialogueMetrics, Metrics
from streaming_backend.adapter.outbox import Outbox
from streaming_backend.adapter.request import parse_request
from streaming_backend.adapter.response import ResponseBuilder
from streaming_backend.adapter.sender import Sender
from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.errors import EngineStopped, InvalidRequest
from streaming_backend.prompts import encode_prompt
from streaming_backend.sampling import request_keys

KEY = "the admin key"
FINAL = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Model:
    """What model.py builds in initialize(), over the tiny model, with fakes of pb_utils."""

    def __init__(self, loaded, admin_key: str | None = KEY, cancel_check_s=0.01, **engine):
        self.loaded = loaded
        config = EngineConfig(max_streams=4, queue_limit=4, **engine)
        self.engine = Engine(loaded, config).start()
        self.control = Control(self.engine, admin_key)
        self.metrics = Metrics(pb.MetricFamily, "chat", "1")
        self.outbox = Outbox(
            self.engine, Sender(pb), self.metrics, self.control, cancel_check_s
        ).start()

    def submit(self, sender, max_tokens: int = 6, stream: bool = True):
        """What execute() does for one text request."""
        sampling = {
            request_keys.MAX_TOKENS: max_tokens,
            request_keys.TEMPERATURE: 0,
            request_keys.IGNORE_EOS: True,
        }
        inputs = {
            wire.TEXT_INPUT: np.array([b"Hello"], dtype=np.object_),
            wire.STREAM: np.array([stream]),
            wire.SAMPLING_PARAMETERS: np.array([json.dumps(sampling).encode()], dtype=np.object_),
        }
        parsed = parse_request(inputs)
        request_id = self.outbox.new_id()
        live = self.outbox.register(request_id, sender, ResponseBuilder(parsed, 0))
        prompt = encode_prompt(self.loaded.tokenizer, text=parsed.text)
        live.handle = self.engine.submit(
            prompt, parsed.settings, request_id=request_id, sink=self.outbox.queue
        )
        return live.handle

    def hold_prefill(self) -> threading.Event:
        """Stop the engine before each prompt forward until the returned event is set: a
        stream submitted now stays open, whatever the machine's speed."""
        release = threading.Event()
        faults.on_prefill(self.engine, lambda _ids: release.wait(30))
        return release

    def close(self):
        self.engine.shutdown()
        self.outbox.stop()


@pytest.fixture
def model(tiny_loaded):
    m = Model(tiny_loaded)
    yield m
    m.close()


def finish(sender: pb.ResponseSender) -> list[tuple[pb.InferenceResponse, int]]:
    """The sender's responses once its FINAL came."""
    assert sender.finished.wait(30), "no FINAL response"
    return sender.sent


def test_a_stream_gets_one_response_per_token_and_one_final(model):
    """Every token is a response; only the last carries FINAL; the stream counts as ok."""
    sender = pb.ResponseSender()
    model.submit(sender, max_tokens=6)
    sent = finish(sender)
    assert [flags for _, flags in sent] == [0] * 5 + [FINAL]
    assert all(r.error is None and wire.TEXT_OUTPUT in r.outputs for r, _ in sent)
    model.outbox.stop()  # every item before it is handled: the counters are final
    m = model.metrics
    assert m.outcomes["ok"].value == 1 and m.tokens.value == 6 and m.prompt_tokens.value > 0
    assert len(m.first_token.observed) == 1 and len(m.queue.observed) == 1
    assert len(m.tpot.observed) == 1
    assert m.first_token.observed[0] > 0 and m.tpot.observed[0] > 0
    assert m.active.value == 0 and model.outbox.active == 0


def test_tokens_are_counted_when_a_stream_ends_not_once_a_token(tiny_loaded):
    """Each metrics call is a round trip to Triton's process: a stream's tokens go to the
    counter in one increment at its end (no poll came meanwhile), before its FINAL."""
    model = Model(tiny_loaded, cancel_check_s=3600)
    try:
        sender = pb.ResponseSender()
        model.submit(sender, max_tokens=6)
        assert len(finish(sender)) == 6
        assert model.metrics.tokens.increments == [6]
    finally:
        model.close()


def test_a_live_streams_tokens_are_counted_at_each_poll(tiny_loaded):
    """Between a stream's first token and its end, each poll adds the tokens sent so far: the
    counter never lags a running stream by more than a poll."""
    model = Model(tiny_loaded, test_token_delay_s=0.1)  # 200 tokens: 20 s
    try:
        sender = pb.ResponseSender()
        handle = model.submit(sender, max_tokens=200)
        wait_for(lambda: model.metrics.tokens.value >= 3)
        assert not sender.finished.is_set()
        handle.cancel()
        sent = finish(sender)
        model.outbox.stop()
        tokens = model.metrics.tokens
        assert len(tokens.increments) >= 2 and tokens.value == len(sent) - 1  # and the error
    finally:
        model.close()


def test_a_rejected_request_gets_its_error_and_counts_as_rejected(model):
    """A refusal from execute() is one error response with FINAL and the error's Triton code."""
    sender = pb.ResponseSender()
    model.outbox.reject(model.outbox.new_id(), sender, InvalidRequest("no prompt"))
    (response, flags), *rest = finish(sender)
    assert rest == [] and flags == FINAL
    assert response.error.code == "INVALID_ARG"
    assert response.error.message == "invalid request: no prompt"
    model.outbox.stop()
    assert model.metrics.outcomes["rejected"].value == 1 and model.metrics.rejected.value == 1


def test_an_unexpected_error_goes_out_as_internal(model):
    """An exception that is no StreamingError is an internal error, its repr in the message."""
    sender = pb.ResponseSender()
    model.outbox.reject(None, sender, KeyError("x"))
    (response, _), *_ = finish(sender)
    assert response.error.code == "INTERNAL"
    assert response.error.message == "internal error: KeyError('x')"


def test_a_cancelled_client_ends_its_stream_with_cancelled(model):
    """The outbox polls is_cancelled(); a cancelled request ends with a CANCELLED error."""
    release = model.hold_prefill()
    sender = pb.ResponseSender()
    sender.cancelled = True
    handle = model.submit(sender, max_tokens=100)
    wait_for(lambda: handle.cancelled)
    release.set()
    response, flags = finish(sender)[-1]
    assert flags == FINAL and response.error.code == "CANCELLED"
    assert sender.finals() == 1
    model.outbox.stop()
    assert model.metrics.outcomes["cancelled"].value == 1


def test_a_broken_sender_is_cancelled_and_its_request_alone_fails(tiny_loaded):
    """is_cancelled() raising cancels that request; a failing send ends it with one error FINAL
    (counted failed when the refused response was its last, else cancelled as the engine ends
    it); a healthy request beside them is answered in full. Tokens come 20 ms apart, so the
    refused stream's cancel reaches the engine long before its 100 tokens could end it."""
    model = Model(tiny_loaded, test_token_delay_s=0.02)
    try:
        release = model.hold_prefill()
        broken_poll = pb.ResponseSender(cancel_fails=True)
        refusing, refusing_last = pb.ResponseSender(fail=True), pb.ResponseSender(fail=True)
        healthy = pb.ResponseSender()
        handle = model.submit(broken_poll, max_tokens=100)
        model.submit(refusing, max_tokens=100)
        model.submit(refusing_last, max_tokens=1)
        model.submit(healthy, max_tokens=4)
        wait_for(lambda: handle.cancelled)
        release.set()
        assert finish(broken_poll)[-1][0].error.code == "CANCELLED"
        for sender in (refusing, refusing_last):
            (response, flags), *rest = finish(sender)
            assert rest == [] and flags == FINAL and response.error is not None
        assert [flags for _, flags in finish(healthy)] == [0, 0, 0, FINAL]
        model.outbox.stop()
        outcomes = {name: metric.value for name, metric in model.metrics.outcomes.items()}
        assert outcomes == {"ok": 1, "failed": 1, "cancelled": 2, "rejected": 0}
    finally:
        model.close()


def test_failing_metrics_never_end_a_stream(model):
    """Every metrics call raising (logged) leaves the responses as they were."""
    for family in model.metrics._families:
        family.broken = True
    sender = pb.ResponseSender()
    model.submit(sender, max_tokens=3)
    assert [flags for _, flags in finish(sender)] == [0, 0, FINAL]


def test_a_non_streamed_answer_is_one_response(model):
    """stream false: the engine's events accumulate into one response with FINAL."""
    sender = pb.ResponseSender()
    model.submit(sender, max_tokens=5, stream=False)
    (response, flags), *rest = finish(sender)
    assert rest == [] and flags == FINAL and response.error is None


def control_raw(action: str, key: str = KEY) -> bytes:
    return json.dumps({"key": key, "action": action}).encode()


@pytest.mark.parametrize(
    "raw",
    [
        control_raw(wire.CONTROL_HEALTH, key="a wrong key"),
        control_raw("reboot"),
        b"not json",
        json.dumps({"action": wire.CONTROL_HEALTH}).encode(),
    ],
    ids=["wrong key", "unknown action", "not json", "no key"],
)
def test_a_bad_control_request_is_refused_as_invalid(model, raw):
    """Without the right key, or malformed, a control request is an invalid request."""
    sender = pb.ResponseSender()
    model.outbox.control_request(sender, raw)
    (response, flags), *_ = finish(sender)
    assert flags == FINAL and response.error.code == "INVALID_ARG"
    assert model.control.draining is False


def test_without_an_admin_key_every_control_request_is_refused(tiny_loaded):
    """A model process started without the key takes no control request at all."""
    with pytest.raises(InvalidRequest, match="admin key"):
        Control(None, None).action(control_raw(wire.CONTROL_HEALTH))


def test_health_then_drain_then_end(model):
    """health answers the model's health; drain refuses new requests; end ends open streams."""
    sender = pb.ResponseSender()
    model.outbox.control_request(sender, control_raw(wire.CONTROL_HEALTH))
    (response, flags), *_ = finish(sender)
    health = json.loads(response.outputs[wire.TEXT_OUTPUT][0])
    assert flags == FINAL and list(health) == list(wire.HEALTH_KEYS)
    assert health["healthy"] is True and health["draining"] is False
    assert health[wire.SYSTEM_FINGERPRINT] == model.engine.numerics.fingerprint
    assert health[wire.NUMERICS] == model.engine.numerics.as_dict()
    assert health[wire.FORWARD] == model.engine.forward_choice.as_dict()  # which forward, and why
    steps = health[wire.STEPS]  # the decode steps' threads (adaptive_threads on, on the CPU)
    assert steps["most"] == steps["threads"] == torch.get_num_threads()

    release = model.hold_prefill()
    open_stream = pb.ResponseSender()
    model.submit(open_stream, max_tokens=100)
    drain = pb.ResponseSender()
    model.outbox.control_request(drain, control_raw(wire.CONTROL_DRAIN))
    health = json.loads(finish(drain)[0][0].outputs[wire.TEXT_OUTPUT][0])
    assert health["draining"] is True and health["active"] == 1
    with pytest.raises(EngineStopped, match="draining"):
        model.control.admit()
    assert not open_stream.finished.is_set()

    release.set()
    end = pb.ResponseSender()
    model.outbox.control_request(end, control_raw(wire.CONTROL_END))
    finish(end)
    assert finish(open_stream)[-1][1] == FINAL and open_stream.finals() == 1


def test_gauges_are_set_only_when_their_value_changes():
    """Each set is a call into Triton: the outbox sets a gauge only when its number changed."""
    metrics = Metrics(pb.MetricFamily, "chat", "1")
    for active in (0, 2, 2, 1, 1, 0):
        metrics.set_active(active)
    for waiting in (0, 0, 3):
        metrics.set_waiting(waiting)
    assert metrics.active.observed == [2, 1, 0] and metrics.waiting.observed == [3]
    assert metrics.active.labels == {"model": "chat", "version": "1"}


def test_the_step_gauges_follow_the_report_to_a_hundredth():
    """The thread count and the slowdown (rounded to 0.01) are set when they change; no report
    (a GPU, adaptive_threads off) sets nothing."""
    from streaming_backend.engine.step_threads import StepReport

    metrics = Metrics(pb.MetricFamily, "chat", "1")
    metrics.set_steps(None)
    reports = ((2, None), (2, 1.001), (2, 1.004), (1, 1.5), (1, 1.5))
    for second, (threads, slowdown) in enumerate(reports):
        metrics.set_steps(StepReport(threads, 2, 0, None, None, slowdown), now=100.0 + second)
    assert metrics.step_threads.observed == [2, 1]
    assert metrics.step_slowdown.observed == [1.0, 1.5]


def test_the_slowdown_gauge_is_set_at_most_once_a_second_and_a_switch_at_once():
    """A gauge's set keeps the model process's GIL for a round trip to Triton: the outbox polls
    every cancel_check_ms, and the slowdown changes at nearly every poll, so it is set at most
    once in STEP_GAUGES_EVERY_S (its newest value, at the first poll after); a new thread count
    is set at once, with the slowdown of that moment."""
    from streaming_backend.adapter.metrics import STEP_GAUGES_EVERY_S
    from streaming_backend.engine.step_threads import StepReport

    assert STEP_GAUGES_EVERY_S == 1.0
    metrics = Metrics(pb.MetricFamily, "chat", "1")

    def poll(at: float, threads: int, slowdown: float) -> None:
        metrics.set_steps(StepReport(threads, 2, 0, None, None, slowdown), now=at)

    poll(10.00, 2, 1.10)  # the first report: set
    poll(10.04, 2, 1.20)  # held back
    poll(10.96, 2, 1.30)  # held back
    poll(11.00, 2, 1.40)  # a second on: the newest value
    poll(11.04, 1, 1.50)  # a switch: at once
    poll(11.08, 1, 1.60)  # held back
    poll(12.04, 1, 1.60)  # a second on
    poll(13.04, 1, 1.60)  # unchanged: nothing to set
    poll(13.08, 1, 1.70)  # held back: the last look was at 13.04
    poll(14.04, 1, 1.70)  # a second on
    assert metrics.step_slowdown.observed == [1.1, 1.4, 1.5, 1.6, 1.7]


def test_the_draft_counters_grow_by_what_is_new_and_the_rate_follows():
    """Speculative decoding's totals since load, read at each poll: the drafted and accepted
    counters grow by the difference, the acceptance rate gauge is set when it changed, and a
    poll with nothing new drafted calls nothing."""
    metrics = Metrics(pb.MetricFamily, "chat", "1")
    for drafted, accepted in ((0, 0), (10, 8), (10, 8), (30, 12), (40, 22)):
        metrics.set_drafts(drafted, accepted)
    assert metrics.drafted.increments == [10, 20, 10]
    assert metrics.accepted.increments == [8, 4, 10]
    assert metrics.acceptance.observed == [0.8, 0.4, 0.55]
    assert metrics.drafted.labels == {"model": "chat", "version": "1"}


def test_the_dialogue_models_draft_counters_are_the_chat_models_under_its_label():
    """The dialogue model's drafted and accepted tokens: the chat model's counter names with its
    own labels, grown by the difference; no rate gauge, which its instances would each set to
    their own rate."""
    chat, dialogue = (
        Metrics(pb.MetricFamily, "chat", "1"),
        DialogueMetrics(pb.MetricFamily, "dialogue_model", "1"),
    )
    for drafted, accepted in ((0, 0), (12, 9), (12, 9), (20, 11)):
        dialogue.set_drafts(drafted, accepted)
    assert dialogue.drafts.drafted.increments == [12, 8]
    assert dialogue.drafts.accepted.increments == [9, 2]
    assert dialogue.drafts.drafted.labels == {"model": "dialogue_model", "version": "1"}
    names = {f.name: f.kind for f in dialogue._families}
    assert {chat.drafted.family.name, chat.accepted.family.name} < names.keys()
    assert chat.acceptance.family.name not in names
    assert names[chat.drafted.family.name] == names[chat.accepted.family.name] == "counter"
