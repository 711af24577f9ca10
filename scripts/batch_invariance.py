"""Alone against a crowd, as served: the shipped chats' answers asked one at a time, then all at
once while long prompts arrive beside them, through the OpenAI API of a running server.

    .venv/bin/tokenstream serve &           # the defaults: dtype and quantize auto
    PYTHONPATH=. .venv/bin/python scripts/batch_invariance.py --url http://127.0.0.1:8080/v1

Each chat is asked greedy (temperature 0) and seeded (temperature 1, --seed), --max-tokens new
tokens, streamed. Alone: one request at a time. Crowd: all of them at once, and once the first
answer's first token is out, --long prompts of about --long-words words each (max_tokens 8),
whose prefill runs in chunks between the chats' decode steps. Prints how many answers of each
kind were identical, the system_fingerprint each run reported, and exits 1 unless all were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass

import openai

from streaming_backend.prompts import load_chat_prompts

LONG_TEXT = (
    "Summarise the following notes from a long meeting about planning a community garden, "
    "its budget, the volunteers' rota, the soil tests and the water supply. "
)


@dataclass(frozen=True)
class Ask:
    """One chat request: its messages and its sampling."""

    messages: list
    temperature: float
    seed: int | None


async def answer(client: openai.AsyncOpenAI, model: str, ask: Ask, max_tokens: int, started=None):
    """The streamed answer's text and system_fingerprint; sets `started` at its first token."""
    stream = await client.chat.completions.create(
        model=model,
        messages=ask.messages,
        max_tokens=max_tokens,
        temperature=ask.temperature,
        seed=ask.seed,
        stream=True,
    )
    parts, fingerprint = [], None
    async for chunk in stream:
        fingerprint = getattr(chunk, "system_fingerprint", None) or fingerprint
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if started is not None:
                started.set()
    return "".join(parts), fingerprint


async def run(args: argparse.Namespace) -> dict:
    """Ask alone, then in a crowd; return the comparison as a dict."""
    client = openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
    chats = load_chat_prompts()[: args.chats]
    asks = [Ask(m, 0.0, None) for m in chats] + [Ask(m, 1.0, args.seed) for m in chats]
    alone = [await answer(client, args.model, ask, args.max_tokens) for ask in asks]
    started = asyncio.Event()
    crowd_tasks = [
        asyncio.create_task(answer(client, args.model, ask, args.max_tokens, started))
        for ask in asks
    ]
    await started.wait()
    long_ask = Ask([{"role": "user", "content": LONG_TEXT * args.long_words_x}], 0.0, None)
    long_tasks = [
        asyncio.create_task(answer(client, args.model, long_ask, 8)) for _ in range(args.long)
    ]
    crowd = await asyncio.gather(*crowd_tasks)
    await asyncio.gather(*long_tasks)
    await client.close()
    n = len(chats)
    same = [a[0] == c[0] for a, c in zip(alone, crowd)]
    return {
        "greedy_identical": sum(same[:n]),
        "seeded_identical": sum(same[n:]),
        "chats": n,
        "fingerprints": sorted({f for _, f in alone + crowd if f}),
        "differing": [
            {"chat": i % n, "seeded": i >= n, "alone": a[0], "crowd": c[0]}
            for i, (a, c) in enumerate(zip(alone, crowd))
            if a[0] != c[0]
        ],
    }


def main(argv: list[str] | None = None) -> dict:
    """Parse options, run, print the result; exit status 1 unless every answer was identical."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080/v1", help="OpenAI API base URL")
    parser.add_argument("--model", default="chat")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--chats", type=int, default=8, help="shipped chats asked (8)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--long", type=int, default=8, help="long prompts in the crowd (8)")
    parser.add_argument(
        "--long-words-x", type=int, default=12, help="repeats of a 30-word paragraph (12)"
    )
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2, ensure_ascii=False))
    n = result["chats"]
    print(
        f"alone vs crowd: greedy {result['greedy_identical']}/{n} identical, "
        f"seeded {result['seeded_identical']}/{n} identical"
    )
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if not outcome["differing"] else 1)
