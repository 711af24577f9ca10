"""The dialogue_model in several configurations on the seed's stress workload, in one run.

--compare batching: Triton's dynamic batching (as shipped) vs none. --compare forward: the compact
forward (the default) vs Hugging Face's, both with dynamic batching. For each mode: start
tritonserver with only the dialogue_model (two instances) on free loopback ports, run `tokenstream
stress` (random ids of 32, 16 new tokens, 100 concurrent), stop it. Prints the modes side by side
and writes bench-results/dialogue/<mode>.json.

    PYTHONPATH=. .venv/bin/python scripts/measure_dialogue.py --compare forward --requests 300
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clients.stress import report
from clients.stress.cli import StressConfig, stress
from streaming_backend.configuration.models import parameter_strings
from streaming_backend.launcher import ServerConfig, TritonServer, free_port
from streaming_backend.launcher.batching import DialogueBatching
from streaming_backend.wire import DIALOGUE_MODEL

# mode name -> (batching, extra dialogue_model parameters)
COMPARISONS = {
    "batching": {
        "batching": (DialogueBatching(), {}),
        "no batching": (DialogueBatching(dynamic_batching=False), {}),
    },
    "forward": {
        "hf forward": (DialogueBatching(), {"forward": "hf"}),
        "compact forward": (DialogueBatching(), {"forward": "compact"}),
    },
}


def run_mode(name: str, mode: tuple, args: argparse.Namespace) -> dict:
    batching, extra = mode
    config = ServerConfig(
        model_parameters=parameter_strings(model=args.model, dtype=args.dtype, **extra),
        models=(DIALOGUE_MODEL,),
        dialogue=batching,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    print(f"== {name}: starting tritonserver", flush=True)
    with TritonServer(config, on_log=None) as server:
        cfg = StressConfig(
            url=server.grpc_url,
            http_url=server.http_url,
            metrics_url=server.metrics_url,
            requests=args.requests,
            concurrency=args.concurrency,
            input_len=32,
            output_len=16,
        )
        stress(StressConfig(**{**cfg.__dict__, "requests": 8, "progress": False}))  # warm up
        result = stress(cfg)
    print(report.format_table(result), flush=True)
    out = args.out / f"{name.replace(' ', '-')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def side_by_side(results: dict[str, dict]) -> str:
    rows = [
        ("requests ok", lambda r: f"{r['requests']['ok']}/{r['requests']['sent']}"),
        ("QPS", lambda r: f"{r['qps']:.2f}"),
        ("latency p50 ms", lambda r: f"{r['latency_ms']['p50']:.0f}"),
        ("latency p99 ms", lambda r: f"{r['latency_ms']['p99']:.0f}"),
        ("mean requests per execute", lambda r: f"{r['batching']['mean_batch_size']:.1f}"),
        ("mean queue ms", lambda r: f"{r['batching']['queue_ms']:.0f}"),
        ("mean execute ms", lambda r: f"{r['batching']['compute_ms_per_execution']:.0f}"),
        ("stub RSS MiB", lambda r: f"{(r['resources']['stub_rss_bytes'] or 0) / 2**20:.0f}"),
    ]
    names = list(results)
    lines = [f"{'':<28}" + "".join(f"{n:>14}" for n in names)]
    for label, cell in rows:
        lines.append(f"{label:<28}" + "".join(f"{cell(results[n]):>14}" for n in names))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model dir (default: the bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="batching")
    parser.add_argument("--out", type=Path, default=Path("bench-results/dialogue"))
    args = parser.parse_args()
    modes = COMPARISONS[args.compare]
    results = {name: run_mode(name, mode, args) for name, mode in modes.items()}
    print(side_by_side(results))


if __name__ == "__main__":
    main()
