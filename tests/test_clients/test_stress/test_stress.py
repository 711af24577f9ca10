"""`tokenstream stress`: the report's arithmetic, and real runs against tritonserver."""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import subprocess
import sys
from pathlib import Path

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


# ---- whose stubs are counted ------------------------------------------------------------------

STUB = "/opt/tritonserver/backends/python/triton_python_backend_stub"


def fake_process(proc, pid, parent, argv, sockets=()):
    """A /proc/<pid> entry: cmdline, stat (with its parent) and fd links to socket inodes."""
    entry = proc / str(pid)
    (entry / "fd").mkdir(parents=True)
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "stat").write_text(f"{pid} ({Path(argv[0]).name[:15]}) S {parent} 1 1 0\n")
    for fd, inode in enumerate(sockets, start=3):
        (entry / "fd" / str(fd)).symlink_to(f"socket:[{inode}]")


def fake_listener(address: str, port: int, inode: int) -> str:
    """A /proc/net/tcp row of a listening socket (address as 32-bit words in host byte order)."""
    word = int.from_bytes(ipaddress.ip_address(address).packed, "big")
    hex_address = f"{int.from_bytes(word.to_bytes(4, 'big'), sys.byteorder):08X}"
    return (
        f"   0: {hex_address}:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 "
        f"00000000     0        0 {inode} 1 0000000000000000 100 0 0 10 0\n"
    )


def test_only_the_target_servers_stubs_are_counted(tmp_path):
    """Two tritonservers serve dialogue_model on this machine (another user's on 127.0.0.2, ours
    on 127.0.0.1, both port 8000): only the stubs whose parent listens at the target address
    count, not every stub whose command line names the model."""
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt\n"
    (proc / "net" / "tcp").write_text(
        header + fake_listener("127.0.0.1", 8000, 1111) + fake_listener("127.0.0.2", 8000, 2222)
    )
    model = "/tmp/run/repository/dialogue_model/1/model.py"
    fake_process(proc, 100, 1, ["/opt/tritonserver/bin/tritonserver"], sockets=[1111])
    fake_process(proc, 200, 1, ["/opt/tritonserver/bin/tritonserver"], sockets=[2222])
    fake_process(proc, 101, 100, [STUB, model, "shm_a", "1048576"])
    fake_process(proc, 102, 100, [STUB, model, "shm_b", "1048576"])
    fake_process(proc, 103, 100, [STUB, "/tmp/run/repository/chat/1/model.py", "shm_c"])
    fake_process(proc, 201, 200, [STUB, model, "shm_d", "1048576"])
    assert server_stats.stub_pids(DIALOGUE_MODEL, "http://127.0.0.1:8000", proc) == [101, 102]
    assert server_stats.stub_pids(DIALOGUE_MODEL, "127.0.0.2:8000", proc) == [201]
    assert server_stats.stub_pids(DIALOGUE_MODEL, "http://127.0.0.1:9999", proc) == []


def test_an_fd_closed_during_the_scan_does_not_hide_the_server(tmp_path):
    """A server's fd that cannot be read (closed between listing and readlink, as a busy
    server's sockets are) is skipped alone: the server and its stubs are still found."""
    proc = tmp_path / "proc"
    (proc / "net").mkdir(parents=True)
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt\n"
    (proc / "net" / "tcp").write_text(header + fake_listener("127.0.0.1", 8000, 1111))
    model = "/tmp/run/repository/dialogue_model/1/model.py"
    fake_process(proc, 100, 1, ["/opt/tritonserver/bin/tritonserver"])
    (proc / "100" / "fd" / "3").write_text("")  # not a link: readlink fails, as for a closed fd
    (proc / "100" / "fd" / "4").symlink_to("socket:[1111]")
    fake_process(proc, 101, 100, [STUB, model, "shm_a", "1048576"])
    assert server_stats.stub_pids(DIALOGUE_MODEL, "http://127.0.0.1:8000", proc) == [101]


def _fake_stub(model_dir: Path) -> subprocess.Popen:
    """A process whose command line looks like a stub of the model in `model_dir`."""
    return subprocess.Popen(
        [STUB, "-c", "import time; time.sleep(60)", str(model_dir / "1" / "model.py")],
        executable=sys.executable,
    )


SERVER = """\
import socket, subprocess, sys, time
listener = socket.create_server(("127.0.0.1", 0))
stub = subprocess.Popen({argv!r}, executable=sys.executable)
print(listener.getsockname()[1], stub.pid, flush=True)
try:
    sys.stdin.read()
finally:
    stub.kill()
"""


def test_stubs_of_another_server_on_this_machine_are_not_counted(tmp_path):
    """Real processes: this test listens as the target server with two stubs of dialogue_model;
    another server process with a stub of the same model runs beside it. Its stub is left out."""
    model_dir = tmp_path / DIALOGUE_MODEL
    ours = [_fake_stub(model_dir), _fake_stub(model_dir)]
    argv = [STUB, "-c", "import time; time.sleep(60)", str(model_dir / "1" / "model.py")]
    other = subprocess.Popen(
        [sys.executable, "-c", SERVER.format(argv=argv)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            other_port, other_stub = map(int, other.stdout.readline().split())
            url = f"http://127.0.0.1:{port}"
            assert server_stats.stub_pids(DIALOGUE_MODEL, url) == sorted(p.pid for p in ours)
            assert server_stats.stub_pids(DIALOGUE_MODEL, f"127.0.0.1:{other_port}") == [other_stub]
    finally:
        other.stdin.close()
        other.wait(timeout=10)
        for stub in ours:
            stub.kill()
            stub.wait()


def test_http_urls_given_as_host_and_port_get_a_scheme():
    """--http-url and --metrics-url as --url takes its address (host:port) work as URLs: they
    used to end the run in urllib's "unknown url type" traceback."""
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--http-url", "127.0.0.1:8000/", "--metrics-url", "localhost:8002/metrics"]
    )
    cfg = cli.config_from_args(args)
    assert cfg.http_url == "http://127.0.0.1:8000"
    assert cfg.metrics_url == "http://localhost:8002/metrics"
    args = parser.parse_args(["--http-url", "https://triton.example:443"])
    assert cli.config_from_args(args).http_url == "https://triton.example:443"
