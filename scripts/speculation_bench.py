"""Speculative decoding's speed, one stream and 16, with and without it in the same run.

    PYTHONPATH=$PWD nice -n -19 .venv/bin/python scripts/speculation_bench.py --rounds 3
    PYTHONPATH=$PWD .venv/bin/python scripts/speculation_bench.py --sets copy --max-tokens 64
    PYTHONPATH=$PWD .venv/bin/python scripts/speculation_bench.py --draft-model ../models/draft-8

One engine serves the model as `tokenstream serve` loads it (dtype and quantize auto) with
`speculative=ngram` (or `draft`, with --draft-model: scripts/make_draft_model.py makes one); each
request runs twice, once with `speculate` false (plain decoding) and
once with it true, alternated (which goes first alternates too), so both see the same machine.
Sets: `copy` (prompts whose answer copies its context: code edits, corrections, lists, quoting,
in English and Chinese, below), `chat` (the shipped chats, streaming_backend/data), and `crowd`
(16 chats at once). A set's figures are its tokens over its seconds, each way: of the decode
steps (the first token to the last, the tokens after each stream's first: what speculation
speeds up) and end to end (submission to the last token, prefill included: the same either way).
Ratios are with over without; the median pair is the median of each prompt's decode seconds
without over with, the two runs back to back (robust to a burst of other work on a shared
machine). Every answer is compared: the
count of identical ones is printed (speculation must change none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, replace

from streaming_backend.engine import Engine, EngineConfig
from streaming_backend.model.loading import load_model
from streaming_backend.prompts import encode_prompt, load_chat_prompts
from streaming_backend.sampling.settings import SamplingSettings

CODE = """def total_price(items, tax):
    s = 0
    for it in items:
        s = s + it["price"] * it["qty"]
    s = s * (1 + tax)
    return round(s, 2)"""

# (label, user message): each answer mostly copies text of its prompt
COPY_PROMPTS = (
    (
        "code-rename",
        "Rename the variable s to subtotal in this function. Give back the whole "
        f"function and nothing else.\n\n{CODE}",
    ),
    (
        "correction",
        "Correct the spelling mistakes in this paragraph and give back the whole "
        "paragraph: The weather was realy nice yesterday, so we walked to the beech and ate "
        "sandwitches. Afterwards we went home and watched a movie togehter.",
    ),
    (
        "list",
        "Turn this into a numbered list, one item per line: apples, oranges, bananas, "
        "pears, grapes, plums, cherries, lemons, limes, mangoes",
    ),
    (
        "quote",
        "Quote the second sentence of this text exactly.\n\nThe library opens at nine. "
        "Visitors must leave their bags at the front desk before entering the reading room. "
        "Books may be borrowed for three weeks.",
    ),
    (
        "zh-correction",
        "改正这段话中的错别字，并完整地给出改正后的段落：今天天气很好，我们去公圆散步，"
        "看到了很多美丽的花朵和在湖里游泳的小鸭子。",
    ),
    ("zh-list", "把下面的内容写成编号列表，每行一项：苹果、香蕉、橙子、葡萄、西瓜、草莓、桃子、梨"),
    (
        "zh-quote",
        "请原文引用下面这段话的第一句：人工智能正在改变我们的生活方式。它被用于医疗、教育和交通"
        "等许多领域。",
    ),
    ("zh-code", f"把这个函数里的变量 s 改名为 subtotal，完整地给出整个函数。\n\n{CODE}"),
)


@dataclass
class Tally:
    """Tokens and seconds of one way (with or without speculation): from submission to the
    last token, and of the decode steps alone (first token to last, the tokens after each
    stream's first: what speculation can speed up; prefill is the same either way)."""

    tokens: int = 0
    seconds: float = 0.0
    decoded: int = 0
    decode_seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_rate(self) -> float:
        return self.decoded / self.decode_seconds if self.decode_seconds else 0.0


@dataclass
class Run:
    """One group of prompts submitted at once."""

    outputs: list[list[int]]
    seconds: float  # submission to the last token
    decode_seconds: float  # the first token (of any stream) to the last


def _run(engine: Engine, prompts: list[list[int]], settings: SamplingSettings) -> Run:
    """Submit every prompt at once and wait for every answer."""
    start = time.perf_counter()
    handles = [engine.submit(p, settings) for p in prompts]
    events = [list(handle) for handle in handles]
    seconds = time.perf_counter() - start
    emitted = [e.emitted_ns for stream in events for e in stream if e.token_ids]
    outputs = [[t for event in stream for t in event.token_ids] for stream in events]
    return Run(outputs, seconds, (max(emitted) - min(emitted)) / 1e9 if emitted else 0.0)


def measure(engine, sets, settings, rounds):
    """Per set: (plain Tally, speculative Tally, identical answers, answers, each pair's speedup:
    plain seconds over speculative seconds of the same prompts, one after the other)."""
    results = {}
    for name, groups in sets.items():
        plain, spec, same, total, pairs = Tally(), Tally(), 0, 0, []
        for round_ in range(rounds):
            for index, prompts in enumerate(groups):
                ways = [False, True] if (round_ + index) % 2 == 0 else [True, False]
                got, seconds_of = {}, {}
                for way in ways:
                    run = _run(engine, prompts, replace(settings, speculate=way))
                    tally = spec if way else plain
                    tally.tokens += sum(len(o) for o in run.outputs)
                    tally.seconds += run.seconds
                    tally.decoded += sum(max(len(o) - 1, 0) for o in run.outputs)
                    tally.decode_seconds += run.decode_seconds
                    got[way], seconds_of[way] = run.outputs, run.decode_seconds
                if seconds_of[True] > 0:
                    pairs.append(seconds_of[False] / seconds_of[True])
                same += sum(a == b for a, b in zip(got[False], got[True]))
                total += len(prompts)
        results[name] = (plain, spec, same, total, pairs)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    parser.add_argument("--sets", default="copy,chat,crowd")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--chats", type=int, default=8, help="shipped chats in the chat set")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument(
        "--draft-model", default=None, help="speculate with this draft model, not n-grams"
    )
    args = parser.parse_args()

    loaded = load_model(args.model, dtype="auto", device="cpu")
    tokenizer = loaded.tokenizer
    copy = [
        [encode_prompt(tokenizer, messages=[{"role": "user", "content": text}])]
        for _, text in COPY_PROMPTS
    ]
    chats = [encode_prompt(tokenizer, messages=m) for m in load_chat_prompts()]
    available = {
        "copy": copy,
        "chat": [[c] for c in chats[: args.chats]],
        "crowd": [[chats[i % len(chats)] for i in range(16)]],
    }
    sets = {name: available[name] for name in args.sets.split(",")}
    settings = SamplingSettings(
        temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens
    )
    mode = "draft" if args.draft_model else "ngram"
    config = EngineConfig(
        speculative=mode, draft_model=args.draft_model, forward="compact", max_streams=16
    )
    with Engine(loaded, config) as engine:
        _run(engine, copy[0], replace(settings, max_tokens=8))  # warm up
        results = measure(engine, sets, settings, args.rounds)
        counts = engine.draft_counts
    report = {}
    for name, (plain, spec, same, total, pairs) in results.items():
        ratio = spec.rate / plain.rate if plain.rate else 0.0
        decode = spec.decode_rate / plain.decode_rate if plain.decode_rate else 0.0
        median = statistics.median(pairs) if pairs else 0.0
        print(
            f"{name:6s} decode: off {plain.decode_rate:6.1f} {mode} {spec.decode_rate:6.1f} tok/s "
            f"{decode:.2f}x (median pair {median:.2f}x); end to end: off {plain.rate:6.1f} "
            f"{mode} {spec.rate:6.1f} tok/s {ratio:.2f}x; identical {same}/{total} "
            f"({plain.tokens} / {spec.tokens} tokens)"
        )
        report[name] = {"off": plain.rate, "ngram": spec.rate, "ratio": ratio,
                        "decode_off": plain.decode_rate, "decode_ngram": spec.decode_rate,
                        "decode_ratio": decode, "median_pair": median, "pairs": pairs,
                        "identical": same, "answers": total}  # fmt: skip
    print(f"drafted {counts.drafted}, accepted {counts.accepted} ({counts.rate:.0%})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
