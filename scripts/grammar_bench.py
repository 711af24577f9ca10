"""Throughput with every stream constrained by a JSON schema vs unconstrained, and the mask's
cost per token, in one run on the engine (no server).

    PYTHONPATH=$PWD .venv/bin/python scripts/grammar_bench.py --streams 16 --tokens 128

Each round submits --streams streams of --tokens tokens each (the shipped chat prompts, cycled),
once free and once with every stream under SCHEMA, a list of records that cannot be complete
before --tokens tokens, so both runs generate the same number of tokens. Free and constrained
runs alternate over --rounds rounds (the machine is shared and noisy) and the median is
reported. The mask time is the time spent in grammar.apply_grammar_masks (llguidance filling
every constrained row's mask, and applying it), per step and per constrained token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from streaming_backend import engine as engine_module
from streaming_backend.config import EngineConfig
from streaming_backend.engine import Engine
from streaming_backend.loading import default_model_path, load_model
from streaming_backend.prompts import encode_prompt, load_chat_prompts
from streaming_backend.settings import SamplingSettings

SCHEMA = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}


class MaskTimer:
    """Wraps the engine's apply_grammar_masks: total seconds, calls, constrained rows."""

    def __init__(self, apply) -> None:
        self.apply, self.seconds, self.calls, self.rows = apply, 0.0, 0, 0

    def __call__(self, logits, matchers):
        start = time.perf_counter()
        out = self.apply(logits, matchers)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.rows += sum(m is not None for m in matchers)
        return out


def run(engine: Engine, prompts: list[list[int]], settings: SamplingSettings) -> tuple[int, float]:
    """(tokens generated, seconds) for all prompts submitted at once."""
    start = time.perf_counter()
    handles = [engine.submit(p, settings) for p in prompts]
    tokens = sum(sum(len(e.token_ids) for e in h) for h in handles)
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    loaded = load_model(str(default_model_path()), dtype=args.dtype, device="cpu")
    chats = load_chat_prompts()
    prompts = [
        encode_prompt(loaded.tokenizer, messages=chats[i % len(chats)]) for i in range(args.streams)
    ]
    common = {"max_tokens": args.tokens, "temperature": 0.7, "seed": 1, "ignore_eos": True}
    free = SamplingSettings.parse(common)
    constrained = SamplingSettings.parse({**common, "guided_json": SCHEMA})
    timer = MaskTimer(engine_module.apply_grammar_masks)
    engine_module.apply_grammar_masks = timer
    config = EngineConfig(max_streams=args.streams, queue_limit=args.streams)
    rates: dict[str, list[float]] = {"free": [], "json": []}
    counts: dict[str, list[int]] = {"free": [], "json": []}
    with Engine(loaded, config) as engine:
        run(engine, prompts[:2], constrained)  # warm up: the grammar compiles, caches fill
        timer.seconds = timer.calls = timer.rows = 0
        for _ in range(args.rounds):
            for name, settings in (("free", free), ("json", constrained)):
                tokens, seconds = run(engine, prompts, settings)
                rates[name].append(tokens / seconds)
                counts[name].append(tokens)
    free_rate, json_rate = (statistics.median(rates[k]) for k in ("free", "json"))
    result = {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "free_tokens_per_s": round(free_rate, 1),
        "json_tokens_per_s": round(json_rate, 1),
        "ratio": round(json_rate / free_rate, 3),
        "mask_ms_per_step": round(1e3 * timer.seconds / max(timer.calls, 1), 3),
        "mask_us_per_token": round(1e6 * timer.seconds / max(timer.rows, 1), 1),
        "rounds": {k: [round(r, 1) for r in v] for k, v in rates.items()},
        "tokens": counts,  # per run: both should be streams * tokens (no stream ended early)
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
