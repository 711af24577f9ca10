"""Token events -> output arrays: streamed and non-streamed answers, every return_* flag."""

import json

import numpy as np
import pytest

from streaming_backend import wire
from streaming_backend.adapter.request import ModelRequest
from streaming_backend.adapter.response import ResponseBuilder
from streaming_backend.events import TokenEvent

ALL_FLAGS = frozenset(wire.RETURN_FLAGS)


def _events() -> list[TokenEvent]:
    """Three tokens: 'Hel', 'lo' and a final ' 世界' (the last ends the stream with 'length')."""
    pieces = [("Hel", 11, -0.5), ("lo", 12, -0.25), (" 世界", 13, -1.0)]
    return [
        TokenEvent(
            request_id="r",
            text=text,
            token_ids=(token,),
            num_output_tokens=n,
            num_input_tokens=4,
            submitted_ns=100,
            scheduled_ns=200,
            emitted_ns=300 + n,
            logprobs=(logprob,),
            finish_reason=wire.FinishReason.LENGTH if n == 3 else None,
        )
        for n, (text, token, logprob) in enumerate(pieces, start=1)
    ]


def _text(array: np.ndarray) -> str:
    return array[0].decode("utf-8")


def test_streamed_answer_one_response_per_event_with_every_flag():
    """Streaming: each event's own delta, ids, count and logprob; the cumulative one runs on."""
    builder = ResponseBuilder(ModelRequest(stream=True, returns=ALL_FLAGS), received_ns=50)
    builder.queued_ns = 60
    outputs = [builder.outputs(event) for event in _events()]
    assert [_text(o[wire.TEXT_OUTPUT]) for o in outputs] == ["Hel", "lo", " 世界"]
    assert [o[wire.OUTPUT_IDS].tolist() for o in outputs] == [[11], [12], [13]]
    assert [int(o[wire.NUM_OUTPUT_TOKENS][0]) for o in outputs] == [1, 1, 1]
    assert all(int(o[wire.NUM_INPUT_TOKENS][0]) == 4 for o in outputs)
    assert [json.loads(_text(o[wire.LOGPROBS])) for o in outputs] == [
        [{"token_id": 11, "logprob": -0.5}],
        [{"token_id": 12, "logprob": -0.25}],
        [{"token_id": 13, "logprob": -1.0}],
    ]
    cumulative = [float(o[wire.CUMULATIVE_LOGPROB][0]) for o in outputs]
    assert cumulative == pytest.approx([-0.5, -0.75, -1.75])
    assert [wire.FINISH_REASON in o for o in outputs] == [False, False, True]
    assert _text(outputs[-1][wire.FINISH_REASON]) == "length"
    timing = wire.ServerTiming.from_json(_text(outputs[1][wire.TIMING]))
    assert (timing.received_ns, timing.queued_ns, timing.prefill_start_ns) == (50, 60, 200)
    assert timing.emitted_ns == 302
    assert outputs[0][wire.NUM_OUTPUT_TOKENS].dtype == np.uint32
    assert outputs[0][wire.OUTPUT_IDS].dtype == np.int64
    assert outputs[0][wire.CUMULATIVE_LOGPROB].dtype == np.float32


def test_non_streamed_answer_is_one_response_with_the_prompt():
    """Not streaming: nothing until the final event, then the whole answer after the prompt."""
    builder = ResponseBuilder(ModelRequest(returns=ALL_FLAGS), received_ns=50, prompt_text="Hi:")
    outputs = [builder.outputs(event) for event in _events()]
    assert outputs[:2] == [None, None]
    final = outputs[2]
    assert _text(final[wire.TEXT_OUTPUT]) == "Hi:Hello 世界"
    assert final[wire.OUTPUT_IDS].tolist() == [11, 12, 13]
    assert int(final[wire.NUM_OUTPUT_TOKENS][0]) == 3
    assert [e["logprob"] for e in json.loads(_text(final[wire.LOGPROBS]))] == [-0.5, -0.25, -1.0]
    assert float(final[wire.CUMULATIVE_LOGPROB][0]) == pytest.approx(-1.75)
    assert _text(final[wire.FINISH_REASON]) == "length"
    timing = wire.ServerTiming.from_json(_text(final[wire.TIMING]))
    assert timing.queued_ns == 100  # not set by the model: the engine's submit time


@pytest.mark.parametrize("stream", [True, False])
def test_every_response_names_the_system_fingerprint_when_asked(stream):
    """return_system_fingerprint: each response (streamed) or the one response carries the
    engine's fingerprint."""
    request = ModelRequest(stream=stream, returns=frozenset({wire.RETURN_SYSTEM_FINGERPRINT}))
    builder = ResponseBuilder(request, received_ns=0, fingerprint="fp_0123456789ab")
    outputs = [o for o in map(builder.outputs, _events()) if o is not None]
    assert len(outputs) == (3 if stream else 1)
    assert all(_text(o[wire.SYSTEM_FINGERPRINT]) == "fp_0123456789ab" for o in outputs)


def test_non_streamed_answer_without_the_prompt():
    """exclude_input_in_output leaves the prompt out."""
    builder = ResponseBuilder(ModelRequest(exclude_input=True), received_ns=0, prompt_text="Hi:")
    final = [builder.outputs(event) for event in _events()][-1]
    assert _text(final[wire.TEXT_OUTPUT]) == "Hello 世界"


@pytest.mark.parametrize("stream", [True, False])
def test_only_text_without_flags(stream):
    """With no return_* flag a response holds the text output only."""
    builder = ResponseBuilder(ModelRequest(stream=stream, exclude_input=True), received_ns=0)
    outputs = [o for o in map(builder.outputs, _events()) if o is not None]
    assert all(set(o) == {wire.TEXT_OUTPUT} for o in outputs)


FLAG_OUTPUTS = {
    wire.RETURN_FINISH_REASON: wire.FINISH_REASON,
    wire.RETURN_NUM_INPUT_TOKENS: wire.NUM_INPUT_TOKENS,
    wire.RETURN_NUM_OUTPUT_TOKENS: wire.NUM_OUTPUT_TOKENS,
    wire.RETURN_LOGPROBS: wire.LOGPROBS,
    wire.RETURN_CUMULATIVE_LOGPROB: wire.CUMULATIVE_LOGPROB,
    wire.RETURN_OUTPUT_IDS: wire.OUTPUT_IDS,
    wire.RETURN_TIMING: wire.TIMING,
    wire.RETURN_SYSTEM_FINGERPRINT: wire.SYSTEM_FINGERPRINT,
}


@pytest.mark.parametrize("flag, output", FLAG_OUTPUTS.items())
def test_each_flag_adds_its_output(flag, output):
    """Each return_* flag adds exactly its own output (on the final response)."""
    builder = ResponseBuilder(ModelRequest(stream=True, returns=frozenset({flag})), received_ns=0)
    final = [builder.outputs(event) for event in _events()][-1]
    assert set(final) == {wire.TEXT_OUTPUT, output}


def test_every_return_flag_has_an_output():
    """Every flag of the wire contract is in the table above, and every output but the text."""
    assert set(FLAG_OUTPUTS) == set(wire.RETURN_FLAGS)
    assert set(FLAG_OUTPUTS.values()) | {wire.TEXT_OUTPUT} == set(wire.OUTPUT_NAMES)
