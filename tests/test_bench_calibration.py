"""Calibration: the bench reports known, injected delays over every transport.

A real tritonserver runs the `chat` model (tiny random Llama) with the test-only settings
`test_first_token_delay_ms=300` (a sleep between prefill and the first token) and
`test_token_delay_ms=50` (a sleep in every decode step). Whatever the transport, the bench must see
TTFT >= 300 ms plus a small overhead and ITL >= 50 ms plus one tiny decode step.

Tolerances: the lower bounds are physical (a token cannot arrive before its delay has passed), with
1 ms of receive jitter allowed on ITL; the upper slack covers prefill and decode of the tiny model
and a loaded 2-core machine, and is checked on the median so that one stall does not fail the test.
"""

from __future__ import annotations

import statistics

import pytest

from clients.bench import BenchConfig, run_bench
from clients.bench.report import format_run, validate_report

pytestmark = pytest.mark.server

FIRST_MS, NEXT_MS = 300.0, 50.0
OUTPUT_TOKENS, INPUT_TOKENS, REQUESTS = 8, 16, 4
TTFT_SLACK_MS = 40.0  # median: prefill of a 16-token prompt + two loopback hops
NETWORK_SLACK_MS = 15.0  # median of each hop (client -> server, server -> client)
ITL_SLACK_MS = 10.0  # median: one decode step of the tiny model + sleep overshoot
JITTER_MS = 1.0


@pytest.fixture(scope="module")
def delayed_server(tiny_model_dir):
    """tritonserver with the tiny model and the calibration delays."""
    from streaming_backend.launcher import ServerConfig, TritonServer, free_port

    config = ServerConfig(
        model=str(tiny_model_dir),
        model_parameters={
            "test_first_token_delay_ms": str(int(FIRST_MS)),
            "test_token_delay_ms": str(int(NEXT_MS)),
        },
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    with TritonServer(config, on_log=None) as server:
        yield server


async def bench(server, transport: str, bridge_url: str = "") -> dict:
    """One bench run at concurrency 1 over `transport`; returns its run document."""
    cfg = BenchConfig(
        transports=(transport,),
        triton=server.grpc_url,
        url=server.http_url,
        bridge=bridge_url,
        concurrency=(1,),
        requests=REQUESTS,
        warmup=1,
        synthetic_input_tokens=INPUT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
        temperature=0.0,
        out=None,
        plot=False,
        progress=False,
    )
    doc = await run_bench(cfg)
    validate_report(doc)
    (run,) = doc["runs"]
    print(format_run(run))  # shown with -s: the calibration figures of this transport
    return run


async def run_transport(server, transport: str) -> dict:
    """Bench a transport; for ws, through a bridge started in this process."""
    if transport != "ws":
        return await bench(server, transport)
    from clients.bridge import Bridge, BridgeConfig

    async with Bridge(BridgeConfig(triton_url=server.grpc_url, port=0)) as bridge:
        return await bench(server, transport, f"ws://127.0.0.1:{bridge.port}/ws")


def per_request(run: dict, key: str) -> list[float]:
    return [r[key] for r in run["requests"]]


def breakdown(run: dict, part: str) -> list[float]:
    return [r["ttft_breakdown_ms"][part] for r in run["requests"]]


@pytest.mark.parametrize("transport", ["grpc", "sse", "ws"])
async def test_bench_reports_injected_delays(delayed_server, transport):
    """TTFT ~ 300 ms + overhead, ITL ~ 50 ms, the breakdown puts the delay in prefill."""
    run = await run_transport(delayed_server, transport)
    s = run["summary"]
    assert (s["completed"], s["errors"], s["cancelled"]) == (REQUESTS, 0, 0), run["requests"]
    assert run["same_clock"] is True
    assert per_request(run, "output_tokens") == [OUTPUT_TOKENS] * REQUESTS
    assert per_request(run, "input_tokens") == [INPUT_TOKENS] * REQUESTS

    ttft = per_request(run, "ttft_ms")
    assert min(ttft) >= FIRST_MS, ttft
    assert statistics.median(ttft) <= FIRST_MS + TTFT_SLACK_MS, ttft

    itl = per_request(run, "itl_ms")
    assert min(itl) >= NEXT_MS - JITTER_MS, itl
    assert statistics.median(itl) <= NEXT_MS + ITL_SLACK_MS, itl

    # The delay sits between prefill start and the first token, on the server's own clock.
    prefill = breakdown(run, "prefill")
    assert min(prefill) >= FIRST_MS and statistics.median(prefill) <= FIRST_MS + TTFT_SLACK_MS
    # Client and server stamps on one clock: both hops are positive and small.
    for hop in ("to_server", "to_client"):
        values = breakdown(run, hop)
        assert min(values) >= 0 and statistics.median(values) <= NETWORK_SLACK_MS, (hop, values)
    # The parts add up to the client's TTFT.
    for r in run["requests"]:
        assert sum(r["ttft_breakdown_ms"].values()) == pytest.approx(r["ttft_ms"], abs=1e-3)

    # ITL seen by the client matches the server's own token spacing (grpc and sse carry it).
    if transport != "ws":
        server_itl = s["server_itl_ms"]["p50"]
        assert server_itl >= NEXT_MS and abs(s["itl_ms"]["p50"] - server_itl) <= JITTER_MS
