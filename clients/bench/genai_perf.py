"""Read a genai-perf run's raw export (profile_export.json) as bench runs.

genai-perf (through perf_analyzer) keeps every request's send time and every response's receive
time, in wall-clock ns, plus the outputs of each response. Asked to with
`--extra-inputs return_num_output_tokens:true --extra-inputs return_timing:true`, those outputs hold
the server's token counts and timestamps, so the very same requests can be summarised with our
definitions and TTFT breakdown, beside genai-perf's own figures.

A run against the OpenAI-compatible API (`--endpoint-type chat --streaming`, or `completions`)
keeps each response's raw event text instead (`{"response": "data: {...}\n\n"}`, several events
when they arrived together): those are read as our openai transport reads them
(clients/library/openai_client.py: a text event, delta.content or text, is one token; a usage event
carries the model's count of the rest).
"""

from __future__ import annotations

import json
from pathlib import Path

from clients.bench.report import RunResult
from clients.bench.summary import ClockMap, RequestRecord
from clients.library.chunk import Chunk, GenerationError
from clients.library.openai_client import DONE
from clients.library.openai_client import event_chunk as openai_event_chunk
from clients.library.sse_client import event_chunk, parse_sse_line
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

# perf_analyzer's OpenAI client keeps a response's raw server-sent events under this key.
RAW_EVENTS = "response"


def request_record(index: int, req: dict) -> RequestRecord:
    """One perf_analyzer request: send stamp, and a Chunk per response (stamp and outputs)."""
    rec = RequestRecord(index=index, sent_ns=int(req["timestamp"]))
    inputs, tokens = req.get("request_inputs"), 0
    try:
        for ts, out in zip(req["response_timestamps"], req["response_outputs"], strict=False):
            if RAW_EVENTS in out:
                chunks = openai_chunks(out[RAW_EVENTS], tokens, int(ts))
                tokens += sum(c.tokens for c in chunks)
                rec.chunks += chunks
            else:
                rec.chunks.append(event_chunk(asked_outputs(out, inputs), int(ts), str(index)))
    except GenerationError as exc:
        rec.error = exc.message
    return rec


def openai_chunks(raw: str, tokens_so_far: int, received_ns: int) -> list[Chunk]:
    """The Chunks of one OpenAI response's raw events (`data: {...}` lines; [DONE] and events
    without text or usage, such as the role event opening a chat, give none)."""
    chunks: list[Chunk] = []
    for line in raw.encode().splitlines():
        if line.removeprefix(b"data:").strip() == DONE:
            continue
        event = parse_sse_line(line)
        chunk = None if event is None else openai_event_chunk(event, tokens_so_far, received_ns)
        if chunk is not None:
            tokens_so_far += chunk.tokens
            chunks.append(chunk)
    return chunks


def is_openai(exp: dict) -> bool:
    """Whether an experiment ran against an OpenAI-compatible API (raw events per response)."""
    return any(RAW_EVENTS in out for req in exp["requests"] for out in req["response_outputs"])


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
    if is_openai(exp):
        note = "genai-perf's wall-clock stamps; OpenAI events carry no server stamps"
        return RunResult("openai", url, concurrency, rate, WALL_CLOCK, records, note)
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
    notes = []
    chat = [c for run in runs if run.transport == "openai" for r in run.records for c in r.chunks]
    if chat and not any(c.final for c in chat):  # the usage event is the final Chunk
        notes.append(
            "OpenAI events without a usage event (stream_options.include_usage): output tokens "
            "are the text events, one per model response"
        )
    # the model outputs to ask for: OpenAI runs have none
    triton = [run for run in runs if run.transport != "openai"]
    chunks = [c for run in triton for r in run.records for c in r.chunks]
    if chunks and all(c.num_output_tokens is None for c in chunks):
        notes.append(
            "no num_output_tokens (a response with text counts as one token): "
            "add --extra-inputs return_num_output_tokens:true"
        )
    if chunks and not any(r.server_timing for run in triton for r in run.records):
        notes.append("no server timing: add --extra-inputs return_timing:true")
    return notes
