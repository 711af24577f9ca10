"""The dialogue_model on a real tritonserver (tiny model): the operators' load script, Triton's
batching, sampling inputs and per-request errors inside a batch."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import DIALOGUE_MAX_BEAM as MAX_BEAM
from tritonclient.utils import InferenceServerException

from streaming_backend.wire import (
    BEAM_WIDTH,
    CUM_LOG_PROBS,
    DIALOGUE_INPUT_IDS,
    DIALOGUE_MODEL,
    DIALOGUE_OUTPUT_IDS,
    DIALOGUE_TEMPERATURE,
    RANDOM_SEED,
    REQUEST_OUTPUT_LEN,
    RUNTIME_TOP_P,
    SEQUENCE_LENGTH,
)

pytestmark = pytest.mark.server
DEFAULT_OUTPUT_LEN = 16  # the model's default_output_len


@pytest.fixture(scope="module")
def client(dialogue_server):
    with grpcclient.InferenceServerClient(dialogue_server.grpc_url) as c:
        yield c


def model_stats(server) -> dict:
    with urllib.request.urlopen(f"{server.http_url}/v2/models/{DIALOGUE_MODEL}/stats") as r:
        return json.loads(r.read())["model_stats"][0]


def stats_after(server, before: dict, requests: int, timeout: float = 10.0) -> dict:
    """The statistics once `requests` more inferences are counted: Triton reports an execute()'s
    statistics just after its responses go out, so a read right after the last response can
    precede them."""
    deadline = time.monotonic() + timeout
    while True:
        after = model_stats(server)
        if after["inference_count"] - before["inference_count"] >= requests:
            return after
        if time.monotonic() > deadline:
            return after  # the caller's assertion reports the shortfall
        time.sleep(0.02)


def tensor(name, array, datatype):
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def request_inputs(ids, **scalars):
    """input_ids [1, L] INT32 plus [1, 1] scalars given as (value, numpy dtype, Triton type)."""
    inputs = [tensor(DIALOGUE_INPUT_IDS, np.array([ids], dtype=np.int32), "INT32")]
    for name, (value, dtype, datatype) in scalars.items():
        inputs.append(tensor(name, np.array([[value]], dtype=dtype), datatype))
    return inputs


def test_the_operators_load_script_as_written(dialogue_server):
    """100 threads, each `client.infer("dialogue_model", inputs)` with random ids [1, 32]: all
    succeed with output_ids [1, 1, 16] INT32, and Triton ran requests together."""
    client = grpcclient.InferenceServerClient(url=dialogue_server.grpc_url)
    before = model_stats(dialogue_server)

    def send_request():
        input_data = np.random.randint(0, 1000, [1, 32]).astype(np.int32)
        inputs = [grpcclient.InferInput("input_ids", [1, 32], "INT32")]
        inputs[0].set_data_from_numpy(input_data)
        return client.infer("dialogue_model", inputs)

    with ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(lambda _: send_request(), range(100)))
    client.close()
    for result in results:
        ids = result.as_numpy(DIALOGUE_OUTPUT_IDS)
        assert ids.dtype == np.int32 and ids.shape == (1, 1, DEFAULT_OUTPUT_LEN)
        assert result.as_numpy(SEQUENCE_LENGTH).shape == (1, 1)
        assert result.as_numpy(CUM_LOG_PROBS).shape == (1, 1)
    after = stats_after(dialogue_server, before, 100)
    requests = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == 100
    assert executions < requests  # some execute() calls held several requests
    sizes = {b["batch_size"] for b in after["batch_stats"]}
    assert max(sizes) > 1


def test_requests_of_different_lengths_share_a_batch(dialogue_server, client):
    """Ragged prompts (5..40 ids) go into one execute() and each gets its own answer."""
    before = model_stats(dialogue_server)
    prompts = [list(range(1, 1 + n)) for n in (5, 40, 12, 33, 7, 21, 40, 9)]
    length = {REQUEST_OUTPUT_LEN: (4, np.int32, "INT32")}
    together = concurrently(client, [request_inputs(p, **length) for p in prompts])
    after = stats_after(dialogue_server, before, len(prompts))
    alone = [client.infer(DIALOGUE_MODEL, request_inputs(p, **length)) for p in prompts]
    for a, b in zip(together, alone):
        assert a.as_numpy(DIALOGUE_OUTPUT_IDS).tolist() == b.as_numpy(DIALOGUE_OUTPUT_IDS).tolist()
    assert after["execution_count"] - before["execution_count"] < len(prompts)


def concurrently(client, requests: list) -> list:
    """Send requests at the same moment from threads; results or InferenceServerExceptions."""
    barrier = threading.Barrier(len(requests))

    def infer(inputs):
        barrier.wait()
        try:
            return client.infer(DIALOGUE_MODEL, inputs)
        except InferenceServerException as error:
            return error

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(infer, requests))


def outputs(result) -> tuple:
    return (
        result.as_numpy(DIALOGUE_OUTPUT_IDS).tolist(),
        result.as_numpy(SEQUENCE_LENGTH).tolist(),
        result.as_numpy(CUM_LOG_PROBS).tolist(),
    )


def test_greedy_is_deterministic_and_a_seed_reproduces_sampling(client):
    prompt = list(range(100, 120))
    greedy = [outputs(client.infer(DIALOGUE_MODEL, request_inputs(prompt))) for _ in range(2)]
    assert greedy[0] == greedy[1]
    sample = {
        DIALOGUE_TEMPERATURE: (1.0, np.float32, "FP32"),
        RUNTIME_TOP_P: (0.95, np.float32, "FP32"),
    }

    def seeded(seed):
        seed_input = {RANDOM_SEED: (seed, np.uint64, "UINT64")}
        return outputs(client.infer(DIALOGUE_MODEL, request_inputs(prompt, **sample, **seed_input)))

    assert seeded(7) == seeded(7)
    assert seeded(7) != seeded(8)
    assert seeded(7) != greedy[0]


def test_four_beams_come_back_distinct_and_best_first(client):
    result = client.infer(
        DIALOGUE_MODEL,
        request_inputs(list(range(5, 25)), **{BEAM_WIDTH: (4, np.int32, "INT32")}),
    )
    ids = result.as_numpy(DIALOGUE_OUTPUT_IDS)
    lengths = result.as_numpy(SEQUENCE_LENGTH)[0]
    cum = result.as_numpy(CUM_LOG_PROBS)[0]
    assert ids.shape == (1, 4, DEFAULT_OUTPUT_LEN)
    beams = {tuple(ids[0, b, : lengths[b]].tolist()) for b in range(4)}
    assert len(beams) == 4
    scores = cum / lengths  # len_penalty 1
    assert all(a >= b - 1e-5 for a, b in zip(scores, scores[1:]))


def int_scalar(name, value):
    return {name: (value, np.int32, "INT32")}


BAD_REQUESTS = {
    "wrong dtype": (
        [tensor(DIALOGUE_INPUT_IDS, np.array([[1, 2, 3]], dtype=np.int64), "INT64")],
        "input_ids",
    ),
    "empty input": (
        [tensor(DIALOGUE_INPUT_IDS, np.zeros((1, 0), dtype=np.int32), "INT32")],
        "input_ids is empty",
    ),
    "ids out of the vocabulary": (request_inputs([1, 2, 10**8]), "input_ids must be in [0, "),
    "beam_width above the maximum": (
        request_inputs([1, 2], **int_scalar(BEAM_WIDTH, MAX_BEAM + 1)),
        f"beam_width must be in [1, {MAX_BEAM}]",
    ),
    "request_output_len beyond the context": (
        request_inputs([1, 2], **int_scalar(REQUEST_OUTPUT_LEN, 1000)),
        "exceed the model's context of 256",
    ),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_a_bad_request_fails_alone_in_its_batch(dialogue_server, client, case):
    """The bad request gets a clear INVALID_ARG error; the requests sent with it succeed."""
    bad, message = BAD_REQUESTS[case]
    good = [
        request_inputs(list(range(1, 10 + i)), **int_scalar(REQUEST_OUTPUT_LEN, 3))
        for i in range(5)
    ]
    before = model_stats(dialogue_server)
    results = concurrently(client, [*good[:2], bad, *good[2:]])
    counted = len(good) + (case != "wrong dtype")  # Triton refuses a wrong dtype itself
    after = stats_after(dialogue_server, before, counted)
    error = results[2]
    assert isinstance(error, InferenceServerException)
    assert message in error.message()
    assert "INVALID_ARG" in str(error.status())
    for result in results[:2] + results[3:]:
        assert not isinstance(result, Exception)
        assert result.as_numpy(DIALOGUE_OUTPUT_IDS).shape == (1, 1, 3)
    executions = after["execution_count"] - before["execution_count"]
    assert executions < len(good)  # the good ones shared execute() calls
    if case != "wrong dtype":  # Triton refuses that one before it reaches the model
        assert after["inference_count"] - before["inference_count"] == len(good) + 1


def test_batch_sizes_show_on_the_metrics_port(dialogue_server, client):
    """Our histogram of requests per execute() is on /metrics beside Triton's own counters,
    counting a request of this test's own (so the test holds alone, in any order)."""
    client.infer(
        DIALOGUE_MODEL, request_inputs([101, 102, 103], request_output_len=(4, np.int32, "INT32"))
    )
    with urllib.request.urlopen(dialogue_server.metrics_url) as r:
        text = r.read().decode()
    count = [
        line
        for line in text.splitlines()
        if line.startswith("tokenstream_dialogue_batch_size_count")
    ]
    assert count and float(count[0].rsplit(" ", 1)[1]) > 0
    assert "nv_inference_exec_count" in text


LOOPING_IDS = [(37 * i) % 700 + 100 for i in range(15)] * 4  # its own n-grams draft


def test_speculation_shows_on_the_metrics_port_and_in_status(dialogue_server, client):
    """The dialogue model speculates (auto: n-grams on a CPU): its drafted and accepted tokens
    grow the chat model's counters under its own model label, counted by the time the response
    is back, and the supervisor's /status reads them from there with their rate."""
    from streaming_backend.launcher.control import model_speculation
    from streaming_backend.launcher.server import ServerConfig
    from streaming_backend.launcher.supervisor import Supervisor, SupervisorConfig
    from streaming_backend.wire import DIALOGUE_SPECULATION

    before = model_speculation(dialogue_server.metrics_url, DIALOGUE_MODEL, 10)
    assert before is not None, "the dialogue model exports no speculation counters"
    length = (30, np.int32, "INT32")
    client.infer(DIALOGUE_MODEL, request_inputs(LOOPING_IDS, request_output_len=length))
    after = model_speculation(dialogue_server.metrics_url, DIALOGUE_MODEL, 10)
    assert after["drafted"] > before["drafted"] and after["accepted"] >= before["accepted"]
    assert after["rate"] == round(after["accepted"] / after["drafted"], 4)
    supervisor = Supervisor(SupervisorConfig(ServerConfig(models=(DIALOGUE_MODEL,))))
    assert supervisor.status()[DIALOGUE_SPECULATION] is None  # no server started
    supervisor.server = dialogue_server  # as though it had started this one
    assert supervisor.status()[DIALOGUE_SPECULATION] == after
