"""Engine benchmark: our continuous batching vs Hugging Face `generate`, in one process and run.

    tokenstream engine-bench --concurrency 1,4,16 --output-tokens 64 --dtype bf16,fp32

For each dtype it runs the baseline (`model.generate` + `TextIteratorStreamer`, one request at a
time) and then our engine on each forward (`--forward compact,hf`: ours, and the Hugging Face
forward under our engine, labelled eng-compact and eng-hf, their rounds interleaved) at each
concurrency, every stream producing exactly --output-tokens tokens (ignore_eos). Each token
becomes a Chunk stamped when it existed, so TTFT, ITL, throughput and percentiles are those of
clients/library/metrics.py, as in `tokenstream bench`. It prints a table and writes every figure
to a JSON file. A client of the core: it runs the engine in this process.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import streaming_backend  # noqa: F401 - before torch: OpenMP's wait policy, as served

# isort: split
import torch

from clients.library import metrics
from clients.library.chunk import Chunk
from streaming_backend.configuration.models import QUANTIZE_KINDS
from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.events import TokenEvent
from streaming_backend.model.hardware import AUTO
from streaming_backend.model.loading import LoadedModel, load_model
from streaming_backend.prompts import encode_prompt, load_chat_prompts
from streaming_backend.sampling.settings import SamplingSettings


@dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    model: str | None
    dtypes: tuple[str, ...]
    forwards: tuple[str, ...]
    concurrency: tuple[int, ...]
    output_tokens: int
    baseline_requests: int
    rounds: int
    temperature: float
    top_p: float
    out: Path
    quantize: str = "auto"  # the compact forward's weights (the hf forward has no quantized path)


@dataclass(frozen=True)
class Timeline:
    """One request: when it was submitted and its tokens as Chunks stamped when they existed."""

    sent_ns: int
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class LevelResult:
    """Figures for one (system, dtype, concurrency) cell; latency stats in ms."""

    system: str
    dtype: str
    concurrency: int
    requests: int
    output_tokens: int
    tokens_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]


def token_chunk(event: TokenEvent) -> Chunk:
    """An engine event as the Chunk a client would have received at its emitted time."""
    reason = None if event.finish_reason is None else event.finish_reason.value
    return Chunk(
        text=event.text,
        num_output_tokens=len(event.token_ids),
        num_input_tokens=event.num_input_tokens,
        output_ids=event.token_ids,
        finish_reason=reason,
        final=event.final,
        request_id=event.request_id,
        received_ns=event.emitted_ns,
    )


def summarize(
    system: str,
    dtype: str,
    concurrency: int,
    timelines: list[Timeline],
    busy_ns: int | None = None,
):
    """Aggregate tokens/s, TTFT and inter-token latency (clients/library/metrics.py) of requests.

    Throughput is over `busy_ns` when given (the system's own rounds, when other systems' rounds
    ran between them), else over the span from the first request sent to the last token.
    """
    if busy_ns is None:
        busy_ns = span_ns(timelines)
    tokens = sum(metrics.output_tokens(t.chunks) for t in timelines)
    ttft = (metrics.ttft_ns(t.sent_ns, t.chunks) for t in timelines)
    itl = (metrics.itl_ns(t.sent_ns, t.chunks) for t in timelines)
    return LevelResult(
        system,
        dtype,
        concurrency,
        len(timelines),
        tokens,
        metrics.throughput(tokens, busy_ns),
        metrics.stats(ttft, metrics.NS_PER_MS).as_dict(),
        metrics.stats(itl, metrics.NS_PER_MS).as_dict(),
    )


def span_ns(timelines: list[Timeline]) -> int:
    """The span of clients/library/metrics.py over these requests (0 when none got a response)."""
    return metrics.span_ns((t.sent_ns, t.chunks) for t in timelines) or 0


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
        chunks = tuple(Chunk.delta("", 1, t) for t in streamer.times)
        streams.append(Timeline(submitted, chunks))
    return summarize("hf-generate", str(loaded.dtype).removeprefix("torch."), 1, streams)


def run_engines(
    loaded: LoadedModel, prompts: list[list[int]], concurrency: int, cfg: BenchConfig
) -> list[LevelResult]:
    """Our engine on each of cfg.forwards at one concurrency: `concurrency` streams submitted
    together, `rounds` times, the forwards' rounds interleaved (A, B, A, B, ...).

    Interleaving puts the machine's drift over minutes on every forward alike: run one after
    the other, the same forward measured 9.9 and 14.6 tok/s minutes apart on a shared machine. The
    engines share the loaded weights and only one runs at a time. The prefix cache is off:
    the rounds resend the same prompts, which would measure reuse.
    """
    settings = SamplingSettings(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.output_tokens, ignore_eos=True
    )
    timelines: dict[str, list[Timeline]] = {forward: [] for forward in cfg.forwards}
    busy_ns = dict.fromkeys(cfg.forwards, 0)  # the sum of each forward's rounds' spans
    with ExitStack() as stack:
        engines = {}
        for forward in cfg.forwards:
            quantize = cfg.quantize if forward == "compact" else "none"
            config = EngineConfig(
                max_streams=max(concurrency, 1), forward=forward, prefix_cache="off",
                quantize=quantize,
            )  # fmt: skip
            engines[forward] = stack.enter_context(Engine(loaded, config))
            list(engines[forward].submit(prompts[0], replace(settings, max_tokens=4)))  # warm-up
        # At least 6 requests per level, so single-stream percentiles rest on a few samples.
        for _ in range(max(cfg.rounds, math.ceil(6 / concurrency))):
            for forward, engine in engines.items():
                round_timelines = run_round(engine, prompts, concurrency, settings)
                timelines[forward].extend(round_timelines)
                busy_ns[forward] += span_ns(round_timelines)
    dtype = str(loaded.dtype).removeprefix("torch.")
    return [
        summarize(f"{ENGINE}-{f}", dtype, concurrency, timelines[f], busy_ns[f])
        for f in cfg.forwards
    ]


def run_round(
    engine: Engine, prompts: list[list[int]], concurrency: int, settings: SamplingSettings
) -> list[Timeline]:
    """`concurrency` streams submitted together, read to their end."""
    handles = [engine.submit(prompts[i % len(prompts)], settings) for i in range(concurrency)]
    timelines = []
    for handle in handles:
        events = [e for e in handle if e.token_ids]
        timelines.append(Timeline(events[0].submitted_ns, tuple(token_chunk(e) for e in events)))
    return timelines


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
        results.append(on_own_thread(run_baseline, loaded, prompts, cfg))
        print_row(results[-1])
        for concurrency in cfg.concurrency:
            for result in run_engines(loaded, prompts, concurrency, cfg):
                results.append(result)
                print_row(result)
        del loaded
    return results


def on_own_thread(fn, *args):
    """fn(*args) on a thread of its own, joined; its result, or its exception raised here.

    torch's CPU threads form one team per calling thread, and a team left on this thread slowed
    the engine's thread 1.7x (docs/design.md): the baseline's team ends with its thread,
    before the engines run."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as exc:  # re-raised on the caller's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=target, name="engine-bench-baseline")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


HEADER = (
    f"{'system':<12} {'dtype':<9} {'conc':>4} {'reqs':>4} {'tok/s':>8} "
    f"{'TTFT p50':>9} {'p90':>7} {'p99':>7} {'ITL p50':>8} {'p90':>7} {'p99':>7}  (ms)"
)


def print_row(r: LevelResult) -> None:
    """One line of the table."""
    ttft = "".join(_cell(r.ttft_ms[p], w, 0) for p, w in (("p50", 10), ("p90", 8), ("p99", 8)))
    itl = "".join(_cell(r.itl_ms[p], w, 1) for p, w in (("p50", 9), ("p90", 8), ("p99", 8)))
    head = f"{r.system:<12} {r.dtype:<9} {r.concurrency:>4} {r.requests:>4} "
    print(f"{head}{r.tokens_per_s:>8.1f}{ttft}{itl}", flush=True)


def _cell(value: float | None, width: int, digits: int) -> str:
    """A right-aligned table cell; '-' for a figure with no values (e.g. ITL of 1 token)."""
    return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"


ENGINE = "eng"  # system label prefix of our engine's rows: eng-compact, eng-hf


def ratios(results: list[LevelResult]) -> dict[str, dict[str, float]]:
    """Per dtype: each forward's throughput vs the baseline, TTFT growth with concurrency, and
    the compact forward against the Hugging Face forward at each concurrency: throughput
    (prefill included) and decode speed (the inverse of the mean inter-token latency)."""
    out = {}
    for dtype in {r.dtype for r in results}:
        rows = {(r.system, r.concurrency): r for r in results if r.dtype == dtype}
        base = rows[("hf-generate", 1)]
        cells = {}
        for system in sorted({s for s, _ in rows if s.startswith(ENGINE)}):
            name = system.removeprefix(f"{ENGINE}-")
            levels = sorted(c for s, c in rows if s == system)
            top = levels[-1]
            for c in {1, top} & set(levels):
                cells[f"{name}_throughput_{c}_vs_baseline"] = (
                    rows[(system, c)].tokens_per_s / base.tokens_per_s
                )
            if 1 in levels:
                cells[f"{name}_ttft_p50_{top}_vs_1"] = (
                    rows[(system, top)].ttft_ms["p50"] / rows[(system, 1)].ttft_ms["p50"]
                )
        for (system, c), row in sorted(rows.items()):
            hf = rows.get((f"{ENGINE}-hf", c))
            if system == f"{ENGINE}-compact" and hf is not None:
                cells[f"compact_vs_hf_throughput_{c}"] = row.tokens_per_s / hf.tokens_per_s
                if row.itl_ms["avg"] and hf.itl_ms["avg"]:
                    cells[f"compact_vs_hf_decode_{c}"] = hf.itl_ms["avg"] / row.itl_ms["avg"]
        out[dtype] = cells
    return out


def at_least_one(text: str) -> int:
    """An argparse type: an integer of 1 or more (the ratios need a baseline and a round)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the engine benchmark."""
    parser.add_argument("--model", default=None, help="model dir/GGUF/hub id (default SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16,float32", help="comma-separated dtypes")
    parser.add_argument(
        "--forward", default="compact,hf", help="our engine's forwards to run (compact, hf)"
    )
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated stream counts")
    parser.add_argument("--output-tokens", type=at_least_one, default=64)
    parser.add_argument(
        "--baseline-requests",
        type=at_least_one,
        default=6,
        help="Hugging Face generate requests, one at a time (every ratio is against them)",
    )
    parser.add_argument(
        "--rounds", type=at_least_one, default=2, help="batches per concurrency level"
    )
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument(
        "--quantize",
        choices=(AUTO, *QUANTIZE_KINDS),
        default=AUTO,
        help="the compact forward's linear weights (auto as the engine, none, int8, int4)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/engine.json"))


def main(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table and the ratios, write the JSON."""
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = BenchConfig(
        model=args.model,
        dtypes=tuple(d.strip() for d in args.dtype.split(",") if d.strip()),
        forwards=tuple(f.strip() for f in args.forward.split(",") if f.strip()),
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        output_tokens=args.output_tokens,
        baseline_requests=args.baseline_requests,
        rounds=args.rounds,
        temperature=args.temperature,
        top_p=args.top_p,
        out=args.out,
        quantize=args.quantize,
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
