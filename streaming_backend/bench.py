"""Engine benchmark: our continuous batching vs Hugging Face `generate`, in one process and run.

    python -m streaming_backend.bench --concurrency 1,4,16 --output-tokens 64 --dtype bf16,fp32

For each dtype it runs the baseline (`model.generate` + `TextIteratorStreamer`, one request at a
time) and then our engine at each concurrency, every stream producing exactly --output-tokens
tokens (ignore_eos). It prints a table and writes every figure to a JSON file.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.loading import LoadedModel, load_model
from streaming_backend.prompts import encode_prompt, load_chat_prompts
from streaming_backend.settings import SamplingSettings


@dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    model: str | None
    dtypes: tuple[str, ...]
    concurrency: tuple[int, ...]
    output_tokens: int
    baseline_requests: int
    rounds: int
    temperature: float
    top_p: float
    out: Path


@dataclass(frozen=True)
class StreamTimes:
    """One request: submit time and the time each of its tokens existed (monotonic ns)."""

    submitted_ns: int
    token_ns: tuple[int, ...]


@dataclass(frozen=True)
class LevelResult:
    """Figures for one (system, dtype, concurrency) cell."""

    system: str
    dtype: str
    concurrency: int
    requests: int
    output_tokens: int
    tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]


def percentiles(values: list[float]) -> dict[str, float]:
    """avg and p50/p90/p99 (nearest rank) of a list of milliseconds."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]

    return {"avg": statistics.fmean(ordered), "p50": rank(50), "p90": rank(90), "p99": rank(99)}


def summarize(system: str, dtype: str, concurrency: int, streams: list[StreamTimes]):
    """Aggregate tokens/s, TTFT and inter-token latency of a set of streams."""
    start = min(s.submitted_ns for s in streams)
    end = max(s.token_ns[-1] for s in streams)
    tokens = sum(len(s.token_ns) for s in streams)
    ttft = [(s.token_ns[0] - s.submitted_ns) / 1e6 for s in streams]
    itl = [(b - a) / 1e6 for s in streams for a, b in zip(s.token_ns, s.token_ns[1:])]
    return LevelResult(
        system,
        dtype,
        concurrency,
        len(streams),
        tokens,
        tokens / ((end - start) / 1e9),
        percentiles(ttft),
        percentiles(itl),
    )


def load_prompts() -> list[list[dict[str, str]]]:
    """The chat prompts shipped in the package."""
    return load_chat_prompts()


def run_baseline(loaded: LoadedModel, prompts: list[list[int]], cfg: BenchConfig):
    """HF generate + TextIteratorStreamer, one request at a time; token times from put()."""
    from transformers import TextIteratorStreamer

    class TimedStreamer(TextIteratorStreamer):
        """Records when each generated token reaches the streamer."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.times: list[int] = []
            self.seen_prompt = False

        def put(self, value):
            if self.seen_prompt:  # the first put() is the prompt itself
                self.times.append(time.monotonic_ns())
            self.seen_prompt = True
            super().put(value)

    warm = torch.tensor([prompts[0]], device=loaded.device)
    loaded.model.generate(
        warm,
        attention_mask=torch.ones_like(warm),
        max_new_tokens=4,
        pad_token_id=loaded.tokenizer.pad_token_id,
    )
    streams = []
    for i in range(cfg.baseline_requests):
        ids = torch.tensor([prompts[i % len(prompts)]], device=loaded.device)
        streamer = TimedStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
        kwargs = dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            streamer=streamer,
            max_new_tokens=cfg.output_tokens,
            min_new_tokens=cfg.output_tokens,
            do_sample=cfg.temperature > 0,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
        if cfg.temperature > 0:
            kwargs |= {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
        submitted = time.monotonic_ns()
        worker = threading.Thread(target=loaded.model.generate, kwargs=kwargs)
        worker.start()
        text = "".join(streamer)  # consume as a client would
        worker.join()
        assert text is not None
        streams.append(StreamTimes(submitted, tuple(streamer.times)))
    return summarize("hf-generate", str(loaded.dtype).removeprefix("torch."), 1, streams)


def run_engine(loaded: LoadedModel, prompts: list[list[int]], concurrency: int, cfg: BenchConfig):
    """Our engine: `concurrency` streams submitted together, `rounds` times."""
    settings = SamplingSettings(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.output_tokens, ignore_eos=True
    )
    streams = []
    with Engine(loaded, EngineConfig(max_streams=max(concurrency, 1))) as engine:
        list(engine.submit(prompts[0], replace(settings, max_tokens=4)))  # warm-up
        # At least 6 requests per level, so single-stream percentiles rest on a few samples.
        for _ in range(max(cfg.rounds, math.ceil(6 / concurrency))):
            handles = [
                engine.submit(prompts[i % len(prompts)], settings) for i in range(concurrency)
            ]
            for handle in handles:
                events = [e for e in handle if e.token_ids]
                streams.append(
                    StreamTimes(events[0].submitted_ns, tuple(e.emitted_ns for e in events))
                )
    return summarize("engine", str(loaded.dtype).removeprefix("torch."), concurrency, streams)


def run(cfg: BenchConfig) -> list[LevelResult]:
    """Every dtype: the baseline, then the engine at each concurrency."""
    results = []
    for dtype in cfg.dtypes:
        loaded = load_model(cfg.model, dtype)
        prompts = [encode_prompt(loaded.tokenizer, messages=m) for m in load_prompts()]
        print(
            f"[{dtype}] prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens",
            flush=True,
        )
        results.append(run_baseline(loaded, prompts, cfg))
        print_row(results[-1])
        for concurrency in cfg.concurrency:
            results.append(run_engine(loaded, prompts, concurrency, cfg))
            print_row(results[-1])
        del loaded
    return results


HEADER = (
    f"{'system':<12} {'dtype':<9} {'conc':>4} {'reqs':>4} {'tok/s':>8} "
    f"{'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} {'p90':>7} {'p99':>7}  (ms)"
)


def print_row(r: LevelResult) -> None:
    """One line of the table."""
    print(
        f"{r.system:<12} {r.dtype:<9} {r.concurrency:>4} {r.requests:>4} "
        f"{r.tokens_per_s:>8.1f} {r.ttft_ms['p50']:>9.0f} {r.ttft_ms['p90']:>7.0f} "
        f"{r.ttft_ms['p99']:>7.0f} {r.itl_ms['p50']:>8.1f} {r.itl_ms['p90']:>7.1f} "
        f"{r.itl_ms['p99']:>7.1f}",
        flush=True,
    )


def ratios(results: list[LevelResult]) -> dict[str, dict[str, float]]:
    """The issue's targets per dtype: throughput vs baseline, TTFT growth with concurrency."""
    out = {}
    for dtype in {r.dtype for r in results}:
        rows = {(r.system, r.concurrency): r for r in results if r.dtype == dtype}
        base = rows[("hf-generate", 1)]
        cells = {}
        top = max(c for s, c in rows if s == "engine")
        if ("engine", top) in rows:
            cells[f"throughput_{top}_vs_baseline"] = (
                rows[("engine", top)].tokens_per_s / base.tokens_per_s
            )
        if ("engine", 1) in rows:
            cells["throughput_1_vs_baseline"] = rows[("engine", 1)].tokens_per_s / base.tokens_per_s
            cells[f"ttft_p50_{top}_vs_1"] = (
                rows[("engine", top)].ttft_ms["p50"] / rows[("engine", 1)].ttft_ms["p50"]
            )
        out[dtype] = cells
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the engine benchmark."""
    parser.add_argument("--model", default=None, help="model dir/GGUF/hub id (default SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16,float32", help="comma-separated dtypes")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--baseline-requests", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="batches per concurrency level")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/engine.json"))


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table and the ratios, write the JSON."""
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = BenchConfig(
        model=args.model,
        dtypes=tuple(d.strip() for d in args.dtype.split(",") if d.strip()),
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        output_tokens=args.output_tokens,
        baseline_requests=args.baseline_requests,
        rounds=args.rounds,
        temperature=args.temperature,
        top_p=args.top_p,
        out=args.out,
    )
    print(f"torch threads: {torch.get_num_threads()}\n{HEADER}", flush=True)
    results = run(cfg)
    summary = ratios(results)
    for dtype, cells in summary.items():
        print(dtype, " ".join(f"{k}={v:.2f}" for k, v in cells.items()))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "results": [asdict(r) for r in results],
        "ratios": summary,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    cfg.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
