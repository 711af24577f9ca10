"""Do running streams keep their pace while new prompts arrive? Inter-token gaps, per gap.

For each prefill setting (default: auto, then a fixed 64 tokens): start tritonserver with only the
chat model on free loopback ports, run N closed-loop streams for D seconds (each stream sends a
~T-token prompt, reads a fixed-length answer, sends the next; so new prompts arrive throughout),
and collect every gap between two consecutive responses of a stream (its first token excluded:
that is TTFT). Prints, per setting, the gaps' mean, p50, p99, max and p99/mean, and the tokens/s.

    PYTHONPATH=. .venv/bin/python scripts/measure_pacing.py --streams 16 --seconds 30 \\
        [--dtype float32] [--settings auto,64]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from clients.bench.prompts import synthetic_prompts
from clients.library.grpc_client import GenerateRequest, stream_generate
from streaming_backend.configuration.models import parameter_strings
from streaming_backend.launcher import ServerConfig, TritonServer, free_port
from streaming_backend.wire import CHAT_MODEL


def closed_loop(url: str, prompts: list[str], tokens: int, until: float, gaps: list, counts: list):
    """One stream: prompt after prompt until `until`; its gaps and token count appended."""
    sampling = {"max_tokens": tokens, "min_tokens": tokens, "ignore_eos": True, "temperature": 0}
    n = 0
    while time.monotonic() < until:
        prompt = prompts[n % len(prompts)]
        n += 1
        last = None
        for chunk in stream_generate(url, GenerateRequest(prompt=prompt, sampling=sampling)):
            if chunk.text or chunk.num_output_tokens:
                if last is not None:
                    gaps.append((chunk.received_ns - last) / 1e6)
                last = chunk.received_ns
                counts.append(chunk.num_output_tokens or 0)


def run(setting: str, args: argparse.Namespace) -> dict:
    """Start a server with this prefill setting, load it, stop it; the gap figures."""
    parameters = parameter_strings(
        model=args.model, dtype=args.dtype, prefill_chunk_tokens=setting, max_streams=args.streams
    )
    config = ServerConfig(
        model_parameters=parameters,
        models=(CHAT_MODEL,),
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    prompts = [p.text for p in synthetic_prompts(args.prompt_tokens, 64, seed=1)]
    with TritonServer(config, on_log=None) as server:
        list(stream_generate(server.grpc_url, GenerateRequest(prompt="warm up")))
        gaps: list[float] = []
        counts: list[int] = []
        until = time.monotonic() + args.seconds
        threads = [
            threading.Thread(
                target=closed_loop,
                args=(
                    server.grpc_url,
                    prompts[i :: args.streams],
                    args.tokens,
                    until,
                    gaps,
                    counts,
                ),
            )
            for i in range(args.streams)
        ]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - start
    gaps.sort()
    mean = statistics.fmean(gaps)
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    return {
        "setting": setting,
        "gaps": len(gaps),
        "mean_ms": mean,
        "p50_ms": gaps[len(gaps) // 2],
        "p99_ms": p99,
        "max_ms": gaps[-1],
        "p99_over_mean": p99 / mean,
        "tokens_per_s": sum(counts) / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model dir (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--settings", default="auto,64", help="prefill_chunk_tokens values")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens per request")
    args = parser.parse_args()
    rows = [run(setting, args) for setting in args.settings.split(",")]
    print(
        f"{'prefill':>8} {'gaps':>6} {'mean':>8} {'p50':>8} {'p99':>8} {'max':>8} "
        f"{'p99/mean':>9} {'tok/s':>7}"
    )
    for r in rows:
        print(
            f"{r['setting']:>8} {r['gaps']:>6} {r['mean_ms']:>8.1f} {r['p50_ms']:>8.1f} "
            f"{r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} {r['p99_over_mean']:>9.2f} "
            f"{r['tokens_per_s']:>7.1f}"
        )


if __name__ == "__main__":
    main()
