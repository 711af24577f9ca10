"""The bench's JSON document, its schema check, terminal tables, the plot and --compare."""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import replace

import pytest

from clients import cli
from clients.bench.cli import BenchConfig, config_from_args, first_error, write_outputs
from clients.bench.report import (
    SCHEMA,
    RunResult,
    build_report,
    format_compare,
    format_overview,
    format_run,
    load_report,
    validate_report,
)
from clients.bench.summary import ClockMap, RequestRecord
from clients.library.chunk import Chunk
from streaming_backend.wire import ServerTiming

MS = 1_000_000


def fake_record(i: int, ttft_ms: int = 100, itl_ms: int = 50, tokens: int = 4) -> RequestRecord:
    """A request sent at i seconds: TTFT ttft_ms, then a token every itl_ms; server stamps."""
    sent = i * 1000 * MS
    first = sent + ttft_ms * MS
    timing = ServerTiming(
        received_ns=sent + 1 * MS,
        queued_ns=sent + 2 * MS,
        prefill_start_ns=sent + 5 * MS,
        emitted_ns=first - 1 * MS,
    )
    chunks = [
        Chunk.delta("abc", 1, first + k * itl_ms * MS, request_id=str(i), num_input_tokens=12)
        for k in range(tokens)
    ]
    chunks[0] = replace(chunks[0], timing=timing)  # the first token's server stamps
    chunks[-1] = replace(chunks[-1], finish_reason="length", final=True)
    return RequestRecord(index=i, sent_ns=sent, chunks=chunks)


def fake_doc(ttft_ms: int = 100, itl_ms: int = 50) -> dict:
    """A report of two transports at two levels; one request of each run failed."""
    runs = []
    for transport in ("grpc", "ws"):
        for c in (1, 4):
            records = [fake_record(i, ttft_ms, itl_ms) for i in range(3)]
            records.append(RequestRecord(index=3, sent_ns=0, error="overloaded: queue full"))
            url = "127.0.0.1:8001" if transport == "grpc" else "ws://127.0.0.1:8080/ws"
            runs.append(RunResult(transport, url, c, None, ClockMap(True), records))
    return build_report({"requests": 4}, runs, "2025-01-01T00:00:00+00:00")


def test_report_matches_schema_and_figures():
    """The document validates and carries the summary and every raw request."""
    doc = fake_doc()
    validate_report(doc)
    run = doc["runs"][0]
    s = run["summary"]
    assert (s["requests"], s["completed"], s["errors"], s["cancelled"]) == (4, 3, 1, 0)
    assert s["ttft_ms"]["avg"] == pytest.approx(100)
    assert s["itl_ms"]["p99"] == pytest.approx(50)
    assert s["ttft_breakdown_ms"]["prefill"]["avg"] == pytest.approx(94)
    assert s["ttft_breakdown_ms"]["to_client"]["avg"] == pytest.approx(1)
    r0 = run["requests"][0]
    assert r0["responses"][0] == [100 * MS, 1, 3, 99 * MS]
    assert r0["responses"][1] == [150 * MS, 1, 3, None]
    assert r0["server_timing"]["prefill_start_ns"] == 5 * MS
    assert run["requests"][3]["status"] == "error"
    assert run["same_clock"] is True and "exact" in run["clock_note"]


def test_report_survives_json_round_trip(tmp_path):
    """What is written is what load_report reads back, plus a PNG plot."""
    doc = fake_doc()
    paths = write_outputs(doc, tmp_path / "out", plot=True)
    assert [p.name for p in paths] == ["bench.json", "bench.png"]
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert load_report(paths[0]) == json.loads(json.dumps(doc))


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda d: d.update(schema="other/1"), "schema"),
        (lambda d: d["runs"][0].update(transport="carrier-pigeon"), "runs[0].transport"),
        (lambda d: d["runs"][1]["summary"].pop("errors"), "runs[1].summary.errors"),
        (lambda d: d["runs"][0]["summary"]["ttft_ms"].update(p99="slow"), "ttft_ms.p99"),
        (lambda d: d["runs"][0]["requests"].pop(), "requests length"),
        (lambda d: d["runs"][0]["requests"][0]["responses"].append([1, 2]), "responses rows"),
    ],
)
def test_schema_check_names_the_bad_field(mutate, field):
    """A malformed document is refused with the path of the offending field."""
    doc = copy.deepcopy(fake_doc())
    mutate(doc)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        validate_report(doc)


def test_run_table_and_overview():
    """The tables show percentiles, error counts and the breakdown parts."""
    doc = fake_doc()
    text = format_run(doc["runs"][0])
    assert "completed 3, errors 1, cancelled 0" in text
    assert "Time to first token (ms)" in text and "100.00" in text
    assert "TTFT prefill (ms)" in text
    overview = format_overview(doc)
    assert overview.count("\n") >= 5 and "ws" in overview and "3/1/0" in overview


def test_compare_side_by_side_with_ratios():
    """Runs are matched by transport and level; B/A ratios are printed per figure."""
    a, b = fake_doc(ttft_ms=100), fake_doc(ttft_ms=200, itl_ms=25)
    b["runs"] = b["runs"][:3]  # ws c=4 missing from B
    text = format_compare(a, b, names=("a.json", "b.json"))
    grpc_c1 = text.split("== grpc c=1")[1].split("==")[0]
    ttft_row = next(line for line in grpc_c1.splitlines() if line.startswith("TTFT avg"))
    assert ttft_row.split()[-3:] == ["100.00", "200.00", "x2.00"]
    itl_row = next(line for line in grpc_c1.splitlines() if line.startswith("ITL p50"))
    assert itl_row.split()[-1] == "x0.50"
    assert "== ws c=4\n   only in A" in text


def test_compare_from_the_command_line(tmp_path, capsys):
    """`tokenstream bench --compare a.json b.json` prints the comparison and exits 0."""
    for name, ttft in (("a", 100), ("b", 150)):
        (tmp_path / f"{name}.json").write_text(json.dumps(fake_doc(ttft_ms=ttft)))
    rc = cli.main(["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "x1.50" in out and "a.json" in out


def test_compare_refuses_other_documents(tmp_path):
    """--compare only reads bench reports."""
    (tmp_path / "x.json").write_text(json.dumps({"schema": "genai-perf"}))
    with pytest.raises(ValueError, match=f"not a {SCHEMA}"):
        load_report(tmp_path / "x.json")


def test_options_become_a_config():
    """Comma lists of levels and transports parse into the config dataclass."""
    p = argparse.ArgumentParser()
    from clients.bench.cli import add_arguments

    add_arguments(p)
    args = p.parse_args(
        ["--transport", "grpc,sse,ws", "--concurrency", "1,4,16", "--output-tokens", "64"]
    )
    cfg = config_from_args(args)
    assert cfg.transports == ("grpc", "sse", "ws") and cfg.concurrency == (1, 4, 16)
    assert [lv.label for lv in cfg.levels()] == ["c=1", "c=4", "c=16"]
    assert cfg.output_tokens == 64 and cfg.requests == 50
    with pytest.raises(SystemExit):
        p.parse_args(["--transport", "pigeon"])
    extra = config_from_args(p.parse_args(["--extra-params", '{"logit_bias": {"2": -100.0}}']))
    assert extra.extra_params == {"logit_bias": {"2": -100.0}} and cfg.extra_params == {}
    for bad in ("[1]", "{nope"):
        with pytest.raises(SystemExit):
            p.parse_args(["--extra-params", bad])
    assert BenchConfig(request_rate=(2.0,)).levels()[0].label == "rate=2/s"


def test_first_error_only_when_nothing_completed():
    """The CLI fails (and shows why) only when no request at all succeeded."""
    doc = fake_doc()
    assert first_error(doc) is None
    for run in doc["runs"]:
        run["summary"]["completed"] = 0
    assert first_error(doc) == "overloaded: queue full"


def genai_perf_export(with_outputs: bool = True) -> dict:
    """A minimal profile_export.json: one request, 3 responses, wall-clock ns."""
    wall = 1_700_000_000_000 * MS  # wall = monotonic + this
    timing = {
        "received_ns": 1 * MS,
        "queued_ns": 2 * MS,
        "prefill_start_ns": 3 * MS,
        "emitted_ns": 99 * MS,
        "wall_minus_monotonic_ns": wall,
    }
    outputs = [
        {"text_output": t, "num_output_tokens": 1, "timing": json.dumps(timing)} for t in "abc"
    ]
    if not with_outputs:
        outputs = [{"text_output": t} for t in "abc"]
    request = {
        "timestamp": wall,
        "response_timestamps": [wall + 100 * MS, wall + 150 * MS, wall + 200 * MS],
        "response_outputs": outputs,
    }
    return {
        "experiments": [{"experiment": {"mode": "concurrency", "value": 2}, "requests": [request]}],
        "version": "2.51.0",
    }


def test_genai_perf_export_reads_with_our_definitions(tmp_path, capsys):
    """A genai-perf raw export is summarised with our metrics, breakdown on wall time."""
    path = tmp_path / "profile_export.json"
    path.write_text(json.dumps(genai_perf_export()))
    rc = cli.main(["bench", "--from-genai-perf", str(path), "--out", str(tmp_path / "o")])
    assert rc == 0 and "genai-perf's wall-clock stamps" in capsys.readouterr().out
    doc = load_report(tmp_path / "o" / "bench.json")
    (run,) = doc["runs"]
    s = run["summary"]
    assert run["concurrency"] == 2 and s["ttft_ms"]["avg"] == pytest.approx(100)
    assert s["itl_ms"]["avg"] == pytest.approx(50) and s["total_output_tokens"] == 3
    b = run["requests"][0]["ttft_breakdown_ms"]
    assert b["to_server"] == pytest.approx(1) and b["to_client"] == pytest.approx(1)
    assert b["prefill"] == pytest.approx(96)


def test_genai_perf_export_without_our_outputs_says_what_to_add(tmp_path, capsys):
    """Without token counts or timing the message names the missing options."""
    from clients.bench.genai_perf import genai_perf_runs, missing_outputs

    path = tmp_path / "profile_export.json"
    path.write_text(json.dumps(genai_perf_export(with_outputs=False)))
    runs = genai_perf_runs(path)
    notes = missing_outputs(runs)
    assert any("return_num_output_tokens:true" in n for n in notes)
    assert any("return_timing:true" in n for n in notes)
    # a response with text counts as one token when the server sent no count
    assert runs[0].records[0].output_tokens() == 3


def test_genai_perf_export_counts_every_request_as_genai_perf(tmp_path):
    """TTFT ends at the first response, with or without text, and every request counts: one
    that ended after a single textless token too (genai-perf's own count)."""
    doc = genai_perf_export()
    first = doc["experiments"][0]["requests"][0]
    first["response_outputs"][0]["text_output"] = ""  # half a character held back
    wall = first["timestamp"]
    eos_only = {
        "timestamp": wall,
        "response_timestamps": [wall + 40 * MS],
        "response_outputs": [{"text_output": "", "num_output_tokens": 1}],
    }
    doc["experiments"][0]["requests"].append(eos_only)
    path = tmp_path / "profile_export.json"
    path.write_text(json.dumps(doc))
    from clients.bench.genai_perf import genai_perf_runs

    (run,) = genai_perf_runs(path)
    s = build_report({}, [run], "now")["runs"][0]["summary"]
    assert s["completed"] == 2 and s["ttft_ms"]["count"] == 2
    assert s["ttft_ms"]["avg"] == pytest.approx((100 + 40) / 2)
    assert s["time_to_first_text_ms"]["count"] == 1
    assert s["time_to_first_text_ms"]["avg"] == pytest.approx(150)


def test_genai_perf_export_ignores_outputs_the_request_did_not_ask_for(tmp_path):
    """perf_analyzer lists every output on every response, with junk where the server sent
    none: only the outputs the request's return_* inputs asked for are read."""
    doc = genai_perf_export()
    request = doc["experiments"][0]["requests"][0]
    request["request_inputs"] = {"return_num_output_tokens": True, "return_timing": True}
    for out in request["response_outputs"]:
        out["num_input_tokens"] = 1207959696  # not asked for: buffer contents
    path = tmp_path / "profile_export.json"
    path.write_text(json.dumps(doc))
    from clients.bench.genai_perf import genai_perf_runs

    (run,) = genai_perf_runs(path)
    (record,) = run.records
    assert record.prompt_tokens is None and record.output_tokens() == 3
    assert record.server_timing is not None


def multi_turn_doc(later_ttft_ms: int = 100, cached: int = 0, turns: int = 10) -> dict:
    """One grpc run of 2 conversations of `turns` turns: TTFT 100 ms at turns 1-4 and
    later_ttft_ms from turn 5 on, with `cached` prompt tokens reused from turn 2 on."""
    records = []
    for c in range(2):
        for t in range(1, turns + 1):
            r = fake_record(c * turns + t - 1, ttft_ms=100 if t < 5 else later_ttft_ms)
            timing = replace(r.chunks[0].timing, cached_tokens=cached if t > 1 else 0)
            r.chunks[0] = replace(r.chunks[0], timing=timing, num_input_tokens=30 * t)
            r.conversation, r.turn = c, t
            records.append(r)
    run = RunResult("grpc", "127.0.0.1:8001", 2, None, ClockMap(True), records)
    return build_report({"multi_turn": turns}, [run], "2025-01-01T00:00:00+00:00")


def test_multi_turn_report_has_turn_figures_tables_and_schema():
    """The document carries per-turn figures and each request's turn; the run table shows TTFT
    per turn and over turns 5-10, the overview the later turns' p50."""
    doc = multi_turn_doc(later_ttft_ms=40, cached=25)
    validate_report(doc)
    (run,) = doc["runs"]
    assert (run["requests"][11]["conversation"], run["requests"][11]["turn"]) == (1, 2)
    mt = run["summary"]["multi_turn"]
    assert mt["per_turn"][2]["input_tokens"]["avg"] == 90
    assert mt["later_turns"]["ttft_ms"]["p50"] == pytest.approx(40)
    table = format_run(run)
    assert "TTFT per turn" in table
    row = next(line for line in table.splitlines() if line.startswith("5-10 "))
    assert row.split() == ["5-10", "12/12", "40.00", "40.00", "40.00", "225.0", "25.0"]
    assert "TTFT p50 of turns 5-10: grpc c=2 40.00 ms" in format_overview(doc)
    validate_report(json.loads(json.dumps(doc)))
    bad = copy.deepcopy(doc)
    bad["runs"][0]["summary"]["multi_turn"]["per_turn"][3]["ttft_ms"].pop("p50")
    with pytest.raises(ValueError, match=r"multi_turn.per_turn\[3\].ttft_ms.p50"):
        validate_report(bad)


def test_compare_shows_ttft_per_turn_with_ratios(tmp_path, capsys):
    """--compare without.json with.json: per-turn TTFT of both runs, B/A per turn and over turns
    5-10 (the prefix cache's target: at most x0.30), and the cached tokens of each."""
    without, with_cache = multi_turn_doc(100, cached=0), multi_turn_doc(25, cached=60)
    for name, doc in (("without", without), ("with", with_cache)):
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    paths = [str(tmp_path / "without.json"), str(tmp_path / "with.json")]
    assert cli.main(["bench", "--compare", *paths]) == 0
    text = capsys.readouterr().out
    assert "B/A = B's figure / A's" in text and f"B = {paths[1]}" in text
    rows = {line.split()[0]: line.split() for line in text.split("TTFT per turn")[1].splitlines()}
    assert rows["1"] == ["1", *["100.00", "100.00", "x1.00"] * 2, "0.0", "0.0"]
    assert rows["5-10"] == ["5-10", *["100.00", "25.00", "x0.25"] * 2, "0.0", "60.0"]
    single = format_compare(fake_doc(), fake_doc())
    assert "TTFT per turn" not in single


def chat_event(delta: dict, finish_reason: str | None = None, **extra) -> str:
    """One server-sent event of a chat completion stream, as perf_analyzer keeps it."""
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    event = {"id": "c1", "object": "chat.completion.chunk", "choices": [choice]} | extra
    return f"data: {json.dumps(event)}\n\n"


def genai_perf_chat_export(usage: bool) -> dict:
    """A profile_export.json of `genai-perf --endpoint-type chat --streaming`: raw events per
    response, a role event first, two text events arriving as one response, then the end."""
    wall = 1_700_000_000_000 * MS
    events = [
        chat_event({"role": "assistant"}),
        chat_event({"content": "Hello"}),
        chat_event({"content": " wor"}) + chat_event({"content": "ld"}),
        chat_event({}, "length"),
    ]
    if usage:
        last = {"id": "c1", "object": "chat.completion.chunk", "choices": []}
        last["usage"] = {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
        events.append(f"data: {json.dumps(last)}\n\n")
    events.append("data: [DONE]\n\n")
    request = {
        "timestamp": wall,
        "request_inputs": {"payload": json.dumps({"messages": [], "stream": True})},
        "response_timestamps": [wall + (40 + 10 * k) * MS for k in range(len(events))],
        "response_outputs": [{"response": e} for e in events],
    }
    return {
        "service_kind": "openai",
        "endpoint": "v1/chat/completions",
        "experiments": [{"experiment": {"mode": "concurrency", "value": 1}, "requests": [request]}],
    }


@pytest.mark.parametrize("usage", [False, True])
def test_genai_perf_chat_export_counts_tokens_from_the_deltas(tmp_path, usage):
    """A chat endpoint's export counts delta.content events as tokens (two arriving together
    are two), the usage event adds the model's count of the rest; TTFT ends at the first text,
    as over our openai transport (the role event is no response of the model)."""
    from clients.bench.genai_perf import genai_perf_runs, missing_outputs

    path = tmp_path / "profile_export.json"
    path.write_text(json.dumps(genai_perf_chat_export(usage)))
    runs = genai_perf_runs(path)
    (record,) = runs[0].records
    assert runs[0].transport == "openai" and record.status == "ok"
    assert record.text == "Hello world" and record.finish_reason == "length"
    assert record.output_tokens() == (5 if usage else 3)
    assert record.prompt_tokens == (9 if usage else None)
    s = build_report({}, runs, "now")["runs"][0]["summary"]
    assert s["ttft_ms"]["avg"] == pytest.approx(50) and s["total_output_tokens"] > 0
    notes = missing_outputs(runs)
    assert any("usage" in n for n in notes) != usage
    assert not any("return_timing" in n for n in notes)
