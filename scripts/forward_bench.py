"""Decode speed of one model step: Hugging Face eager vs the compact forward (eager, compiled).

    PYTHONPATH=$PWD .venv/bin/python scripts/forward_bench.py --batch 1,16 --steps 64
    PYTHONPATH=$PWD .venv/bin/python scripts/forward_bench.py --systems eager,int8,int4 --batch 1
    PYTHONPATH=$PWD .venv/bin/python scripts/forward_bench.py --systems eager@float32,eager@bfloat16

For each batch size every system prefills the same B prompts of --prompt-tokens tokens (the
shared chat prompts, tokenised and cycled), then runs --steps greedy decode steps, feeding back
its own argmax; only the decode steps are timed. The Hugging Face step is the engine's today
(DynamicCache, attention mask grown by one column, position ids). Systems are interleaved over
--rounds rounds and the median round is reported, since the machine is shared and noisy.
Systems: hf, eager, compiled (the compact forward with torch.compile), graphs (with CUDA graphs,
a GPU only), int8 and int4 (eager, quantized weights on our C kernels, the CPU only; the KV
cache as `auto` picks it, int4-kv-float32 and int4-kv-bfloat16 in that dtype), int8-aten
and int4-aten (the same on torch's weight-only kernels), int4-compiled, int4-small-pages
(the weights left in 4 KiB pages, forward/huge_pages.py) and int4-mapped, int8-mapped (the
weights mapped from their file in the cache folder, as served: model/weight_cache.py), each in
--dtype or in its own (`eager@float32`); ratios and greedy agreement are against the first
system named.

Where the systems run: --thread main (this process's main thread), fresh (a new thread, as the
engine steps on its own), after-main (a new thread after the main thread ran a multi-threaded
matmul: torch's OpenMP workers form a team per calling thread, so this one meets a second team).
--thread-teams runs the bench in a fresh process per case, fresh then after-main, --rounds times
alternated, and prints each system's median tokens/s per case and how much longer a second team
makes its step:

    PYTHONPATH=$PWD .venv/bin/python scripts/forward_bench.py --systems int4 --batch 1 \
        --thread-teams --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import streaming_backend  # noqa: F401 - before torch: OpenMP's wait policy, as served

# isort: split
import torch
from transformers import DynamicCache

from streaming_backend.forward.runner import ForwardConfig, PromptChunk, SlotForward
from streaming_backend.forward.slots import CacheBudget
from streaming_backend.model.loading import LoadedModel, load_model
from streaming_backend.model.weight_cache import compact_model
from streaming_backend.prompts import encode_prompt, load_chat_prompts

# the compact forward's systems: name -> its ForwardConfig options
COMPACT = {
    "eager": {},
    "compiled": {"compile": True},  # torch.compile (inductor), CPU or GPU
    "graphs": {"cuda_graphs": True},  # CUDA graphs per batch bucket (a GPU only)
    "int8": {"quantize": "int8"},  # int8 weight-only weights (the CPU only)
    "int4": {"quantize": "int4"},
    "int4-compiled": {"quantize": "int4", "compile": True},
    "int4-small-pages": {"quantize": "int4", "huge_pages": False},  # the weights in 4 KiB pages
    "int8-aten": {"quantize": "int8", "matmul": "aten"},  # torch's kernels, not ours
    "int4-aten": {"quantize": "int4", "matmul": "aten"},
    # the KV cache in one dtype, not as auto picks it (forward/runner.py cache_dtype)
    "int4-kv-float32": {"quantize": "int4", "kv_cache_dtype": "float32"},
    "int4-kv-bfloat16": {"quantize": "int4", "kv_cache_dtype": "bfloat16"},
}
# the weights mapped from their weight file, as the served models run them: name -> quantize
MAPPED = {"int4-mapped": "int4", "int8-mapped": "int8"}
SYSTEMS = ("hf", *COMPACT, *MAPPED)
THREADS = ("main", "fresh", "after-main")  # where the systems are built and run (--thread)


@dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    model: str | None
    dtype: str
    systems: tuple[str, ...]
    batches: tuple[int, ...]
    prompt_tokens: int
    steps: int
    warmup_steps: int
    rounds: int
    threads: int | None
    out: Path | None
    thread: str = "main"  # one of THREADS
    thread_teams: bool = False  # each of fresh and after-main in a process of its own


def prompt_ids(loaded: LoadedModel, batch: int, length: int) -> list[list[int]]:
    """B prompts of exactly `length` tokens, from the shared chat prompts (cycled)."""
    ids = []
    for messages in load_chat_prompts():
        ids.extend(encode_prompt(loaded.tokenizer, messages=messages))
    rows = []
    for row in range(batch):
        start = (row * 37) % len(ids)
        rows.append([ids[(start + i) % len(ids)] for i in range(length)])
    return rows


@torch.inference_mode()
def run_hf(loaded: LoadedModel, prompts: list[list[int]], steps: int, warmup: int):
    """Hugging Face eager decode steps, as the engine runs them -> (seconds, ids [B, steps])."""
    model, device = loaded.model, loaded.device
    ids = torch.tensor(prompts, device=device)
    b, n = ids.shape
    mask = torch.ones_like(ids)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1)
    positions = torch.full((b, 1), n, dtype=torch.long, device=device)
    token = out.logits[:, -1].float().argmax(-1)
    chosen, started = [], 0.0
    for step in range(warmup + steps):
        if step == warmup:
            started = time.perf_counter()
        mask = torch.cat([mask, mask.new_ones((b, 1))], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        )
        positions += 1
        token = out.logits[:, -1].float().argmax(-1)
        chosen.append(token)
    elapsed = time.perf_counter() - started
    return elapsed, torch.stack(chosen[warmup:], dim=1).tolist()


@torch.inference_mode()
def run_slots(forward: SlotForward, prompts: list[list[int]], steps: int, warmup: int):
    """The compact forward's decode steps -> (seconds, greedy ids [B, steps])."""
    slots = [forward.cache.allocate() for _ in prompts]
    try:
        logits = forward.prefill([PromptChunk(s, p) for s, p in zip(slots, prompts)])
        token = logits.argmax(-1)
        chosen, started = [], 0.0
        for step in range(warmup + steps):
            if step == warmup:
                started = time.perf_counter()
            token = forward.decode(slots, token.tolist()).argmax(-1)
            chosen.append(token)
        elapsed = time.perf_counter() - started
    finally:
        for slot in slots:
            forward.cache.free(slot)
    return elapsed, torch.stack(chosen[warmup:], dim=1).tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of rows' greedy tokens equal up to the first difference, averaged over rows."""
    same = []
    for row_a, row_b in zip(a, b):
        prefix = next((i for i, (x, y) in enumerate(zip(row_a, row_b)) if x != y), len(row_a))
        same.append(prefix / len(row_a))
    return statistics.mean(same)


def split_system(spec: str, default_dtype: str) -> tuple[str, str]:
    """'eager@float32' -> ('eager', 'float32'); 'eager' -> ('eager', default_dtype)."""
    name, _, dtype = spec.partition("@")
    return name, dtype or default_dtype


def main(cfg: BenchConfig) -> dict:
    """Run every system at every batch size on cfg.thread (or, with cfg.thread_teams, in a
    process per case); print and return the figures."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.thread_teams:
        return thread_teams(cfg)
    if cfg.thread == "main":
        return measure(cfg)
    if cfg.thread == "after-main":
        torch.randn(2048, 2048) @ torch.randn(2048, 2048)  # the main thread's team
    result = []
    thread = threading.Thread(target=lambda: result.append(measure(cfg)))
    thread.start()
    thread.join()
    if not result:
        raise SystemExit(f"the bench failed on its {cfg.thread} thread")
    return result[0]


def thread_teams(cfg: BenchConfig) -> dict:
    """Each round, the bench in a fresh process on a fresh thread, then on one that meets a
    second thread team (after-main); per batch and system: each case's median tokens/s and the
    ratio of their step times."""
    cases = {"fresh": [], "after-main": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(cfg.rounds):
            for case, results in cases.items():
                out = Path(folder) / f"{case}.json"
                one = dataclasses.replace(cfg, thread=case, thread_teams=False, rounds=1, out=out)
                subprocess.run([sys.executable, __file__, *arguments(one)], check=True)
                results.append(json.loads(out.read_text()))
    figures = {}
    for batch in cfg.batches:
        for name in cfg.systems:
            rates = {
                case: statistics.median(r["batches"][str(batch)]["tokens_per_s"][name] for r in rs)
                for case, rs in cases.items()
            }
            longer = rates["fresh"] / rates["after-main"]
            figures[f"{batch} {name}"] = rates | {"step_after_main_vs_fresh": longer}
            print(
                f"batch {batch:>3} {name:>14}: fresh {rates['fresh']:.1f} tok/s, after-main "
                f"{rates['after-main']:.1f}; a second thread team makes the step {longer:.2f}x "
                "as long",
                flush=True,
            )
    if cfg.out:
        cfg.out.write_text(json.dumps(figures, indent=2))
    return figures


def measure(cfg: BenchConfig) -> dict:
    """Run every system at every batch size on this thread; print and return the figures."""
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    specs = {spec: split_system(spec, cfg.dtype) for spec in cfg.systems}
    models = {dtype: load_model(cfg.model, dtype=dtype) for _, dtype in specs.values()}
    loaded_for = {spec: models[dtype] for spec, (_, dtype) in specs.items()}
    loaded = next(iter(models.values()))  # the tokenizer and the name
    max_len = cfg.prompt_tokens + cfg.warmup_steps + cfg.steps + 1
    budget = CacheBudget(fraction=0.25)
    started = time.monotonic()
    slots = max(cfg.batches)
    forwards = {
        spec: SlotForward.create(
            loaded_for[spec], ForwardConfig(budget, max_len, slots, **COMPACT[name])
        )
        for spec, (name, _) in specs.items()
        if name in COMPACT
    }
    for spec, (name, dtype) in specs.items():
        if name in MAPPED:
            skeleton = load_model(cfg.model, dtype=dtype, weights=False)
            config = ForwardConfig(budget, max_len, slots, quantize=MAPPED[name])
            model = compact_model(skeleton, MAPPED[name])
            forwards[spec] = SlotForward.create(skeleton, config, model)
    setup_s = time.monotonic() - started
    compiled = [f.compile_seconds for f in forwards.values() if f.compile_seconds is not None]
    result = {
        "model": loaded.name,
        "dtype": {spec: str(loaded_for[spec].dtype) for spec in specs},
        "device": str(loaded.device),
        "threads": torch.get_num_threads(),
        "compile_seconds": compiled,
        "setup_seconds": setup_s,
        "config": {k: str(v) for k, v in cfg.__dict__.items()},
        "batches": {},
    }
    for batch in cfg.batches:
        prompts = prompt_ids(loaded, batch, cfg.prompt_tokens)
        rates = {name: [] for name in cfg.systems}
        tokens = {}
        for _ in range(cfg.rounds):
            for name in cfg.systems:
                if specs[name][0] == "hf":
                    seconds, ids = run_hf(loaded_for[name], prompts, cfg.steps, cfg.warmup_steps)
                else:
                    seconds, ids = run_slots(forwards[name], prompts, cfg.steps, cfg.warmup_steps)
                rates[name].append(batch * cfg.steps / seconds)
                tokens[name] = ids
                print(f"  batch {batch} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
        medians = {name: statistics.median(r) for name, r in rates.items()}
        base = cfg.systems[0]
        result["batches"][batch] = {
            "tokens_per_s": medians,
            "rounds": rates,
            "baseline": base,
            "vs_baseline": {name: medians[name] / medians[base] for name in cfg.systems},
            "greedy_agreement_with_baseline": {
                name: agreement(tokens[name], tokens[base]) for name in cfg.systems
            },
        }
        print_batch(batch, result["batches"][batch])
    if cfg.out:
        cfg.out.write_text(json.dumps(result, indent=2))
    return result


def print_batch(batch: int, figures: dict) -> None:
    """One line per system and the ratios."""
    rates, rounds, base = figures["tokens_per_s"], figures["rounds"], figures["baseline"]
    for name, rate in rates.items():
        spread = ", ".join(f"{r:.1f}" for r in rounds[name])
        print(
            f"batch {batch:>3} {name:>14}: {rate:8.1f} tok/s (rounds: {spread}); "
            f"{figures['vs_baseline'][name]:.2f}x {base}, greedy agreement with {base} "
            f"{figures['greedy_agreement_with_baseline'][name]:.2f}",
            flush=True,
        )


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """Command line -> BenchConfig."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model folder, .gguf or hub id (default model)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--systems",
        default="hf,eager,compiled",
        help=f"comma-separated, from {', '.join(SYSTEMS)}, each optionally @dtype "
        "(eager@float32); the first is the baseline",
    )
    parser.add_argument("--batch", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--warmup-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--thread", choices=THREADS, default="main", help="where systems run")
    parser.add_argument(
        "--thread-teams", action="store_true", help="fresh against after-main, a process each"
    )
    args = parser.parse_args(argv)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = sorted({split_system(s, "")[0] for s in systems} - set(SYSTEMS))
    if unknown or not systems:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return BenchConfig(
        model=args.model,
        dtype=args.dtype,
        systems=systems,
        batches=tuple(int(b) for b in args.batch.split(",")),
        prompt_tokens=args.prompt_tokens,
        steps=args.steps,
        warmup_steps=args.warmup_steps,
        rounds=args.rounds,
        threads=args.threads,
        out=args.out,
        thread=args.thread,
        thread_teams=args.thread_teams,
    )


def arguments(cfg: BenchConfig) -> list[str]:
    """The command line of a BenchConfig (parse_args' inverse)."""
    options = {
        "--dtype": cfg.dtype,
        "--systems": ",".join(cfg.systems),
        "--batch": ",".join(map(str, cfg.batches)),
        "--prompt-tokens": cfg.prompt_tokens,
        "--steps": cfg.steps,
        "--warmup-steps": cfg.warmup_steps,
        "--rounds": cfg.rounds,
        "--thread": cfg.thread,
        "--model": cfg.model,
        "--threads": cfg.threads,
        "--out": cfg.out,
    }
    argv = [
        str(part) for key, value in options.items() if value is not None for part in (key, value)
    ]
    return argv + (["--thread-teams"] if cfg.thread_teams else [])


if __name__ == "__main__":
    main(parse_args())
