"""The chat model in a real tritonserver (tiny random model): gRPC stream_infer and HTTP SSE."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from bridge_support import metric
from conftest import wait_for

from clients.library.grpc_client import GenerateRequest, GenerationError, stream_generate
from streaming_backend import wire
from streaming_backend.engine.detokenize import REPLACEMENT
from streaming_backend.prompts import encode_prompt

pytestmark = pytest.mark.server

FIXED = {"max_tokens": 12, "ignore_eos": True}


def _chunks(server, **kwargs):
    return list(stream_generate(server.grpc_url, GenerateRequest(**kwargs)))


def _sse(server, body: dict) -> list[dict]:
    """POST generate_stream and return the JSON of each SSE event."""
    req = urllib.request.Request(
        f"{server.http_url}/v2/models/chat/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(req, timeout=60) as response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def test_one_response_per_token_and_final_on_the_last(triton_server):
    """A streamed request gets one delta per token; only the last has FINAL and finish_reason."""
    chunks = _chunks(
        triton_server,
        prompt="Hello there",
        sampling=FIXED | {"temperature": 0},
        return_output_ids=True,
        return_timing=True,
    )
    assert len(chunks) == 12
    assert [c.final for c in chunks] == [False] * 11 + [True]
    assert [c.finish_reason for c in chunks] == [None] * 11 + ["length"]
    assert all(c.num_output_tokens == 1 and len(c.output_ids) == 1 for c in chunks)
    timing = chunks[0].timing  # one monotonic clock: the server runs on this machine
    assert timing.received_ns <= timing.queued_ns <= timing.prefill_start_ns
    assert timing.prefill_start_ns <= timing.emitted_ns <= chunks[0].received_ns


def test_streamed_deltas_equal_the_non_streamed_text(triton_server):
    """For the same seed, the concatenated deltas are the one-response answer."""
    sampling = FIXED | {"temperature": 0.9, "top_p": 0.9, "seed": 7}
    streamed = _chunks(triton_server, prompt="Tell me", sampling=sampling)
    whole = _chunks(triton_server, prompt="Tell me", sampling=sampling, stream=False)
    assert len(whole) == 1 and whole[0].final
    assert "".join(c.text for c in streamed) == whole[0].text
    assert whole[0].num_output_tokens == 12


def test_non_streamed_answer_includes_the_prompt_unless_excluded(triton_server):
    """As the vLLM backend: stream=false prepends the prompt unless exclude_input_in_output."""
    sampling = FIXED | {"temperature": 0}
    kept = _chunks(
        triton_server,
        prompt="Prefix!",
        sampling=sampling,
        stream=False,
        exclude_input_in_output=False,
    )
    dropped = _chunks(triton_server, prompt="Prefix!", sampling=sampling, stream=False)
    assert kept[0].text == "Prefix!" + dropped[0].text


def test_string_valued_sampling_parameters(triton_server):
    """genai-perf sends numbers as strings: {"max_tokens": "32"} works."""
    chunks = _chunks(
        triton_server,
        prompt="Hi",
        sampling={"max_tokens": "5", "ignore_eos": "true", "temperature": "0.5", "top_k": "10"},
    )
    assert sum(c.num_output_tokens for c in chunks) == 5


def test_num_output_tokens_add_up(triton_server):
    """The per-response counts sum to the tokens generated, also for a chat prompt."""
    chunks = _chunks(
        triton_server,
        messages=[{"role": "user", "content": "Count"}],
        sampling={"max_tokens": 9, "ignore_eos": True},
        return_output_ids=True,
    )
    assert sum(c.num_output_tokens for c in chunks) == 9
    assert sum(len(c.output_ids) for c in chunks) == 9
    assert chunks[0].num_input_tokens > 5  # the chat template's tokens count too


def test_chinese_deltas_break_no_character(triton_server, tiny_loaded):
    """Streamed deltas hold U+FFFD only where the full decode of the same tokens has one, except
    at the very end: a stream cut off inside a character drops that character's U+FFFD."""
    for seed in range(3):
        chunks = _chunks(
            triton_server,
            messages=[{"role": "user", "content": "请用中文介绍一下长城。"}],
            sampling={"max_tokens": 40, "ignore_eos": True, "seed": seed},
            return_output_ids=True,
        )
        ids = [i for c in chunks for i in c.output_ids]
        full = tiny_loaded.tokenizer.decode(ids, skip_special_tokens=True)
        streamed = "".join(c.text for c in chunks)
        assert streamed == full.removesuffix(REPLACEMENT)
        assert not streamed.endswith(REPLACEMENT)


def test_eight_concurrent_streams_complete(triton_server):
    """8 streams at once all finish with their full length."""

    def run(i):
        return _chunks(triton_server, prompt=f"stream {i}", sampling=FIXED | {"seed": i})

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    assert all(sum(c.num_output_tokens for c in r) == 12 for r in results)
    assert all(r[-1].finish_reason == "length" for r in results)


def _first_chunks(server, request: GenerateRequest, n: int, cancel: threading.Event):
    """Start a stream in a thread; return (its chunks so far, the future) after n chunks."""
    received, ready = [], threading.Event()

    def run():
        for chunk in stream_generate(server.grpc_url, request, cancel=cancel):
            received.append(chunk)
            if len(received) == n:
                ready.set()
        return received

    future = ThreadPoolExecutor(1).submit(run)
    assert ready.wait(60), "the stream never started"
    return received, future


def test_cancel_stops_the_stream_and_frees_its_slot(single_slot_server):
    """A client cancel stops generation on the server (tokens counted there) and the request
    waiting for the only slot then runs."""
    tokens_before = metric(single_slot_server, "tokenstream_generation_tokens_total")
    cancel = threading.Event()
    long = GenerateRequest(prompt="long", sampling={"max_tokens": 200, "ignore_eos": True})
    received, running = _first_chunks(single_slot_server, long, 3, cancel)
    waiting = ThreadPoolExecutor(1).submit(
        _chunks, single_slot_server, prompt="next", sampling={"max_tokens": 5, "ignore_eos": True}
    )
    wait_for(lambda: metric(single_slot_server, "tokenstream_active_streams") == 2)
    cancel.set()
    running.result(timeout=60)
    assert 3 <= len(received) < 200 and not received[-1].final
    assert sum(c.num_output_tokens for c in waiting.result(timeout=60)) == 5
    wait_for(lambda: metric(single_slot_server, "tokenstream_active_streams") == 0)
    generated = metric(single_slot_server, "tokenstream_generation_tokens_total") - tokens_before
    # 200 tokens take 4 s here; the cancel is seen within a poll (40 ms) and a step (20 ms).
    assert 5 + 3 <= generated < 5 + 100, generated


def test_waiting_gauge_counts_requests_waiting_for_a_slot(single_slot_server):
    """tokenstream_waiting_requests (for autoscaling): 1 while a request waits behind the only
    slot, 0 once it runs; the active gauge counts both."""
    cancel = threading.Event()
    long = GenerateRequest(prompt="long", sampling={"max_tokens": 200, "ignore_eos": True})
    assert metric(single_slot_server, "tokenstream_waiting_requests") == 0
    _, running = _first_chunks(single_slot_server, long, 1, cancel)
    waiting = ThreadPoolExecutor(1).submit(
        _chunks, single_slot_server, prompt="next", sampling={"max_tokens": 5, "ignore_eos": True}
    )
    wait_for(lambda: metric(single_slot_server, "tokenstream_waiting_requests") == 1)
    assert metric(single_slot_server, "tokenstream_active_streams") == 2
    cancel.set()
    running.result(timeout=60)
    assert sum(c.num_output_tokens for c in waiting.result(timeout=60)) == 5
    assert metric(single_slot_server, "tokenstream_waiting_requests") == 0
    wait_for(lambda: metric(single_slot_server, "tokenstream_active_streams") == 0)


def test_overloaded_server_refuses_with_unavailable(single_slot_server):
    """Beyond max_streams + queue_limit a request fails at once as overloaded (Triton code
    UNAVAILABLE: retry later), over gRPC and HTTP; the accepted ones complete."""
    rejected_before = metric(single_slot_server, "tokenstream_rejected_requests_total")
    cancel = threading.Event()
    long = GenerateRequest(prompt="busy", sampling={"max_tokens": 60, "ignore_eos": True})
    _, running = _first_chunks(single_slot_server, long, 1, cancel)
    queued = ThreadPoolExecutor(1).submit(
        _chunks, single_slot_server, prompt="queued", sampling={"max_tokens": 3, "ignore_eos": True}
    )
    wait_for(lambda: metric(single_slot_server, "tokenstream_active_streams") == 2)
    with pytest.raises(GenerationError) as info:
        _chunks(single_slot_server, prompt="one too many", sampling={"max_tokens": 3})
    assert info.value.code == wire.OVERLOADED.code
    assert info.value.message.startswith("overloaded: 1 requests are already waiting")
    body = {"text_input": "x", "parameters": {"stream": True, "max_tokens": 3}}
    assert wire.error_code(_sse_error(single_slot_server, body)) == wire.OVERLOADED.code
    assert metric(single_slot_server, "tokenstream_rejected_requests_total") == rejected_before + 2
    assert wire.OVERLOADED.triton_code == "UNAVAILABLE"
    cancel.set()
    running.result(timeout=60)
    assert sum(c.num_output_tokens for c in queued.result(timeout=60)) == 3


def _sse_error(server, body: dict) -> str:
    """The error message of a generate_stream request that fails (as an event or a status)."""
    try:
        events = _sse(server, body)
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read().decode().removeprefix("data:").strip())["error"]
    return next(e["error"] for e in events if "error" in e)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt": "x", "sampling": "{bad json"}, "sampling_parameters is not valid JSON"),
        ({"prompt": "x", "sampling": {"temprature": 1}}, "unknown key(s) 'temprature'"),
        ({"prompt": "x", "sampling": {"top_p": 2}}, "top_p must be in (0, 1], got 2"),
        ({"prompt": "x", "sampling": {"temperature": -1}}, "temperature must be in [0, 100]"),
        ({"prompt": "   "}, "text_input is empty"),
        ({"prompt": "word " * 300}, "the model's context is 256"),
        ({"prompt": "x", "sampling": {"max_tokens": 1000}}, "exceed the model's context of 256"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role must be one of"),
    ],
)
def test_bad_requests_fail_alone_with_a_clear_error(triton_server, kwargs, message):
    """Each malformed request gets its own error; a parallel stream completes untouched."""
    other = ThreadPoolExecutor(1).submit(_chunks, triton_server, prompt="fine", sampling=FIXED)
    sampling = kwargs.pop("sampling", {})
    with pytest.raises(GenerationError) as info:
        if isinstance(sampling, str):  # raw text the client library would not produce
            _raw_sampling_request(triton_server, kwargs["prompt"], sampling)
        else:
            list(
                stream_generate(
                    triton_server.grpc_url, GenerateRequest(**kwargs, sampling=sampling)
                )
            )
    assert message in info.value.message
    assert info.value.message.startswith("invalid request")
    assert sum(c.num_output_tokens for c in other.result(timeout=60)) == 12


def _raw_sampling_request(server, prompt: str, sampling_text: str) -> None:
    """Send sampling_parameters as given, over tritonclient's own gRPC stream."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from clients.library.grpc_client import build_inputs, to_generation_error

    inputs = [
        i for i in build_inputs(GenerateRequest(prompt=prompt)) if i.name() != "sampling_parameters"
    ]
    raw = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    raw.set_data_from_numpy(np.array([sampling_text.encode()], dtype=np.object_))
    results = []
    done = threading.Event()

    def callback(result=None, error=None):
        results.append((result, error))
        done.set()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer("chat", inputs + [raw])
        assert done.wait(30)
    finally:
        client.stop_stream()
        client.close()
    if results[0][1] is not None:
        raise to_generation_error(results[0][1])


def test_sse_generate_stream(triton_server):
    """Triton's HTTP generate_stream gives one SSE event per token, the text deltas adding up."""
    body = {
        "text_input": "Hello",
        "stream": True,
        "sampling_parameters": json.dumps(FIXED | {"temperature": 0}),
        "return_num_output_tokens": True,
        "return_finish_reason": True,
        "return_system_fingerprint": True,
        "exclude_input_in_output": True,
    }
    events = _sse(triton_server, body)
    assert len(events) == 12
    assert events[-1]["finish_reason"] == "length"
    greedy = FIXED | {"temperature": 0}
    grpc = _chunks(triton_server, prompt="Hello", sampling=greedy, return_system_fingerprint=True)
    assert "".join(e["text_output"] for e in events) == "".join(c.text for c in grpc)
    fingerprints = {e["system_fingerprint"] for e in events} | {c.system_fingerprint for c in grpc}
    assert len(fingerprints) == 1 and fingerprints.pop().startswith("fp_")  # on every response


def test_sse_request_parameters_are_sampling_settings(triton_server):
    """HTTP generate's "parameters" object carries sampling settings and the stream flag."""
    body = {
        "text_input": "Hello",
        "parameters": {"stream": True, "max_tokens": 4, "ignore_eos": True},
    }
    assert len(_sse(triton_server, body)) == 4


def test_sse_error_is_reported(triton_server):
    """A bad request over generate_stream returns the error text."""
    body = {"text_input": "Hello", "stream": True, "sampling_parameters": '{"top_p": 2}'}
    try:
        events = _sse(triton_server, body)
        text = json.dumps(events)
    except urllib.error.HTTPError as exc:
        text = exc.read().decode()
    assert "top_p must be in (0, 1]" in text


def test_metrics_show_our_histograms(triton_server):
    """TTFT, ITL and queue histograms, the token counter and the gauges are exported."""
    _chunks(triton_server, prompt="metrics", sampling=FIXED)
    text = urllib.request.urlopen(triton_server.metrics_url, timeout=10).read().decode()
    for name in (
        "tokenstream_time_to_first_token_seconds_bucket",
        "tokenstream_time_per_output_token_seconds_count",
        "tokenstream_request_queue_time_seconds_sum",
        "tokenstream_generation_tokens_total",
        "tokenstream_active_streams",
        "tokenstream_waiting_requests",
        "tokenstream_rejected_requests_total",
        "nv_inference_request_success",
    ):
        assert name in text, name
    assert metric(triton_server, "tokenstream_generation_tokens_total") >= 12


def test_a_follow_up_turn_reuses_the_cached_conversation(triton_server):
    """A chat's second turn (messages: the first turn, its answer, a new question) prefills only
    what is new: its timing reports the reused tokens, and the prefix-cache counters count them."""
    hits = metric(triton_server, "tokenstream_prefix_cache_hits_total")
    reused = metric(triton_server, "tokenstream_prefix_cache_reused_tokens_total")
    first = [
        {"role": "system", "content": "You are a careful assistant who answers in full sentences."},
        {"role": "user", "content": "Tell me about the prefix cache of this server, please."},
    ]
    sampling = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    answer = _chunks(triton_server, messages=first, sampling=sampling, return_timing=True)
    assert answer[0].timing.cached_tokens == 0
    second = first + [
        {"role": "assistant", "content": "".join(c.text for c in answer)},
        {"role": "user", "content": "And why?"},
    ]
    chunks = _chunks(triton_server, messages=second, sampling=sampling, return_timing=True)
    cached = chunks[0].timing.cached_tokens
    assert cached >= chunks[0].num_input_tokens // 2, (cached, chunks[0].num_input_tokens)
    assert all(c.timing.cached_tokens == cached for c in chunks)
    wait_for(lambda: metric(triton_server, "tokenstream_prefix_cache_hits_total") == hits + 1)
    total = metric(triton_server, "tokenstream_prefix_cache_reused_tokens_total")
    assert total == reused + cached


def test_sixteen_streams_round_after_round_keep_the_server_alive(triton_server):
    """Rounds of 16 concurrent streams (beyond max_streams: some wait) all complete and the
    server survives."""

    def run(i):
        return _chunks(
            triton_server,
            prompt=f"round robin {i}",
            sampling={"max_tokens": 24, "ignore_eos": True, "seed": i},
        )

    with ThreadPoolExecutor(16) as pool:
        for _ in range(2):
            results = list(pool.map(run, range(16)))
            assert all(sum(c.num_output_tokens for c in r) == 24 for r in results)
    assert triton_server.returncode is None and triton_server.is_ready()


def test_many_short_requests_one_after_another(triton_server):
    """150 short requests in a row, each on a fresh stream, all finish; the server lives on.
    A version polling is_cancelled() from a second thread crashed here (SIGSEGV) within ~50."""
    for i in range(150):
        chunks = _chunks(
            triton_server,
            prompt="hello " * 30,
            return_timing=True,
            sampling={"max_tokens": 4, "ignore_eos": True, "seed": i},
        )
        assert sum(c.num_output_tokens for c in chunks) == 4, i
    assert triton_server.returncode is None and triton_server.is_ready()


def test_logprobs_and_cumulative_logprob(triton_server, tiny_loaded):
    """Each response carries its token's log-probability under the served model (checked with
    an unbatched forward pass here); the cumulative one is their running sum."""
    body = {
        "text_input": "Hello",
        "stream": True,
        "exclude_input_in_output": True,
        "sampling_parameters": json.dumps(FIXED | {"seed": 3}),
        "return_logprobs": True,
        "return_cumulative_logprob": True,
    }
    events = _sse(triton_server, body)
    assert len(events) == 12
    entries = [entry for event in events for entry in json.loads(event["logprobs"])]
    prompt = encode_prompt(tiny_loaded.tokenizer, text="Hello")
    output = [entry["token_id"] for entry in entries]
    with torch.inference_mode():
        logits = tiny_loaded.model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)  # [12, V]
    expected = expected.gather(-1, torch.tensor(output)[:, None]).squeeze(-1).tolist()
    assert [entry["logprob"] for entry in entries] == pytest.approx(expected, abs=1e-4)
    running = 0.0
    for event, logprob in zip(events, expected):
        running += logprob
        assert event["cumulative_logprob"] == pytest.approx(running, rel=1e-4, abs=1e-4)
