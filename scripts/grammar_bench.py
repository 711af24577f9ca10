"""Throughput with every stream constrained by a JSON schema vs unconstrained, and the mask's
cost per token, in one run on the engine (no server).

    PYTHONPATH=$PWD .venv/bin/python scripts/grammar_bench.py --streams 16 --tokens 128

Each round submits --streams streams of --tokens tokens each (the shipped chat prompts, cycled),
once free and once with every stream under SCHEMA, a list of records that cannot be complete
before --tokens tokens, so both runs generate the same number of tokens; with --mask-ahead both,
the constrained run twice: masks filled on the engine thread after each forward, and filled
ahead on a worker while the forward runs (the engine's choice: ahead on a GPU only). Runs
alternate over --rounds rounds (the machine is shared and noisy) and medians are reported. The
model runs as served (--dtype auto, quantize auto). The mask time is the engine thread's time in
grammar.apply_grammar_masks (filling the masks not filled ahead, waiting for those that were,
applying them), per step and per constrained token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from streaming_backend.configuration.models import EngineConfig
from streaming_backend.engine import Engine
from streaming_backend.model.loading import default_model_path, load_model, resolve_quantize
from streaming_backend.prompts import encode_prompt, load_chat_prompts
from streaming_backend.sampling import logits as logits_module
from streaming_backend.sampling.settings import SamplingSettings

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
    """Wraps the logits pipeline's apply_grammar_masks: total seconds, calls, constrained rows."""

    def __init__(self, apply) -> None:
        self.apply, self.seconds, self.calls, self.rows = apply, 0.0, 0, 0

    def __call__(self, logits, matchers):
        start = time.perf_counter()
        out = self.apply(logits, matchers)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.rows += sum(m is not None for m in matchers)
        return out

    def figures(self) -> dict[str, float]:
        return {
            "ms_per_step": round(1e3 * self.seconds / max(self.calls, 1), 3),
            "us_per_token": round(1e6 * self.seconds / max(self.rows, 1), 1),
        }


def run(engine: Engine, prompts: list[list[int]], settings: SamplingSettings) -> tuple[int, float]:
    """(tokens generated, seconds) for all prompts submitted at once."""
    start = time.perf_counter()
    handles = [engine.submit(p, settings) for p in prompts]
    tokens = sum(sum(len(e.token_ids) for e in h) for h in handles)
    return tokens, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the shipped one)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--mask-ahead", choices=("on", "off", "both"), default="both")
    args = parser.parse_args(argv)
    loaded = load_model(args.model or str(default_model_path()), dtype=args.dtype, device="cpu")
    chats = load_chat_prompts()
    prompts = [
        encode_prompt(loaded.tokenizer, messages=chats[i % len(chats)]) for i in range(args.streams)
    ]
    common = {"max_tokens": args.tokens, "temperature": 0.7, "seed": 1, "ignore_eos": True}
    free = SamplingSettings.parse(common)
    constrained = SamplingSettings.parse({**common, "guided_json": SCHEMA})
    config = EngineConfig(max_streams=args.streams, queue_limit=args.streams)
    runs = [("free", free, False)]
    if args.mask_ahead in ("off", "both"):
        runs.append(("json", constrained, False))
    if args.mask_ahead in ("on", "both"):
        runs.append(("json_ahead", constrained, True))
    rates = {name: [] for name, _, _ in runs}
    counts = {name: [] for name, _, _ in runs}
    apply = logits_module.apply_grammar_masks
    timers = {name: MaskTimer(apply) for name, _, _ in runs}
    try:
        with Engine(loaded, config) as engine:
            run(engine, prompts[:2], constrained)  # warm up: the grammar compiles, caches fill
            for _ in range(args.rounds):
                for name, settings, ahead in runs:
                    engine.mask_ahead = ahead
                    logits_module.apply_grammar_masks = timers[name]
                    tokens, seconds = run(engine, prompts, settings)
                    rates[name].append(tokens / seconds)
                    counts[name].append(tokens)
    finally:
        logits_module.apply_grammar_masks = apply
    medians = {name: statistics.median(r) for name, r in rates.items()}
    result = {
        "model": loaded.name,
        "dtype": str(loaded.dtype),
        "quantize": resolve_quantize(config.quantize, loaded),
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "tokens_per_s": {name: round(rate, 1) for name, rate in medians.items()},
        "ratio_to_free": {name: round(rate / medians["free"], 3) for name, rate in medians.items()},
        "mask": {name: timers[name].figures() for name in rates if name != "free"},
        "rounds": {k: [round(r, 1) for r in v] for k, v in rates.items()},
        "tokens": counts,  # per run: each should be streams * tokens (no stream ended early)
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
