"""Read a genai-perf run's raw export (profile_export.json) as bench runs.

genai-perf (through perf_analyzer) keeps every request's send time and every response's receive
time, in wall-clock ns, plus the outputs of each response. Asked to with
`--extra-inputs return_num_output_tokens:true --extra-inputs return_timing:true`, those outputs hold
the server's token counts and timestamps, so the very same requests can be summarised with our
definitions and TTFT breakdown, beside genai-perf's own figures.
"""

from __future__ import annotations

import json
from pathlib import Path

from clients.bench.report import RunResult
from clients.bench.summary import ClockMap, RequestRecord
from clients.chunk import GenerationError
from clients.sse_client import event_chunk
from streaming_backend.wire import (
    CUMULATIVE_LOGPROB,
    FINISH_REASON,
    LOGPROBS,
    NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS,
    OUTPUT_IDS,
    RETURN_CUMULATIVE_LOGPROB,
    RETURN_FINISH_REASON,
    RETURN_LOGPROBS,
    RETURN_NUM_INPUT_TOKENS,
    RETURN_NUM_OUTPUT_TOKENS,
    RETURN_OUTPUT_IDS,
    RETURN_TIMING,
    TIMING,
)

# Outputs the model sends only when asked. perf_analyzer's export lists every output of the
# model's config on every response, filled with whatever its buffer held (e.g. num_input_tokens
# 1207959696) when the server did not send it, so only the asked-for ones are read.
ASKED_BY = {
    NUM_INPUT_TOKENS: RETURN_NUM_INPUT_TOKENS,
    NUM_OUTPUT_TOKENS: RETURN_NUM_OUTPUT_TOKENS,
    OUTPUT_IDS: RETURN_OUTPUT_IDS,
    FINISH_REASON: RETURN_FINISH_REASON,
    TIMING: RETURN_TIMING,
    LOGPROBS: RETURN_LOGPROBS,
    CUMULATIVE_LOGPROB: RETURN_CUMULATIVE_LOGPROB,
}

# genai-perf stamps are wall clock: a client "monotonic" offset of 0 makes ClockMap convert the
# server's monotonic stamps to wall time through wall_minus_monotonic_ns.
WALL_CLOCK = ClockMap(same_clock=False, client_wall_minus_monotonic_ns=0)


def request_record(index: int, req: dict) -> RequestRecord:
    """One perf_analyzer request: send stamp, and a Chunk per response (stamp and outputs)."""
    rec = RequestRecord(index=index, sent_ns=int(req["timestamp"]))
    inputs = req.get("request_inputs")
    try:
        for ts, out in zip(req["response_timestamps"], req["response_outputs"], strict=False):
            rec.chunks.append(event_chunk(asked_outputs(out, inputs), int(ts), str(index)))
    except GenerationError as exc:
        rec.error = exc.message
    return rec


def asked_outputs(outputs: dict, inputs: dict | None) -> dict:
    """The outputs of one response that the request asked for (all when the inputs are unknown)."""
    if inputs is None:
        return outputs
    return {k: v for k, v in outputs.items() if k not in ASKED_BY or inputs.get(ASKED_BY[k])}


def experiment_run(exp: dict, url: str) -> RunResult:
    """One genai-perf experiment (a concurrency or a request rate) as a RunResult."""
    setting = exp.get("experiment", {})
    concurrency = setting.get("value") if setting.get("mode") == "concurrency" else None
    rate = setting.get("value") if setting.get("mode") == "request_rate" else None
    records = [request_record(i, req) for i, req in enumerate(exp["requests"])]
    note = "genai-perf's wall-clock stamps; server stamps converted via wall_minus_monotonic_ns"
    return RunResult("grpc", url, concurrency, rate, WALL_CLOCK, records, note)


def genai_perf_runs(path: Path, url: str = "genai-perf") -> list[RunResult]:
    """Every experiment of a profile_export.json."""
    doc = json.loads(Path(path).read_text())
    if "experiments" not in doc:
        raise ValueError(f"{path}: not a genai-perf profile_export.json (no 'experiments')")
    return [experiment_run(exp, url) for exp in doc["experiments"]]


def missing_outputs(runs: list[RunResult]) -> list[str]:
    """What the export lacks for our figures (token counts, server timing)."""
    chunks = [c for run in runs for r in run.records for c in r.chunks]
    notes = []
    if chunks and all(c.num_output_tokens is None for c in chunks):
        notes.append(
            "no num_output_tokens (a response with text counts as one token): "
            "add --extra-inputs return_num_output_tokens:true"
        )
    if chunks and not any(r.server_timing for run in runs for r in run.records):
        notes.append("no server timing: add --extra-inputs return_timing:true")
    return notes
