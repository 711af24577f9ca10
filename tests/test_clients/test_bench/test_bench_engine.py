"""The engine benchmark's arithmetic, and one tiny run end to end."""

import json

import numpy as np
import pytest

from clients.bench import engine as bench
from clients.library.chunk import Chunk

MS = 1_000_000


def timeline(sent_ms: int, token_ms: list[int]) -> bench.Timeline:
    chunks = tuple(Chunk.delta("x", 1, t * MS) for t in token_ms)
    return bench.Timeline(sent_ms * MS, chunks)


def test_summarize_uses_the_one_metrics_module():
    """Throughput over the whole span; TTFT from submit; ITL per request as genai-perf
    ((latency - TTFT) / (tokens - 1)); percentiles interpolated as numpy."""
    timelines = [timeline(0, [100, 150, 200]), timeline(0, [300, 400])]
    r = bench.summarize("engine", "float32", 2, timelines)
    assert r.output_tokens == 5
    assert r.tokens_per_s == pytest.approx(5 / 0.4)
    assert r.ttft_ms["avg"] == 200 and r.ttft_ms["p50"] == pytest.approx(200)
    assert r.ttft_ms["p90"] == pytest.approx(np.percentile([100, 300], 90))
    assert sorted((r.itl_ms["min"], r.itl_ms["max"])) == [50, 100]


def test_throughput_of_interleaved_rounds_counts_only_their_own_time():
    """Given the time a system's own rounds took, throughput ignores the gaps between them."""
    rounds = [timeline(0, [100, 200]), timeline(1000, [1100, 1200])]  # another system between
    assert bench.summarize("engine", "float32", 1, rounds).tokens_per_s == pytest.approx(4 / 1.2)
    busy = sum(bench.span_ns([t]) for t in rounds)
    assert busy == 400 * MS
    r = bench.summarize("engine", "float32", 1, rounds, busy)
    assert r.tokens_per_s == pytest.approx(4 / 0.4)


def test_decode_ratio_is_the_inverse_of_mean_itl():
    """compact_vs_hf_decode compares decode speed alone: the HF forward's mean ITL over ours,
    whatever the prefill took (throughput counts it)."""
    base = bench.summarize("hf-generate", "bfloat16", 1, [timeline(0, [500, 600])])
    compact = bench.summarize("eng-compact", "bfloat16", 1, [timeline(0, [500, 550, 600])])
    hf = bench.summarize("eng-hf", "bfloat16", 1, [timeline(0, [100, 200, 300])])
    cells = bench.ratios([base, compact, hf])["bfloat16"]
    assert cells["compact_vs_hf_decode_1"] == pytest.approx(2.0)
    assert cells["compact_vs_hf_throughput_1"] == pytest.approx(0.5)


def test_engine_events_become_chunks():
    """An engine event is the Chunk a client would get when its token existed."""
    from streaming_backend.events import FinishReason, TokenEvent

    event = TokenEvent("r", "hi", (5, 6), 2, 3, 10, 20, 30, finish_reason=FinishReason.LENGTH)
    c = bench.token_chunk(event)
    assert (c.text, c.tokens, c.received_ns, c.finish_reason, c.final) == (
        "hi",
        2,
        30,
        "length",
        True,
    )


def test_tiny_run_writes_json(tiny_model_dir, tmp_path, capsys):
    """A short run on the tiny model prints the table and writes results and ratios."""
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "engine.json"
    args = parser.parse_args(
        [
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--concurrency",
            "1,2",
            "--output-tokens",
            "4",
            "--baseline-requests",
            "1",
            "--rounds",
            "1",
            "--out",
            str(out),
        ]
    )
    assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    assert [(r["system"], r["concurrency"]) for r in doc["results"]] == [
        ("hf-generate", 1),
        ("eng-compact", 1),
        ("eng-hf", 1),
        ("eng-compact", 2),
        ("eng-hf", 2),
    ]
    assert [r["requests"] for r in doc["results"]] == [1, 6, 6, 6, 6]
    assert all(r["output_tokens"] == 4 * r["requests"] for r in doc["results"])
    assert set(doc["ratios"]["float32"]) == {
        f"{forward}_{figure}"
        for forward in ("compact", "hf")
        for figure in ("throughput_1_vs_baseline", "throughput_2_vs_baseline", "ttft_p50_2_vs_1")
    } | {f"compact_vs_hf_{figure}_{c}" for figure in ("throughput", "decode") for c in (1, 2)}
    assert "hf-generate" in capsys.readouterr().out


def test_quantized_compact_forward_runs_and_is_recorded(tiny_model_dir, tmp_path, monkeypatch):
    """--quantize reaches the compact forward's EngineConfig (not the hf forward's) and the
    document records it."""
    seen = []
    real = bench.EngineConfig
    monkeypatch.setattr(bench, "EngineConfig", lambda **kw: seen.append(kw) or real(**kw))
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "engine.json"
    args = parser.parse_args(
        ["--model", str(tiny_model_dir), "--dtype", "float32", "--concurrency", "1"]
        + ["--output-tokens", "4", "--baseline-requests", "1", "--rounds", "1"]
        + ["--quantize", "int8", "--out", str(out)]
    )
    assert bench.main(args) == 0
    assert {(kw["forward"], kw["quantize"]) for kw in seen} == {("compact", "int8"), ("hf", "none")}
    doc = json.loads(out.read_text())
    assert doc["config"]["quantize"] == "int8"
    assert all(r["output_tokens"] == 4 * r["requests"] for r in doc["results"])


@pytest.mark.parametrize("option", ["--baseline-requests", "--rounds", "--output-tokens"])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_counts_below_one_are_refused_with_the_option_named(option, value, capsys):
    """0 baseline requests once crashed printing the table (no baseline figures); now the
    command line refuses it, naming the option."""
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([option, value])
    assert f"argument {option}" in capsys.readouterr().err


def test_on_own_thread_returns_and_raises_on_the_caller():
    """The baseline's runner: a value comes back, an exception is raised here, and the work ran
    on another thread."""
    import threading

    assert bench.on_own_thread(lambda a, b: (a + b, threading.current_thread().name), 2, 3) == (
        5,
        "engine-bench-baseline",
    )
    with pytest.raises(KeyError, match="gone"):
        bench.on_own_thread(lambda: {}["gone"])
