"""`tokenstream bench`: TTFT, inter-token latency and throughput over grpc, sse, ws and openai.

Definitions follow genai-perf / AIPerf (see clients/library/metrics.py); each TTFT is split into
queue, prefill and network parts from the server's per-response timestamps. With --multi-turn the
load is conversations whose history grows, and TTFT is reported per turn index.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import json
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from clients.bench.prompts import DEFAULT_PROMPTS, Sampling, load_prompts, synthetic_prompts
from clients.bench.report import (
    RunResult,
    build_report,
    format_compare,
    format_overview,
    format_run,
    load_report,
)
from clients.bench.runner import Level, Workload, multi_turn_problem, run_level, warm_up
from clients.bench.summary import ClockMap
from clients.bench.transports import TRANSPORTS, Prompt, make_transport
from clients.library.targets import DNS_SCHEME, TARGET_HELP, parse_target, target_option
from streaming_backend.configuration import endpoints
from streaming_backend.wire import CHAT_MODEL

SYNTHETIC_FALLBACK_TOKENS = 128


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run needs."""

    transports: tuple[str, ...] = ("grpc",)
    triton: str = endpoints.GRPC_TARGET  # gRPC host:port
    url: str = endpoints.HTTP_URL  # HTTP base URL, for sse
    bridge: str = endpoints.BRIDGE_WS_URL  # websocket URL of the bridge, for ws
    openai: str = endpoints.BRIDGE_URL  # base URL of the bridge's OpenAI API (/v1), for openai
    bridge_token: str | None = None
    model: str = CHAT_MODEL
    concurrency: tuple[int, ...] = (1,)
    request_rate: tuple[float, ...] = ()  # when set, replaces the concurrency levels
    request_distribution: str = "constant"
    requests: int | None = 50
    multi_turn: int | None = None  # turns per conversation; None: single requests
    conversations: int | None = 8  # per level with multi_turn (None with a duration)
    duration_s: float | None = None
    warmup: int = 2
    request_timeout_s: float = 300.0
    prompts: Path | None = None
    synthetic_input_tokens: int | None = None
    output_tokens: int | None = None
    max_tokens: int = 128
    extra_params: Mapping[str, Any] = field(default_factory=dict)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    clock: str = "auto"  # auto, same or different
    out: Path | None = Path("bench-results")
    plot: bool = True
    progress: bool = True

    def levels(self) -> list[Level]:
        """Load levels in the order they run."""
        if self.request_rate:
            return [Level(request_rate=r) for r in self.request_rate]
        return [Level(concurrency=c) for c in self.concurrency]

    def endpoint(self, transport: str) -> str:
        """The address a transport talks to."""
        return {"grpc": self.triton, "sse": self.url, "ws": self.bridge, "openai": self.openai}[
            transport
        ]


# --- command line -----------------------------------------------------------------------------


def _csv(kind):
    """argparse type: comma-separated values of `kind`."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        if not values or any(v <= 0 for v in values if not isinstance(v, str)):
            raise argparse.ArgumentTypeError(f"expected positive values, got {text!r}")
        return values

    return parse


def _json_object(text: str) -> dict:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _positive(text: str) -> int:
    """argparse type: an integer above zero."""
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _transports(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in TRANSPORTS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"transports are {', '.join(TRANSPORTS)}; got {text!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `tokenstream bench`."""
    d = BenchConfig()
    g = p.add_argument_group("target")
    g.add_argument(
        "--transport",
        type=_transports,
        default=d.transports,
        help="grpc, sse, ws, openai, or several: grpc,sse,ws,openai (default grpc)",
    )
    g.add_argument(
        "--triton", default=d.triton, type=target_option, help=f"{TARGET_HELP} (default {d.triton})"
    )
    g.add_argument("--url", default=d.url, help=f"HTTP base URL for sse (default {d.url})")
    g.add_argument("--bridge", default=d.bridge, help=f"bridge websocket URL (default {d.bridge})")
    g.add_argument(
        "--openai", default=d.openai, help=f"base URL of the OpenAI API (default {d.openai})"
    )
    g.add_argument(
        "--bridge-token", help="bearer token of the bridge (ws, openai), when it asks for one"
    )
    g.add_argument("--model", default=d.model, help="model name (default chat)")
    g = p.add_argument_group("load")
    g.add_argument(
        "--concurrency",
        type=_csv(int),
        default=d.concurrency,
        help="requests in flight, one level or several: 1,4,16 (default 1)",
    )
    g.add_argument(
        "--request-rate",
        type=_csv(float),
        default=(),
        help="open loop instead: requests per second, e.g. 2,4,8",
    )
    g.add_argument("--request-distribution", choices=("constant", "poisson"), default="constant")
    g.add_argument("--requests", type=int, default=d.requests, help="requests per level (50)")
    g.add_argument("--duration", type=float, help="seconds per level instead of --requests")
    g.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured requests first (2)")
    g.add_argument(
        "--multi-turn",
        type=_positive,
        metavar="TURNS",
        help="conversations of TURNS turns (10 typical) instead of single requests: each turn "
        "sends the history, the model's own answers included; TTFT per turn",
    )
    g.add_argument(
        "--conversations",
        type=_positive,
        default=d.conversations,
        help="conversations per level with --multi-turn (8); concurrency = conversations at once",
    )
    g.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    g = p.add_argument_group("workload")
    g.add_argument("--prompts", type=Path, help=f"JSONL of chats (default {DEFAULT_PROMPTS})")
    g.add_argument("--synthetic-input-tokens", type=int, help="plain prompts of about N tokens")
    g.add_argument(
        "--output-tokens",
        type=int,
        help="fixed output length (ignore_eos, min_tokens = max_tokens = N)",
    )
    g.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="cap of a free-length output (128)"
    )
    g.add_argument(
        "--extra-params",
        type=_json_object,
        default={},
        metavar="JSON",
        help="keys added to every request's sampling parameters (the OpenAI body), e.g. "
        '\'{"logit_bias": {"2": -100.0}}\' to ban EOS on a server without ignore_eos',
    )
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int, default=d.seed, help="prompts, arrivals, request seeds")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=d.out, help="folder for bench.json and bench.png")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument(
        "--clock",
        choices=("auto", "same", "different"),
        default="auto",
        help="do client and server share CLOCK_MONOTONIC (auto: loopback/hostname)",
    )
    g.add_argument(
        "--from-genai-perf",
        type=Path,
        metavar="profile_export.json",
        help="summarise a genai-perf run's raw export with our definitions, and exit",
    )
    g.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("A.json", "B.json"),
        help="print two earlier runs side by side with ratios, and exit",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from parsed options."""
    return BenchConfig(
        transports=args.transport, triton=args.triton, url=args.url, bridge=args.bridge,
        openai=args.openai, bridge_token=args.bridge_token, model=args.model,
        concurrency=args.concurrency,
        request_rate=args.request_rate, request_distribution=args.request_distribution,
        requests=None if args.duration else args.requests, multi_turn=args.multi_turn,
        conversations=None if args.duration else args.conversations, duration_s=args.duration,
        warmup=args.warmup, request_timeout_s=args.request_timeout, prompts=args.prompts,
        synthetic_input_tokens=args.synthetic_input_tokens, output_tokens=args.output_tokens,
        max_tokens=args.max_tokens, extra_params=args.extra_params,
        temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, clock=args.clock, out=args.out,
        plot=not args.no_plot, progress=not args.no_progress,
    )  # fmt: skip


# --- running ----------------------------------------------------------------------------------


def endpoint_hosts(endpoint: str) -> list[str]:
    """Host names of 'host:port', of a URL, or of a multi-replica gRPC target."""
    if "://" in endpoint and not endpoint.startswith(DNS_SCHEME):
        return [urlsplit(endpoint).hostname or ""]
    return parse_target(endpoint).hosts()


def is_local_host(host: str) -> bool:
    """Whether `host` is this machine: loopback, our hostname, or one of our addresses."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        ours = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return all(ipaddress.ip_address(a).is_loopback or a in ours for a in theirs)


def clock_map(cfg: BenchConfig, endpoint: str) -> ClockMap:
    """How server stamps relate to ours for this endpoint."""
    local = all(is_local_host(host) for host in endpoint_hosts(endpoint))
    same = cfg.clock == "same" or (cfg.clock == "auto" and local)
    return ClockMap(
        same_clock=same, client_wall_minus_monotonic_ns=time.time_ns() - time.monotonic_ns()
    )


def workload_prompts(cfg: BenchConfig) -> list[Prompt]:
    """Synthetic prompts when asked, else the JSONL file (default: the shipped chats)."""
    if cfg.synthetic_input_tokens:
        return synthetic_prompts(cfg.synthetic_input_tokens, 64, cfg.seed)
    if cfg.prompts is not None:
        return load_prompts(cfg.prompts)
    if DEFAULT_PROMPTS.is_file():
        return load_prompts(DEFAULT_PROMPTS)
    print(
        f"bench: {DEFAULT_PROMPTS} not found; using synthetic prompts of about "
        f"{SYNTHETIC_FALLBACK_TOKENS} tokens (give --prompts or --synthetic-input-tokens)",
        file=sys.stderr,
    )
    return synthetic_prompts(SYNTHETIC_FALLBACK_TOKENS, 64, cfg.seed)


def workload(cfg: BenchConfig) -> Workload:
    """The Workload of a config."""
    sampling = Sampling(
        output_tokens=cfg.output_tokens, max_tokens=cfg.max_tokens, temperature=cfg.temperature,
        top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed, extra=cfg.extra_params,
    )  # fmt: skip
    return Workload(
        prompts=workload_prompts(cfg), sampling=sampling,
        requests=cfg.conversations if cfg.multi_turn else cfg.requests,
        duration_s=cfg.duration_s, request_timeout_s=cfg.request_timeout_s,
        distribution=cfg.request_distribution, seed=cfg.seed, turns=cfg.multi_turn,
    )  # fmt: skip


async def bench_transport(cfg: BenchConfig, name: str, wl: Workload) -> list[RunResult]:
    """Every level over one transport, after a warm-up."""
    endpoint = cfg.endpoint(name)
    transport = make_transport(
        name, triton=cfg.triton, url=cfg.url, bridge=cfg.bridge, model=cfg.model,
        token=cfg.bridge_token, openai=cfg.openai,
    )  # fmt: skip
    clock = clock_map(cfg, endpoint)
    runs = []
    try:
        await warm_up(transport, wl, cfg.warmup, max(lv.slots for lv in cfg.levels()))
        for level in cfg.levels():
            records = await run_level(transport, wl, level, cfg.progress)
            runs.append(
                RunResult(name, endpoint, level.concurrency, level.request_rate, clock, records)
            )
    finally:
        await transport.close()
    return runs


def config_json(cfg: BenchConfig) -> dict:
    """The config as JSON values, without the bridge token."""
    d = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    d["bridge_token"] = "***" if cfg.bridge_token else None
    return d


async def run_bench(cfg: BenchConfig) -> dict:
    """Run every transport and level; return the JSON report (nothing written or printed)."""
    wl = workload(cfg)
    runs: list[RunResult] = []
    for name in cfg.transports:
        runs += await bench_transport(cfg, name, wl)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    config = config_json(cfg) | {"client_host": socket.gethostname()}
    return build_report(config, runs, created)


def write_outputs(doc: dict, out: Path, plot: bool) -> list[Path]:
    """bench.json (and bench.png) under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json"]
    paths[0].write_text(json.dumps(doc, indent=1))
    if plot and doc["runs"]:
        from clients.bench.plot import plot_report

        paths.append(plot_report(doc, out / "bench.png"))
    return paths


def first_error(doc: dict) -> str | None:
    """The first error message of a report, if no request at all succeeded."""
    if any(run["summary"]["completed"] for run in doc["runs"]):
        return None
    errors = [r["error"] for run in doc["runs"] for r in run["requests"] if r["error"]]
    return errors[0] if errors else "no request completed"


def main(args: argparse.Namespace) -> int:
    """Run the benchmark (or --compare) from parsed options."""
    if args.compare:
        a, b = (load_report(p) for p in args.compare)
        print(format_compare(a, b, names=tuple(str(p) for p in args.compare)))
        return 0
    cfg = config_from_args(args)
    problem = multi_turn_problem(cfg.transports, cfg.levels()) if cfg.multi_turn else None
    if problem:
        print(f"bench: {problem}", file=sys.stderr)
        return 2
    if args.from_genai_perf:
        doc = import_genai_perf(args.from_genai_perf)
    else:
        try:
            doc = asyncio.run(run_bench(cfg))
        except ConnectionError as exc:
            print(f"bench: cannot reach the server: {exc}", file=sys.stderr)
            return 2
    report(doc, cfg)
    error = first_error(doc)
    if error:
        print(f"bench: every request failed; first error: {error}", file=sys.stderr)
        return 1
    return 0


def import_genai_perf(path: Path) -> dict:
    """A report document from a genai-perf profile_export.json."""
    from clients.bench.genai_perf import genai_perf_runs, missing_outputs

    runs = genai_perf_runs(path)
    for note in missing_outputs(runs):
        print(f"bench: {path}: {note}", file=sys.stderr)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return build_report({"source": str(path), "tool": "genai-perf"}, runs, created)


def report(doc: dict, cfg: BenchConfig) -> None:
    """Print the tables and write the files."""
    for run in doc["runs"]:
        print(format_run(run), end="\n\n")
    print(format_overview(doc))
    if cfg.out is not None:
        for path in write_outputs(doc, cfg.out, cfg.plot):
            print(f"wrote {path}")
