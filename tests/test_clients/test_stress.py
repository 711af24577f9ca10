"""`tokenstream stress`: the report's arithmetic, and real runs against tritonserver."""

from __future__ import annotations

import json

import pytest

from clients.cli import main as cli_main
from clients.stress import cli, report, server_stats
from clients.stress.load import Outcome
from streaming_backend.wire import CHAT_MODEL, DIALOGUE_MODEL


def stats_snapshot(executions, inferences, queue_ns, batches):
    return {
        "execution_count": executions,
        "inference_count": inferences,
        "inference_stats": {"queue": {"count": inferences, "ns": queue_ns}},
        "batch_stats": [
            {"batch_size": size, "compute_infer": {"count": count, "ns": count * 10_000_000}}
            for size, count in batches.items()
        ],
    }


def test_batching_is_the_delta_between_two_snapshots():
    before = stats_snapshot(3, 10, 50_000_000, {1: 1, 8: 1, 1_0: 0})
    after = stats_snapshot(8, 50, 250_000_000, {1: 2, 8: 4, 16: 1})
    b = server_stats.batching_delta(before, after)
    assert (b.executions, b.inferences) == (5, 40)
    assert b.batch_sizes == {1: 1, 8: 3, 16: 1}
    assert b.mean_batch_size == 8.0
    assert b.queue_ms == pytest.approx(5.0)  # 200 ms of queueing over 40 requests
    assert b.compute_ms == pytest.approx(10.0)


def test_metrics_are_parsed_and_summed_by_label():
    text = (
        "# HELP nv_inference_count x\n"
        'nv_inference_count{model="dialogue_model",version="1"} 40\n'
        'nv_inference_count{model="chat",version="1"} 7\n'
        'nv_inference_queue_duration_us{model="dialogue_model",version="1"} 200000\n'
    )
    samples = [
        server_stats._SAMPLE.match(line) for line in text.splitlines() if not line.startswith("#")
    ]
    parsed = [
        (m.group(1), dict(server_stats._LABEL.findall(m.group(2))), float(m.group(3)))
        for m in samples
    ]
    assert server_stats.metric_sum(parsed, "nv_inference_count") == 47
    assert server_stats.metric_sum(parsed, "nv_inference_count", model=DIALOGUE_MODEL) == 40
    before = [(n, dict(labels), 0.0) for n, labels, _ in parsed]
    assert server_stats.metrics_queue_ms(before, parsed, DIALOGUE_MODEL) == pytest.approx(5.0)


def test_checks_set_each_figure_beside_its_reference_range():
    outcomes = [Outcome(0.0, 0.1)] * 98 + [Outcome(0.0, 0.6)] * 2 + [Outcome(0.5, 0.5, "boom")]
    resources = server_stats.Resources(host_memory_used=0.5)
    result = report.summarize(
        {"model": "m", "url": "u", "requests": 101, "concurrency": 10, "workload": "w"},
        outcomes,
        None,
        None,
        resources,
    )
    verdicts = {row["figure"]: row["verdict"] for row in result["checks"]}
    assert verdicts == {
        "success rate": "miss",
        "p99 latency": "miss",  # the two slowest of 100 took 600 ms
        "throughput": "pass",  # 100 ok in 1.0 s
        "accelerator utilisation (no GPU)": "n/a",
        "host memory": "pass",
    }
    assert result["requests"]["errors"] == {"boom": 1}
    assert "boom" in report.format_table(result)


@pytest.mark.server
def test_stress_the_dialogue_model(dialogue_server, tmp_path, capsys):
    """60 requests, 20 concurrent: all succeed; the report shows Triton's batches and queue, the
    two stub processes' memory, and the JSON holds the same."""
    out = tmp_path / "stress.json"
    status = cli_main(
        [
            "stress",
            f"--url={dialogue_server.grpc_url}",
            f"--http-url={dialogue_server.http_url}",
            f"--metrics-url={dialogue_server.metrics_url}",
            "--requests=60",
            "--concurrency=20",
            "--output-len=4",
            f"--json={out}",
            "--no-progress",
        ]
    )
    printed = capsys.readouterr().out
    assert status == 0
    result = json.loads(out.read_text())
    assert result["requests"] == {
        "sent": 60,
        "ok": 60,
        "failed": 0,
        "success_rate": 1.0,
        "errors": {},
    }
    b = result["batching"]
    assert b["inferences"] == 60
    assert sum(int(k) * v for k, v in b["batch_sizes"].items()) == 60
    assert b["mean_batch_size"] > 1  # 20 concurrent requests shared execute() calls
    assert b["queue_ms"] > 0 and b["queue_ms_metrics"] > 0
    assert len(result["resources"]["stub_pids"]) == 2  # the two instances
    assert result["resources"]["stub_rss_bytes"] > 50 * 2**20  # torch and a model in each
    assert [row["figure"] for row in result["checks"]][:3] == [
        "success rate",
        "p99 latency",
        "throughput",
    ]
    assert "batch sizes" in printed and "p99 latency" in printed


@pytest.mark.server
def test_stress_the_chat_model(triton_server):
    """The chat model takes the shipped chat prompts, one non-streamed answer each."""
    cfg = cli.StressConfig(
        model=CHAT_MODEL,
        url=triton_server.grpc_url,
        http_url=triton_server.http_url,
        metrics_url=triton_server.metrics_url,
        requests=8,
        concurrency=4,
        output_len=4,
        progress=False,
    )
    result = cli.stress(cfg)
    assert result["requests"]["ok"] == 8
    assert result["latency_ms"]["count"] == 8
    assert result["batching"]["inferences"] == 8
