"""`tokenstream stress`: argparse -> StressConfig -> main(cfg)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from clients.stress import load, report, server_stats
from streaming_backend.configuration import endpoints
from streaming_backend.wire import CHAT_MODEL, DIALOGUE_MODEL


@dataclass(frozen=True)
class StressConfig:
    """One stress run."""

    model: str = DIALOGUE_MODEL  # dialogue_model (random ids) or chat (the shipped chat prompts)
    url: str = endpoints.GRPC_TARGET  # Triton's gRPC endpoint
    http_url: str = endpoints.HTTP_URL  # statistics
    metrics_url: str = endpoints.METRICS_URL
    requests: int = 1000
    concurrency: int = 100
    input_len: int = 32  # random ids per dialogue request
    output_len: int = 16  # new tokens per request
    seed: int = 0
    json_path: Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("requests, concurrency and lengths must be at least 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `tokenstream stress`."""
    d = StressConfig()
    parser.add_argument("--model", default=d.model, help=f"{DIALOGUE_MODEL} or {CHAT_MODEL}")
    parser.add_argument("--url", default=d.url, help="Triton gRPC host:port")
    parser.add_argument("--http-url", default=d.http_url, help="Triton HTTP (statistics)")
    parser.add_argument("--metrics-url", default=d.metrics_url, help="Triton metrics page")
    parser.add_argument("--requests", type=int, default=d.requests)
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--input-len", type=int, default=d.input_len, help="random ids (dialogue)")
    parser.add_argument("--output-len", type=int, default=d.output_len, help="new tokens")
    parser.add_argument("--seed", type=int, default=d.seed, help="request i uses seed + i")
    parser.add_argument("--json", type=Path, help="also write the report as JSON here")
    parser.add_argument("--no-progress", action="store_true")


def with_scheme(url: str) -> str:
    """An HTTP URL given as --url's host:port (127.0.0.1:8000) with http:// before it; a URL
    with a scheme as it is."""
    return url if "://" in url else f"http://{url}"


def config_from_args(args: argparse.Namespace) -> StressConfig:
    """The StressConfig of parsed options."""
    return StressConfig(
        model=args.model,
        url=args.url,
        http_url=with_scheme(args.http_url).rstrip("/"),
        metrics_url=with_scheme(args.metrics_url),
        requests=args.requests,
        concurrency=args.concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        json_path=args.json,
        progress=not args.no_progress,
    )


def sender(cfg: StressConfig) -> tuple[load.Sender, str]:
    """What request i sends, and the workload's description."""
    if cfg.model == CHAT_MODEL:
        from streaming_backend.prompts import load_chat_prompts

        prompts = load_chat_prompts()
        workload = f"{len(prompts)} chat prompts, at most {cfg.output_len} new tokens"
        return load.chat_sender(cfg.url, cfg.model, prompts, cfg.output_len), workload
    workload = f"{cfg.input_len} random ids -> {cfg.output_len} new tokens"
    return load.dialogue_sender(cfg.url, cfg.input_len, cfg.output_len, cfg.seed), workload


def stress(cfg: StressConfig) -> dict:
    """Run the load and return the report."""
    send, workload = sender(cfg)
    before = server_stats.model_stats(cfg.http_url, cfg.model)
    metrics_before = server_stats.scrape(cfg.metrics_url)
    with server_stats.ResourceSampler(cfg.model, cfg.http_url, cfg.metrics_url) as sampler:
        outcomes = load.run(send, cfg.requests, cfg.concurrency, cfg.progress)
    after = server_stats.model_stats(cfg.http_url, cfg.model)
    metrics_after = server_stats.scrape(cfg.metrics_url)
    target = {k: v for k, v in asdict(cfg).items() if k not in ("json_path", "progress")}
    return report.summarize(
        target | {"workload": workload},
        outcomes,
        server_stats.batching_delta(before, after),
        server_stats.metrics_queue_ms(metrics_before, metrics_after, cfg.model),
        sampler.resources,
    )


def main(args: argparse.Namespace | StressConfig) -> int:
    """Run `tokenstream stress`; exit status 1 if any request failed."""
    cfg = args if isinstance(args, StressConfig) else config_from_args(args)
    result = stress(cfg)
    print(report.format_table(result), flush=True)
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"report written to {cfg.json_path}")
    return 0 if result["requests"]["failed"] == 0 else 1
