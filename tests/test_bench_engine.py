"""The engine benchmark's arithmetic, and one tiny run end to end."""

import json

import pytest

from streaming_backend import bench


def test_percentiles_nearest_rank():
    """p50/p90/p99 by nearest rank, plus the mean."""
    values = [float(v) for v in range(1, 101)]
    assert bench.percentiles(values) == {"avg": 50.5, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert bench.percentiles([7.0]) == {"avg": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}


def test_summarize_two_streams():
    """Throughput over the whole span; TTFT from submit; ITL from consecutive tokens."""
    ms = 1_000_000
    streams = [
        bench.StreamTimes(0, (100 * ms, 150 * ms, 200 * ms)),
        bench.StreamTimes(0, (300 * ms, 400 * ms)),
    ]
    r = bench.summarize("engine", "float32", 2, streams)
    assert r.output_tokens == 5
    assert r.tokens_per_s == pytest.approx(5 / 0.4)
    assert r.ttft_ms["p50"] == 100 and r.ttft_ms["avg"] == 200
    assert r.itl_ms["avg"] == pytest.approx(200 / 3)


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
        ("engine", 1),
        ("engine", 2),
    ]
    assert [r["requests"] for r in doc["results"]] == [1, 6, 6]
    assert all(r["output_tokens"] == 4 * r["requests"] for r in doc["results"])
    assert set(doc["ratios"]["float32"]) == {
        "throughput_2_vs_baseline",
        "throughput_1_vs_baseline",
        "ttft_p50_2_vs_1",
    }
    assert "hf-generate" in capsys.readouterr().out
