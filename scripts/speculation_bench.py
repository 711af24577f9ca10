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
(16 chats at once). A request to copy is not an answer that copies: a small model may answer a
rename with an explanation. So each copy prompt's line gives the share of its plain answer's
tokens that lie in a run of 4 tokens its prompt holds too, and the `copying` line sums the copy
prompts whose plain answers copy at least half their tokens (the text speculation is for).
A set's figures are its tokens over its seconds, each way: of the decode
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
from dataclasses import dataclass, field, replace

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
    (
        "repeat",
        "Repeat the following text exactly, word for word:\n\nThe quick brown fox jumps over the "
        "lazy dog near the river bank, while the farmer watches from his porch and drinks his "
        "morning coffee.",
    ),
    (
        "zh-repeat",
        "请一字不差地重复下面这段话：春天来了，公园里的花都开了，孩子们在草地上放风筝，"
        "老人们坐在长椅上聊天。",
    ),
)

COPIED_GRAM = 4  # an answer's token is copied where it lies in a 4-gram the prompt holds
COPYING = 0.5  # a copying answer: at least half its tokens copied


def copied_fraction(answer: list[int], prompt: list[int]) -> float:
    """The share of the answer's tokens that lie in some run of COPIED_GRAM tokens found in the
    prompt too: how much of it copies its context, whatever was asked."""
    n = COPIED_GRAM
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(answer)
    for i in range(len(answer) - n + 1):
        if tuple(answer[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(answer) if answer else 0.0


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

    def add(self, other: Tally) -> None:
        """Count `other`'s tokens and seconds in too."""
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.decoded += other.decoded
        self.decode_seconds += other.decode_seconds


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


@dataclass
class Group:
    """One group's figures over the rounds, each way."""

    plain: Tally
    spec: Tally
    same: int = 0  # identical answers
    total: int = 0  # answers
    # plain over speculative decode seconds, each round
    pairs: list[float] = field(default_factory=list)
    copied: float = 0.0  # of the plain answers' tokens, the share copied from their prompts


def measure(engine, sets, settings, rounds) -> dict[str, list[Group]]:
    """Per set, per group of prompts: its Group."""
    results = {}
    for name, groups in sets.items():
        results[name] = [Group(Tally(), Tally()) for _ in groups]
        for round_ in range(rounds):
            for index, prompts in enumerate(groups):
                group = results[name][index]
                ways = [False, True] if (round_ + index) % 2 == 0 else [True, False]
                got, seconds_of = {}, {}
                for way in ways:
                    run = _run(engine, prompts, replace(settings, speculate=way))
                    tally = group.spec if way else group.plain
                    tally.tokens += sum(len(o) for o in run.outputs)
                    tally.seconds += run.seconds
                    tally.decoded += sum(max(len(o) - 1, 0) for o in run.outputs)
                    tally.decode_seconds += run.decode_seconds
                    got[way], seconds_of[way] = run.outputs, run.decode_seconds
                if seconds_of[True] > 0:
                    group.pairs.append(seconds_of[False] / seconds_of[True])
                group.same += sum(a == b for a, b in zip(got[False], got[True]))
                group.total += len(prompts)
                if round_ == 0:  # plain answers are the same every round
                    copied = sum(
                        copied_fraction(a, p) * len(a) for a, p in zip(got[False], prompts)
                    )
                    group.copied = copied / max(1, sum(len(a) for a in got[False]))
    return results


def combined(groups: list[Group]) -> tuple[Tally, Tally, int, int, list[float]]:
    """The groups' figures together: plain, speculative, identical, answers, pairs."""
    plain, spec = Tally(), Tally()
    for group in groups:
        plain.add(group.plain)
        spec.add(group.spec)
    pairs = [p for g in groups for p in g.pairs]
    return plain, spec, sum(g.same for g in groups), sum(g.total for g in groups), pairs


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
    if "copy" in results:  # each prompt, then those whose plain answer does copy its context
        for (label, _), group in zip(COPY_PROMPTS, results["copy"]):
            ratio = (
                group.spec.decode_rate / group.plain.decode_rate if group.plain.decode_rate else 0
            )
            answer = group.plain.tokens // max(1, args.rounds)
            print(f"  {label:14s} {answer:4d} tokens, {group.copied:4.0%} copied: {ratio:.2f}x")
        results["copying"] = [g for g in results["copy"] if g.copied >= COPYING]
    report = {}
    for name, groups in results.items():
        plain, spec, same, total, pairs = combined(groups)
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
